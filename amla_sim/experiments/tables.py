"""The papers' accuracy tables: what each one measures, on which inputs, and the published numbers."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from dataclasses import dataclass, field

import numpy as np

from ..algorithms import amla, base, etap, golden, snapmla
from ..machines import Machine
from .inputs import make_inputs
from .metrics import cos_diff, rel_frobenius, rmse


@dataclass(frozen=True)
class Table:
    """A published table: rows are distributions, columns algorithms, each cell a metric averaged over samples."""

    name: str
    title: str
    distributions: tuple[tuple[str, str], ...]  # (our --dist spec, the paper's label)
    algorithms: tuple[str, ...]
    metric: str  # the metric the paper reports (others are recorded too)
    paper: dict[tuple[str, str], float] = field(default_factory=dict)  # (paper label, algorithm) -> value
    heads: int = 128
    context: int = 8192
    sq: int = 1
    block: int = 128
    input_format: str = "bf16"
    sampler: str = "round"  # how make_inputs draws them (``table``: the exact rounded distribution, faster)
    source: str = ""


_T3 = {"N(0, 1)": (1.77e-3, 1.81e-3), "N(0, 4)": (1.74e-3, 1.75e-3), "N(0, 9)": (1.65e-3, 1.66e-3),
       "N(0, 16)": (1.51e-3, 1.51e-3), "N(0, 25)": (1.33e-3, 1.35e-3), "N(0, 100)": (7.82e-4, 7.86e-4)}
_T4 = {"U(-1, 1)": (1.97e-3, 2.01e-3), "U(-3, 3)": (1.77e-3, 1.78e-3), "U(-5, 5)": (1.69e-3, 1.69e-3),
       "U(-10, 10)": (1.24e-3, 1.24e-3), "U(-20, 20)": (7.04e-4, 7.04e-4), "U(-60, 60)": (2.26e-4, 2.26e-4)}


def _paper(values: dict[str, tuple[float, float]]) -> dict[tuple[str, str], float]:
    out = {}
    for label, (b, a) in values.items():
        out[(label, "base")] = b
        out[(label, "amla")] = a
    return out


TABLES: dict[str, Table] = {
    "amla-table3": Table(
        "amla-table3", "AMLA paper, Table 3: relative Frobenius error against Golden, Gaussian inputs",
        tuple((f"normal:{math.sqrt(v):g}", f"N(0, {v})") for v in (1, 4, 9, 16, 25, 100)),
        ("base", "amla"), "rel_frobenius", _paper(_T3), sampler="table", source="arXiv AMLA, Section 5.1",
    ),
    "amla-table4": Table(
        "amla-table4", "AMLA paper, Table 4: relative Frobenius error against Golden, uniform inputs",
        tuple((f"uniform:{a}", f"U(-{a}, {a})") for a in (1, 3, 5, 10, 20, 60)),
        ("base", "amla"), "rel_frobenius", _paper(_T4), sampler="table", source="arXiv AMLA, Section 5.1",
    ),
    "etap-table1": Table(
        "etap-table1", "ETAP paper, Table 1: RMSE against FP64, FP16, FA3's inputs (the FA3 figure is FA3's own)",
        (("fa3-outliers", "N(0,1) + N(0,100) Bernoulli(0.001)"),),
        ("fa3-base", "etap"), "rmse",
        {("N(0,1) + N(0,100) Bernoulli(0.001)", "fa3-base"): 1.9e-4,
         ("N(0,1) + N(0,100) Bernoulli(0.001)", "etap"): 1.25e-5},
        heads=16, context=65536, block=64, input_format="fp16", source="arXiv FlashMLA-ETAP, Table 1",
    ),
    "snapmla-configs": Table(
        "snapmla-configs", "SnapMLA paper, Table 2 configs: errors against the BF16 golden (the paper plots them)",
        (("flashmla", "FlashMLA test inputs"), ("rope-outliers", "RoPE outliers ~1e3, content within +-10")),
        ("snapmla", "A", "B", "C", "D"), "rmse", {}, heads=128, context=4096, block=64, input_format="fp32",
        source="arXiv SnapMLA, Section 4.3 (Figure 4: no numbers given)",
    ),
}


def _bf16_golden(q: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """SnapMLA's reference: attention of the BF16-rounded inputs (FP64 arithmetic), output in FP64."""
    from ..formats import round_to

    return golden(round_to(q, "bf16"), round_to(kv, "bf16")).out


def _snapmla_out(q: np.ndarray, kv: np.ndarray, mc: Machine, blk: int, *, config: str) -> np.ndarray:
    return snapmla(q, kv, machine=mc, block=blk, config=config).out


RUNNERS: dict[str, Callable[..., np.ndarray]] = {
    "base": lambda q, kv, mc, blk: base(q, kv, machine=mc, block=blk).out,
    "amla": lambda q, kv, mc, blk: amla(q, kv, machine=mc, block=blk).out,
    "fa3-base": lambda q, kv, mc, blk: base(q, kv, machine=mc, block=blk, p_format="fp16", io_format="fp16").out,
    "etap": lambda q, kv, mc, blk: etap(q, kv, machine=mc, block=blk, p_format="fp16", io_format="fp16").out,
    **{cfg: partial(_snapmla_out, config=cfg) for cfg in ("snapmla", "A", "B", "C", "D")},
}


def run_sample(table: Table, dist: str, sample: int, *, machine: Machine, context: int, heads: int,
               seed: int) -> list[dict]:
    """One sample of one distribution: inputs, the reference, every algorithm of the table, its metrics."""
    task_seed = _task_seed(seed, table.name, dist, sample)
    q, kv = make_inputs(dist, heads=heads, sq=table.sq, context=context, seed=task_seed, fmt=table.input_format,
                        sampler=table.sampler)
    ref = _bf16_golden(q, kv) if table.name == "snapmla-configs" else golden(q, kv).out
    rows = []
    for alg in table.algorithms:
        out = RUNNERS[alg](q, kv, machine, table.block)
        rows.append({"distribution": dist, "sample": sample, "algorithm": alg,
                     "rel_frobenius": rel_frobenius(out, ref), "rmse": rmse(out, ref), "cos_diff": cos_diff(out, ref)})
    return rows


def _task_seed(seed: int, *parts: object) -> int:
    import zlib

    return zlib.crc32("/".join(map(str, (seed, *parts))).encode())

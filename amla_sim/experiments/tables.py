"""The papers' accuracy tables: what each one measures, on which inputs, and the published numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .._seeds import derive_seed
from ..machines import Machine
from .grid import Grid, sample_errors
from .specs import parse_algorithm


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
    machine: str = "ieee32-fast"  # the machine reproduce runs it on unless told otherwise
    specs: tuple[tuple[str, str], ...] = ()  # (label, sweep spec) of columns added to the paper's (with_algorithms)


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


@dataclass(frozen=True)
class CacheColumn:
    """One column of the low-precision cache table: MLA over one cache format through one kernel, as deployed."""

    label: str  # the column (the algorithm of results.csv and summary.json)
    spec: str  # the sweep spec that runs it (label=algorithm:options), on the table's BF16 inputs
    precision: str  # the cache's element format as a short name: bf16, fp8 (E4M3), fp4 (E2M1), ...
    cache: str  # what the cache holds, and how it is quantized
    kernel: str  # the kernel, and who runs it


_V32_BF16 = "BF16, DeepSeek V3.2's sparse attention (every token selected: the dense decode's keys)"
_SNAPMLA = {"snapmla": "E4M3 content, per-token scales, RoPE in BF16",
            "A": "E4M3 RoPE and content, one per-token scale over all 576 dims",
            "B": "E4M3 content, static scale 1.0, RoPE in BF16",
            "C": "E4M3 content, a per-tensor (dynamic) scale, RoPE in BF16",
            "D": "E4M3 content, per-block scales, RoPE in BF16"}

#: The low-precision cache table's columns (``reproduce fp8-mla``), each over the same BF16 draws: another cache
#: format or kernel is one more entry (its algorithm registered, its spec here).
LOW_PRECISION_CACHE: tuple[CacheColumn, ...] = (
    CacheColumn("flashmla", "flashmla", "bf16", "BF16", "FlashMLA's dense decode"),
    CacheColumn("fa3-mla-sparse", "fa3-mla-sparse", "bf16", _V32_BF16,
                "FA3's sparse call (vLLM's FLASH_ATTN_MLA_SPARSE, SGLang's DSA fa3 decode)"),
    CacheColumn("flashmla-sparse-prefill", "flashmla-sparse-prefill", "bf16", _V32_BF16,
                "FlashMLA's sparse prefill kernel (vLLM's FLASHMLA_SPARSE, SGLang's DSA prefill on Hopper)"),
    CacheColumn("flashmla-sparse-fp8", "flashmla-sparse-fp8", "fp8", "DeepSeek V3.2's FP8 cache: E4M3 content with "
                "per-tile power-of-two scales, RoPE in BF16 (every token selected)", "FlashMLA's sparse FP8 decode"),
    CacheColumn("flashmla-dense-fp8", "flashmla-dense-fp8", "fp8", "E4M3, per-tensor scale 1 (Q in E4M3 too)",
                "vLLM's FLASHMLA backend with an FP8 cache: FlashMLA's dense FP8 decode"),
    CacheColumn("vllm-triton-fp8", "vllm-triton-fp8=vllm-triton-mla:kv_cache=fp8:run_on=sm90-triton", "fp8",
                "E4M3, per-tensor scale 1", "vLLM's TRITON_MLA decode with an FP8 cache (on sm90-triton)"),
    CacheColumn("flashinfer-mla", "flashinfer-mla", "bf16", "BF16",
                "FlashInfer's MLA decode (SGLang's flashinfer backend, vLLM's FLASHINFER_MLA)"),
    CacheColumn("sglang-fp4", "sglang-fp4=flashinfer-mla:kv_cache=fp4_mx_block16", "fp4",
                "SGLang's fp4_mx_block16: E2M1 values, one power-of-two scale per 16 (RoPE too), read back to BF16",
                "FlashInfer's MLA decode (SGLang's flashinfer backend, the one it allows for an FP4 cache on Hopper)"),
    *(CacheColumn(cfg, "snapmla" if cfg == "snapmla" else f"{cfg}=snapmla:config={cfg}", "fp8", cache,
                  "SnapMLA" if cfg == "snapmla" else f"SnapMLA, ablation config {cfg}")
      for cfg, cache in _SNAPMLA.items()),
)

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
    "etap-table1-kernel": Table(
        "etap-table1-kernel", "ETAP Table 1 on the authors' kernel (39e6160) and FA3's MLA decode: RMSE against FP64, "
        "FP16",
        (("normal:1", "N(0, 1)"), ("fa3-outliers", "N(0,1) + N(0,100) Bernoulli(0.001)")),
        ("flashmla-etap", "fa3-mla", "fa3-base", "etap"), "rmse",
        {("N(0, 1)", "flashmla-etap"): 1.25e-5, ("N(0,1) + N(0,100) Bernoulli(0.001)", "fa3-mla"): 1.9e-4,
         ("N(0,1) + N(0,100) Bernoulli(0.001)", "fa3-base"): 1.9e-4},
        heads=16, context=4096, block=64, input_format="fp16",
        source="arXiv FlashMLA-ETAP, Table 1 (setup: Section 4; FP16, 16 heads, contexts 512-64K); FA3's figure "
               "is the FA3 paper's, on its own inputs",
    ),
    "fp8-mla": Table(  # the low-precision cache table (its name seeds the draws: kept)
        "fp8-mla", "Low-precision MLA caches as deployed: the same BF16 inputs through each cache and the kernel that "
        "ships it (DeepSeek V3.2's every token selected; vLLM's scales 1), against FP64 over the BF16 inputs",
        (("flashmla", "FlashMLA test inputs"), ("normal:1", "N(0, 1)"),
         ("rope-outliers", "RoPE outliers ~1e3, content within +-10")),
        tuple(c.label for c in LOW_PRECISION_CACHE),
        "rmse", {}, heads=128, context=4096, block=64, machine="sm90-cuda",
        source="FlashMLA 9241ae3's decodes and sparse prefill, FA3's sparse call, vLLM's dense FP8 FlashMLA decode "
               "and vLLM's Triton decode with an FP8 cache, FlashInfer 0.7.2's MLA decode with a BF16 cache and with "
               "SGLang 0.5.23's FP4 cache (bit-exact models; the Triton kernel on sm90-triton) and SnapMLA (arXiv "
               "SnapMLA, Section 4.3) on the same BF16 inputs",
    ),
    "snapmla-configs": Table(
        "snapmla-configs", "SnapMLA paper, Table 2 configs: errors against the BF16 golden (the paper plots them)",
        (("flashmla", "FlashMLA test inputs"), ("rope-outliers", "RoPE outliers ~1e3, content within +-10")),
        ("snapmla", "A", "B", "C", "D"), "rmse", {}, heads=128, context=4096, block=64, input_format="fp32",
        source="arXiv SnapMLA, Section 4.3 (Figure 4: no numbers given)",
    ),
}


TABLE_METRICS = ("rel_frobenius", "rmse", "cos_diff")  # the metric columns of reproduce's results.csv

SPECS: dict[str, str] = {  # the tables' algorithm columns as sweep specs (label=algorithm:options)
    "base": "base",
    "amla": "amla",
    "fa3-base": "fa3-base=base:p_format=fp16:io_format=fp16",
    "etap": "etap:p_format=fp16:io_format=fp16",
    "flashmla-etap": "flashmla-etap",
    "fa3-mla": "fa3-mla",
    **{c.label: c.spec for c in LOW_PRECISION_CACHE},
}


def with_algorithms(table: Table, specs: tuple[str, ...]) -> Table:
    """The table with more algorithm columns: sweep specs (``label=name:key=value``, plugins included)."""
    if not specs:
        return table
    labels = [parse_algorithm(spec)[0] for spec in specs]
    taken = set(table.algorithms)
    for label, spec in zip(labels, specs):
        if label in taken:
            raise ValueError(f"algorithms: {spec!r} is labelled {label!r}, a column the table has or another "
                             "spec takes; name it as label=spec")
        taken.add(label)
    return replace(table, algorithms=table.algorithms + tuple(labels), specs=tuple(zip(labels, specs)))


def table_specs(table: Table) -> list[str]:
    """The sweep spec of every algorithm column, in order."""
    own = dict(table.specs)
    return [own.get(a) or SPECS[a] for a in table.algorithms]


def _reference(table: Table) -> str:
    # SnapMLA's reference is the attention of the BF16-rounded inputs (FP64 arithmetic)
    return "golden-bf16" if table.name == "snapmla-configs" else "golden"


def table_grid(name: str, *, samples: int = 100, context: int | None = None, heads: int | None = None,
               machine: str | None = None, schedule: str = "reference", seed: int = 0) -> Grid:
    """A paper's table as a named sweep grid: the same draws, hence the same numbers, as :func:`run_sample`."""
    if name not in TABLES:
        raise ValueError(f"grid: expected a table name from {sorted(TABLES)} or a TOML file, got {name!r}")
    t = TABLES[name]
    labels = dict(t.distributions)
    return Grid(algorithms=tuple(table_specs(t)), machines=(machine or t.machine,),
                distributions=tuple(d for d, _ in t.distributions), contexts=(context or t.context,),
                heads=(heads or t.heads,), sq=(t.sq,), blocks=(t.block,), schedule=schedule, samples=samples, seed=seed,
                input_format=t.input_format, sampler=t.sampler, reference=_reference(t), metric=t.metric,
                name=t.name, paper={f"{d}/{alg}": v for d, label in labels.items() for (lab, alg), v in
                                    t.paper.items() if lab == label})


def run_sample(table: Table, dist: str, sample: int, *, machine: Machine, context: int, heads: int,
               seed: int, schedule: str = "reference") -> list[dict]:
    """One sample of one distribution: inputs, the reference, every algorithm of the table, its metrics."""
    errors = sample_errors(table_specs(table), dist, seed=derive_seed(seed, table.name, dist, sample),
                           heads=heads, sq=table.sq, context=context, block=table.block, machine=machine,
                           schedule=schedule, input_format=table.input_format, sampler=table.sampler,
                           reference_kind=_reference(table))
    return [{"distribution": dist, "sample": sample, "algorithm": alg, **{k: m[k] for k in TABLE_METRICS}}
            for alg, (_, m) in zip(table.algorithms, errors, strict=True)]


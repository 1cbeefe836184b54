"""Where each deployed FP8 or FP4 MLA decode's error comes from: the fp8-mla table's first draws (its own seeds) through
each FP8 decode on machines that take one rounding step away at a time, RMSE against FP64 attention over the BF16
inputs.

    python scripts/fp8_error_budget.py [--samples 3] [--out docs/reproductions/fp8-mla/error-budget.md]

For vLLM's two FP8 decodes (scales 1, as vLLM runs a checkpoint without scales), FlashMLA's sparse FP8 decode and
SGLang's FP4 cache through FlashInfer's decode:

- ``cache``: exact arithmetic on the quantized inputs (the ``golden`` machine: FP64, no storage rounding), so only
  the quantization of the cache (and, for the dense FP8 decode, of Q) is left;
- ``+ P``: the kernel's machine with exact tensor cores: the quantized inputs and P rounded to the kernel's P format
  (E4M3 for the dense FP8 decode, BF16 for the others), with the kernel's fast-math exp, sums and division;
- ``kernel``: the kernel itself (the bit-exact model on its machine): the tensor cores' own accumulation added
  (for the dense FP8 decode: every k32 step chained through a 14-bit truncated sum).

The BF16 decodes (FlashMLA's dense decode, FlashInfer's) are the yardsticks: no quantization at all. Two what-ifs
beside vLLM's decodes: the per-tensor scales a calibration would set (each tensor's amax onto 448) in place of 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from amla_sim._files import atomic_write
from amla_sim._seeds import derive_seed
from amla_sim.algorithms import ALGORITHMS, golden
from amla_sim.experiments.inputs import make_inputs
from amla_sim.experiments.tables import TABLES
from amla_sim.machines import get_machine
from amla_sim.units import MatrixUnit

def _amax(x: np.ndarray) -> float:
    """A calibrated per-tensor scale: the tensor's largest magnitude onto E4M3's 448."""
    return float(np.abs(x.astype(np.float32)).max()) / 448


#: label -> (sweep algorithm, options (or a function of q and kv giving them), the kernel's machine)
DECODES = {
    "FlashMLA dense (BF16)": ("flashmla", {}, "sm90-cuda"),
    "FlashMLA sparse FP8 (V3.2 cache)": ("flashmla-sparse-fp8", {}, "sm90-cuda"),
    "vLLM dense FP8 FlashMLA": ("flashmla-dense-fp8", {}, "sm90-cuda"),
    "vLLM Triton, FP8 cache": ("vllm-triton-mla", {"kv_cache": "fp8"}, "sm90-triton"),
    "FlashInfer (BF16)": ("flashinfer-mla", {}, "sm90-cuda"),
    "SGLang FP4 cache, FlashInfer": ("flashinfer-mla", {"kv_cache": "fp4_mx_block16"}, "sm90-cuda"),
    "vLLM dense FP8 FlashMLA, scales amax / 448": (
        "flashmla-dense-fp8", lambda q, kv: {"q_scale": _amax(q), "k_scale": _amax(kv)}, "sm90-cuda"),
    "vLLM Triton, FP8 cache, scale amax / 448": (
        "vllm-triton-mla", lambda q, kv: {"kv_cache": "fp8", "k_scale": _amax(kv)}, "sm90-triton"),
}
STEPS = ("cache", "+ P", "kernel")


def _rmse(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((out.astype(np.float64) - ref) ** 2)))


def budget(samples: int) -> dict[tuple[str, str], dict[str, list[float]]]:
    t = TABLES["fp8-mla"]
    res: dict[tuple[str, str], dict[str, list[float]]] = {}
    for dist, label in t.distributions:
        for sample in range(samples):
            q, kv = make_inputs(dist, heads=t.heads, sq=t.sq, context=t.context,
                                seed=derive_seed(0, t.name, dist, sample))
            ref = golden(q, kv).out
            for name, (alg, opts, machine) in DECODES.items():
                opts = opts(q, kv) if callable(opts) else opts
                machines = {"cache": "golden", "+ P": get_machine(machine, matrix=MatrixUnit("exact")),
                            "kernel": machine}
                row = res.setdefault((label, name), {s: [] for s in STEPS})
                for step, mc in machines.items():
                    out = ALGORITHMS[alg](q, kv, machine=mc, block=t.block, **opts).out
                    row[step].append(_rmse(out, ref))
            print(label, sample, flush=True)
    return res


def markdown(res: dict, samples: int) -> str:
    lines = [f"RMSE against FP64 attention over the BF16 inputs, means of the fp8-mla table's first {samples} draws of "
             "each input (its own seeds; G = 128, context 4096, scales 1 unless the row says). Each column adds one rounding step: "
             "`cache` the quantized inputs alone (exact arithmetic), `+ P` the kernel's P format and fast-math "
             "units with exact tensor cores, `kernel` the kernel itself.", "",
             "| inputs | decode | cache | + P | kernel |", "|---|---|---|---|---|"]
    for (label, name), row in res.items():
        cells = " | ".join(f"{np.mean(row[s]):.3e}" for s in STEPS)
        lines.append(f"| {label} | {name} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--out", default="docs/reproductions/fp8-mla/error-budget.md")
    a = p.parse_args()
    text = markdown(budget(a.samples), a.samples)
    atomic_write(Path(a.out), text)
    print(text)


if __name__ == "__main__":
    main()

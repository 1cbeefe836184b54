"""Every deployed kernel's scale table on an H100/H200: one small launch for each of DeepSeek's softmax scales and N
random ones in [0.03, 0.3] (descales and cache scales drawn too), captured and replayed against the model.

    python scripts/capture_scales.py OUT [--archives .third_party/archives] [--scales 20] [--seed 0]
                                         [--kernels flashmla,fa3-mla,...]

The upstream checkouts are laid out under .third_party/ from the source archives in --archives (the bundles of
each kernel's sources and CUTLASS headers at the commits the models follow), SGLang's kernel file from
.third_party/sglang/decode_attention.py (the sglang 0.5.23 wheel's). Each kernel runs as its own
``amla-sim crosscheck --kernel K --scales N --save OUT/scales_K.npz`` process, all at once, so that their
compiles share the machine's cores; each process replays its capture and prints the report, kept in
OUT/scales_K.log. Exit status: 0 when every kernel's capture is bit-identical to the model.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: checkout folder -> the archives unpacked into it (an archive whose name starts "cutlass" goes to csrc/cutlass)
CHECKOUTS = {
    "FlashMLA": ["flashmla-sm90-dense-src.tar.xz", "flashmla-9241ae3-decode-src.tar.xz",
                 "flashmla-9241ae3-sparse-prefill-src.tar.xz", "cutlass-include.tar.xz"],
    "FlashMLA-ETAP": ["flashmla-etap-src.tar.xz", "cutlass-3.9.0-include.tar.xz"],
    "flash-attention": ["fa3-vllm-617264c-mla-src.tar.xz", "cutlass-62750a2-include.tar.xz"],
    "FlashMLA-vllm": ["flashmla-46d64a8-dense-fp8-src.tar.xz", "cutlass-3.9.0-include.tar.xz"],
    "vllm": ["vllm-0.33.0-triton-mla-src.tar.xz"],
    "sgl-flash-attn": ["sgl-flash-attn-cb303cf-mla-src.tar.xz", "cutlass-57e3cfb-include.tar.xz"],
}
#: kernel -> (source flag, its path under .third_party)
SOURCES = {
    "flashmla": ("--flashmla-dir", "FlashMLA"),
    "flashmla-sparse-fp8": ("--flashmla-dir", "FlashMLA"),
    "flashmla-sparse-prefill": ("--flashmla-dir", "FlashMLA"),
    "flashmla-etap": ("--etap-dir", "FlashMLA-ETAP"),
    "fa3-mla": ("--fa3-dir", "flash-attention"),
    "fa3-mla-sparse": ("--fa3-dir", "flash-attention"),
    "flashmla-dense-fp8": ("--flashmla-fp8-dir", "FlashMLA-vllm"),
    "vllm-triton-mla": ("--vllm-file", "vllm/vllm-0.33.0/vllm/v1/attention/ops/triton_decode_attention.py"),
    "sglang-triton": ("--sglang-file", "sglang/decode_attention.py"),
    "sgl-fa3-mla": ("--sgl-fa3-dir", "sgl-flash-attn"),
    "sgl-fa3-mla-sparse": ("--sgl-fa3-dir", "sgl-flash-attn"),
}


def unpack(archives: Path, root: Path) -> None:
    """Lay out every checkout of :data:`CHECKOUTS` under `root` that is not there yet."""
    for folder, names in CHECKOUTS.items():
        dest = root / folder
        if dest.exists():
            continue
        for name in names:
            target = dest / "csrc" / "cutlass" if name.startswith("cutlass") else dest
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archives / name) as tar:
                tar.extractall(target, filter="data")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--archives", type=Path, default=Path(".third_party/archives"))
    p.add_argument("--scales", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", default=",".join(SOURCES))
    args = p.parse_args()
    root = Path(".third_party")
    unpack(args.archives, root)
    args.out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for k in args.kernels.split(","):
        flag, where = SOURCES[k]
        cmd = [sys.executable, "-m", "amla_sim.cli", "crosscheck", "--kernel", k, flag, str(root / where),
               "--scales", str(args.scales), "--seed", str(args.seed), "--save", str(args.out / f"scales_{k}.npz")]
        log = open(args.out / f"scales_{k}.log", "w")
        procs[k] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, time.perf_counter())
    worst = 0
    for k, (proc, log, t0) in procs.items():
        rc = proc.wait()
        log.close()
        worst = max(worst, rc)
        text = (args.out / f"scales_{k}.log").read_text().splitlines()
        summary = [line for line in text if "bit-identical" in line or "error" in line.lower()][-3:]
        print(f"{k}: exit {rc} after {time.perf_counter() - t0:.0f} s; " + " | ".join(s.strip() for s in summary))
    return worst


if __name__ == "__main__":
    raise SystemExit(main())

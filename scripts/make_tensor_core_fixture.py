"""Turn the public H100/H200 tensor-core dumps (MATLAB-tensor-core, BSD-2) into one compact .npz fixture.

Usage: python scripts/make_tensor_core_fixture.py SRC_DIR tests/data/tensor_core_dumps.npz

SRC_DIR holds H100/ and H200/ with one folder per input format, as published in
north-numerical-computing/MATLAB-tensor-core, model_validation/. Inputs are stored at their own width (bf16 and
fp16 as uint16 bits, fp8 as uint8 bits, tf32 as the uint32 bits of its FP32 container), C and D as uint32 bits
(D in FP16, written there widened to FP32, as uint16 FP16 bits). Keys: ``{gpu}/{fmt}/{a,b,c,d_fp32,d_fp16}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

FORMATS = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "tf32": np.float32, "E4M3": ml_dtypes.float8_e4m3fn,
           "E5M2": ml_dtypes.float8_e5m2}


def _hex_rows(path: Path) -> np.ndarray:
    rows = [[int(tok, 16) for tok in line.split()] for line in path.read_text().splitlines() if line.strip()]
    return np.array(rows, dtype=np.uint32)


def _bin_rows(path: Path) -> np.ndarray:
    return np.array([int(line.strip(), 2) for line in path.read_text().splitlines() if line.strip()], dtype=np.uint64)


def _narrow(bits32: np.ndarray, dtype) -> np.ndarray:
    """FP32 bit patterns of values exactly representable in `dtype` -> `dtype`'s own bit patterns."""
    x = bits32.view(np.float32)
    y = x.astype(dtype)
    assert np.array_equal(y.astype(np.float32).view(np.uint32), bits32) or np.isnan(x).any(), "inexact narrowing"
    return y.view(f"uint{8 * np.dtype(dtype).itemsize}")


def main(src: str, dst: str) -> None:
    out: dict[str, np.ndarray] = {}
    for gpu in ("H100", "H200"):
        for fmt, dtype in FORMATS.items():
            d = Path(src) / gpu / fmt
            key = f"{gpu}/{fmt.lower()}"
            out[f"{key}/a"] = _narrow(_hex_rows(d / f"a_{gpu}_{fmt}.txt"), dtype)
            out[f"{key}/b"] = _narrow(_hex_rows(d / f"b_{gpu}_{fmt}.txt"), dtype)
            out[f"{key}/c"] = _bin_rows(d / f"c_{gpu}_fp32.txt").astype(np.uint32)
            out[f"{key}/d_fp32"] = _bin_rows(d / f"d_{gpu}_fp32.txt").astype(np.uint32)
            if (d / f"d_{gpu}_fp16.txt").exists():
                # FP16 results are written as the FP32 bits of the widened value
                out[f"{key}/d_fp16"] = _narrow(_bin_rows(d / f"d_{gpu}_fp16.txt").astype(np.uint32), np.float16)
    np.savez_compressed(dst, **out)


if __name__ == "__main__":
    main(*sys.argv[1:3])

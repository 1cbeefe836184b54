"""Conversions to storage formats as sm90's ``cvt`` writes them: round to nearest even, FP8 saturated
(``cvt.rn.satfinite``), and every NaN as one canonical pattern whatever its sign and payload: 0x7FFF in BF16 (a
DeepGEMM epilogue's ``__float22bfloat162_rn``, captured through FlashInfer's GEMM on an H200), 0x7F in E4M3 (vLLM's
cache and query quantizers and FlashInfer's activation quantizer, captured on an H200; SGLang's converts through the
same ``cvt``, read in its source). A CPU's conversions keep the sign and give BF16 0x7FC0; vLLM's activation
quantizer for DeepGEMM converts through c10's ``Float8_e4m3fn``, not ``cvt``, and is not one of these.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..formats import get_format, round_to

__all__ = ["CANONICAL_NAN", "canonical_nan", "cvt_e4m3_satfinite"]

#: the NaN ``cvt`` writes, by format
CANONICAL_NAN = {"bf16": 0x7FFF, "e4m3": 0x7F}


def canonical_nan(x: np.ndarray) -> np.ndarray:
    """`x` (BF16 or E4M3) with every NaN replaced by its format's :data:`CANONICAL_NAN`."""
    name = get_format(x.dtype).name
    nan = np.isnan(x.astype(np.float32))
    if not nan.any():
        return x
    bits = x.view(np.uint8 if name == "e4m3" else np.uint16)
    return np.where(nan, bits.dtype.type(CANONICAL_NAN[name]), bits).view(x.dtype)


def cvt_e4m3_satfinite(x: npt.ArrayLike) -> np.ndarray:
    """FP32 values to E4M3 as ``cvt.rn.satfinite.e4m3x2.f32`` writes them: nearest even, +-448 past the range
    (infinities too), NaN 0x7F."""
    with np.errstate(invalid="ignore", over="ignore"):
        return canonical_nan(round_to(np.asarray(x, np.float32), "e4m3", overflow="satfinite"))

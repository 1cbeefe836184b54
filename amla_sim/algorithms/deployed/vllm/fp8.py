"""vLLM's per-tensor FP8 quantization of an MLA decode's inputs: the query (FLASHMLA's dense FP8 decode reads it in
E4M3) and the KV cache (``--kv-cache-dtype fp8``: E4M3, one scale per layer).

Upstream: vllm-project/vllm 0.33, ``vllm/model_executor/layers/quantization/input_quant_fp8.py`` (``QuantFP8.
forward_native``, which ``_DecodeConcatQuantFP8`` in ``mla_attention.py`` compiles for the query: static, per
tensor) and ``csrc/cache_kernels.cu`` with ``csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh``
(``concat_and_cache_mla`` writes each element through ``scaled_vec_conversion``). A scale of 1 (vLLM's when a
checkpoint carries none) makes both a plain cast.

- the query: ``e4m3(clamp(fl32(q) * fl32(1 / q_scale), -448, 448))`` (the reciprocal correctly rounded, then a
  multiply: "reciprocal performs slightly better than division");
- the cache: ``cvt.rn.satfinite.e4m3(fl32(x) / k_scale)`` (an IEEE division, then a saturating cast).

Both round to nearest even; a NaN of either sign becomes 0x7F, the one NaN the GPU's casts write. The functions take
any float array (BF16 as vLLM holds it) and return ``float8_e4m3fn``, byte for byte the GPU's (every BF16 value,
eight scales: ``tests/data/vllm_fp8_quant.npz``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ....arith.convert import cvt_e4m3_satfinite
from ....formats import as_native, is_float_dtype
from ..scalars import api_float

__all__ = ["quantize_query_fp8", "quantize_cache_fp8"]


def _float32(x: npt.ArrayLike, name: str) -> np.ndarray:
    """A float array (any width: BF16 as vLLM holds it) widened to FP32 as the GPU reads it; a TypeError names
    `name` for integers (raw E4M3 bytes among them), booleans, complex numbers and strings."""
    arr = as_native(x)
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{name}: expected a float array (float16/32/64, bfloat16), got dtype {arr.dtype}")
    with np.errstate(all="ignore"):  # float64 beyond FP32 becomes inf, as torch's .float() makes it
        return arr.astype(np.float32)


def quantize_query_fp8(q: npt.ArrayLike, q_scale: float = 1.0) -> np.ndarray:
    """The query as vLLM quantizes it for an FP8 attention kernel (``QuantFP8``, static per-tensor): ``x *
    reciprocal(q_scale)`` in FP32, clamped to +-448, rounded to E4M3."""
    s = api_float(q_scale, "q_scale")
    with np.errstate(all="ignore"):  # 1 / 0 is an infinity, as the GPU's reciprocal gives
        inv = np.float32(np.float64(1.0) / np.float64(s))  # one rounding of the exact quotient
        return cvt_e4m3_satfinite(_float32(q, "q") * inv)


def quantize_cache_fp8(kv: npt.ArrayLike, k_scale: float = 1.0) -> np.ndarray:
    """A KV cache entry as ``concat_and_cache_mla`` writes it with an FP8 cache: ``x / k_scale`` in FP32 (IEEE),
    rounded to E4M3 with saturation (``__NV_SATFINITE``)."""
    s = api_float(k_scale, "k_scale")
    x = _float32(kv, "kv")
    with np.errstate(all="ignore"):
        return cvt_e4m3_satfinite(x / s)

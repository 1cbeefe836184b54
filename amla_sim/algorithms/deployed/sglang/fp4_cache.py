"""SGLang's FP4 MLA KV cache (``--kv-cache-dtype fp4_mx_block16``): E2M1 values, one power-of-two scale byte per
16, dequantized to BF16 before FlashInfer's MLA kernel reads the cache.

Upstream: sgl-project/sglang 0.5.23 (the wheel). ``sglang/srt/layers/quantization/kvfp4_tensor.py``
(``FP4MXBlock16KVQuantizeUtil``, both functions under ``@torch.compile``), ``sglang/srt/mem_cache/memory_pool.py``
(``MLATokenToKVPoolFP4``), ``sglang/srt/layers/attention/flashinfer_mla_backend.py``.

The one FP4 mode an MLA model has on Hopper. ``--kv-cache-dtype`` offers ``nvfp4`` and ``fp4_mx_block16``
(``arg_groups/fields/model.py:197-221``); ``nvfp4`` is refused below SM100/SM120 (``arg_groups/kv_cache_hook.py:
125-131``), and an MLA model gets ``MLATokenToKVPoolFP4`` for either (``mem_cache/kv_cache_configurator.py:1874``),
which quantizes with ``FP4MXBlock16KVQuantizeUtil`` only. Its attention backend must be ``flashinfer`` or
``trtllm_mla`` (``kv_cache_hook.py:297-305``), and ``trtllm_mla`` is Blackwell's (``arg_groups/overrides.py:
1210-1212``): on Hopper, FlashInfer's MLA kernel reads the BF16 keys.

The quantizer (``kvfp4_tensor.py:58-97``), per block of 16 consecutive values of a ``(B, M, N)`` tensor (blocks run
over ``M * N``, ``view(b, m * n // 16, 16)``, line 72):

- ``amax`` = the block's largest ``|x|``, NaN if it holds one (line 75);
- ``e = ceil(log2(max(amax / 6, 1e-10)))`` in FP32 (line 76): the least ``e`` with ``amax <= 6 * 2^e``, at least
  -33. Compiled, the chain runs in FP32 with no BF16 rounding between ops (eager torch rounds each to BF16, and
  its BF16 ``log2`` takes ``e`` one lower for 3113 of the finite BF16 ``amax``: just above ``6 * 2^(e-1)``, more of
  them the larger ``|e|``); a GPU multiplies by ``fl32(1/6)`` where a CPU divides (Inductor's ``div_prim``): for
  every BF16 ``amax`` both give the exact ``e``;
- the scale byte is ``e + 127`` (line 77): 94 to 253 for finite input (E8M0's encoding of ``2^e``);
- each value is ``q = x / 2^e`` in FP32 (line 80), its code ``sign << 3 | magnitude``: the sign bit is ``q < 0``
  (so -0, NaN and a negative ``q`` that underflows FP32 give +0; a negative ``q`` below 0.25 gives -0, code 8),
  the magnitude the number of bounds ``(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)`` at most ``|q|`` (lines 83-91): a tie
  rounds away from zero (not to even), ``|q| >= 5`` gives 6;
- two codes a byte, element ``2j`` in the low nibble, ``2j + 1`` in the high one (line 95).

A block holding Inf or NaN writes code 0 for all 16 values; its scale byte is ``uint8(Inf or NaN + 127)``: 0 for
NaN; for Inf 255 on a GPU (Inductor casts float to uint8 through int16, which saturates) and 0 on a CPU.

The pool (``memory_pool.py:5133-5276``) stores a token as 288 bytes, ``k_nope``'s 512 codes then ``k_rope``'s 64
(quantized by two calls, lines 5249-5255, which blocks of 16 make the same as one call on the 576 values), and 36
scale bytes in a second buffer, ``k_nope``'s 32 then ``k_rope``'s 4. ``get_key_buffer`` (lines 5171-5188)
dequantizes every token to BF16 (``kvfp4_tensor.py:101-140``): the E2M1 value in FP32 times ``exp2(byte - 127)``,
then BF16. For a byte the quantizer writes the product is exact; 6 * 2^126 exceeds BF16, so a value that
rounds to 4 or 6 under ``e = 126`` (``|x| >= 3.5 * 2^126``) comes back Inf. The backend casts the result to the
query's dtype (``flashinfer_mla_backend.py:822``): no change for a BF16 model.

SGLang's own functions, run from the wheel on a CPU and on an H100 (``scripts/capture_sglang_fp4.py``), give these
bytes on every case of ``tests/data/sglang_fp4_cache.npz``. The two devices differ only where ``device`` says: an
Inf block's scale byte, and reading back, code 8 (-0, +0 on the GPU: Triton's negation is ``0 - v``), scale byte 0
and NaN bits.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from ...._validate import quiet_fp
from ....arith.convert import CANONICAL_NAN
from ....formats import as_native, is_float_dtype, round_to
from ..._common import D_K, D_V

__all__ = ["MODES", "E2M1_VALUES", "E2M1_BOUNDS", "BLOCK", "batched_quantize", "batched_dequantize",
           "scale_exponents", "e2m1_codes", "pack_e2m1", "unpack_e2m1", "quantize_mla_kv", "dequantize_mla_kv",
           "through_fp4_pool"]

#: SGLang's FP4 KV-cache modes an MLA model can run on Hopper.
MODES: tuple[str, ...] = ("fp4_mx_block16",)
BLOCK = 16  # values sharing a scale byte
#: The value of each E2M1 code 0..15 (kvfp4_tensor.py:28-45): codes 8..15 are 0..7 negated, 8 is -0.
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
#: The magnitude code of ``|q|`` is the number of these at most ``|q|`` (kvfp4_tensor.py:46).
E2M1_BOUNDS = np.array([.25, .75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_MAX = np.float32(6.0)
_SCALE_FLOOR = np.float32(1e-10)  # torch.clamp(min=1e-10) against an FP32 quotient
_BIAS = 127
Device = Literal["cuda", "cpu"]
_DEVICES = ("cuda", "cpu")
_INF_SCALE_BYTE = {"cuda": 255, "cpu": 0}  # uint8(inf): through int16 (saturates) on a GPU; x86's cvtt gives 0
_NAN_BF16 = {"cuda": CANONICAL_NAN["bf16"], "cpu": 0x7FC0}  # the NaN each device's FP32 -> BF16 cast writes


def _device(device: str) -> str:
    if device not in _DEVICES:
        raise ValueError(f"device: expected one of {_DEVICES}, got {device!r}")
    return device


def _ceil_log2(q: np.ndarray) -> np.ndarray:
    """ceil(log2(q)) of positive FP32 values, exactly, as float32; Inf and NaN pass through."""
    finite = np.isfinite(q)
    m, k = np.frexp(np.where(finite, q, np.float32(1)))  # q = m 2^k, m in [0.5, 1): frexp never sees Inf or NaN
    e = (k - (m == 0.5)).astype(np.float32)  # an exact power of two 2^(k-1) has log2 k - 1
    return np.where(finite, e, q)


def scale_exponents(amax: npt.ArrayLike) -> np.ndarray:
    """Each block's ``e = ceil(log2(max(amax / 6, 1e-10)))`` (kvfp4_tensor.py:76), FP32 as compiled; NaN for a NaN
    ``amax``, Inf for an infinite one."""
    a = np.asarray(amax, np.float32)
    with np.errstate(invalid="ignore"):
        return _ceil_log2(np.maximum(a / _E2M1_MAX, _SCALE_FLOOR))  # np.maximum keeps a NaN, as clamp does


def e2m1_codes(q: npt.ArrayLike) -> np.ndarray:
    """The 4-bit code of each FP32 ``q = x / 2^e`` (kvfp4_tensor.py:83-91): sign ``q < 0``, magnitude the number
    of bounds at most ``|q|`` (ties away from zero, 6 from 5 up; NaN gives 0)."""
    q = np.asarray(q, np.float32)
    with np.errstate(invalid="ignore"):
        mag = (np.abs(q)[..., None] >= E2M1_BOUNDS).sum(axis=-1)
        return ((q < 0).astype(np.uint8) << 3) | mag.astype(np.uint8)


def pack_e2m1(codes: npt.ArrayLike) -> np.ndarray:
    """Codes (..., n) -> bytes (..., n/2): element 2j in the low nibble, 2j + 1 in the high one (line 95)."""
    c = np.asarray(codes)
    if c.dtype != np.uint8 or c.ndim < 1 or c.shape[-1] % 2 or (c > 15).any():
        raise ValueError(f"codes: expected uint8 codes 0..15, an even number on the last axis, got {c.dtype} "
                         f"{c.shape}")
    return (c[..., 1::2] << 4) | c[..., 0::2]


def unpack_e2m1(packed: npt.ArrayLike) -> np.ndarray:
    """Bytes (..., n/2) -> codes (..., n), the inverse of :func:`pack_e2m1` (kvfp4_tensor.py:120-122)."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise TypeError(f"packed: expected uint8 bytes, got dtype {p.dtype}")
    if p.ndim < 1:
        raise ValueError(f"packed: expected bytes (..., n/2), one axis at least, got a scalar ({p!r})")
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2], out[..., 1::2] = p & 0x0F, p >> 4
    return out


def _bf16_values(x: npt.ArrayLike, name: str) -> np.ndarray:
    arr = as_native(x)
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{name}: expected a float array (BF16 values), got dtype {arr.dtype}")
    with np.errstate(invalid="ignore", over="ignore"):
        wide = arr.astype(np.float64)  # checked at the caller's precision: FP32 would round 1 + 2^-30 to 1 first
    if not np.array_equal(round_to(wide, "bf16").astype(np.float64), wide, equal_nan=True):
        raise ValueError(f"{name}: SGLang's cache takes BF16 values (the model's dtype); round them first")
    return wide.astype(np.float32)


@quiet_fp
def batched_quantize(tensor: npt.ArrayLike, *, device: Device = "cuda") -> tuple[np.ndarray, np.ndarray]:
    """``FP4MXBlock16KVQuantizeUtil.batched_quantize`` (kvfp4_tensor.py:58-97) as compiled: BF16 values (B, M, N)
    -> (packed E2M1 codes, uint8 (B, M, N/2); scale bytes ``e + 127``, uint8 (B, M*N/16)).

    device: where a block holding Inf is quantized ("cuda": scale byte 255, "cpu": 0); every other input gives
    the same bytes on both."""
    _device(device)
    x = _bf16_values(tensor, "tensor")
    if x.ndim != 3:
        raise ValueError(f"tensor: expected (B, M, N), got shape {x.shape}")
    b, m, n = x.shape
    if n % 2 or (m * n) % BLOCK:
        raise ValueError(f"tensor: N must be even and M*N a multiple of {BLOCK} (shape {x.shape})")
    blocks = x.reshape(b, m * n // BLOCK, BLOCK)
    e = scale_exponents(np.abs(blocks).max(axis=-1))  # NaN-propagating, as torch's max
    finite = np.isfinite(e)
    byte = np.where(np.isnan(e), 0, np.where(finite, np.where(finite, e, 0) + _BIAS, _INF_SCALE_BYTE[device]))
    ef = np.where(finite, e, 0).astype(np.int64)[..., None]
    # x / 2^e in FP32: exact in float64, one rounding to FP32 (a tiny negative q may underflow to -0: code 0)
    q = np.ldexp(blocks.astype(np.float64), -ef).astype(np.float32)
    q = np.where(finite[..., None], q, np.float32(np.nan))  # x / Inf is +-0 or NaN: code 0 either way
    codes = e2m1_codes(q).reshape(b, m, n)
    return pack_e2m1(codes), byte.astype(np.uint8)


def _bytes(a: npt.ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8 bytes, got dtype {arr.dtype}")
    return arr


@quiet_fp
def batched_dequantize(quant_tensor: npt.ArrayLike, scale_factors: npt.ArrayLike, *,
                       device: Device = "cuda") -> np.ndarray:
    """``FP4MXBlock16KVQuantizeUtil.batched_dequantize`` (kvfp4_tensor.py:101-140) with its default BF16 output:
    packed codes (B, M, N/2) and scale bytes (B, M*N/16) -> ``bf16(fl32(value * exp2(byte - 127)))`` (B, M, N),
    as ``ml_dtypes.bfloat16``.

    device: bytes the quantizer writes only for Inf and NaN blocks, or never, differ: byte 0's ``exp2(-127)``
    (a GPU's libdevice flushes it to 0, a CPU keeps the subnormal) and the NaN of a ``0 * Inf`` (byte 255:
    0x7FFF on a GPU, 0x7FC0 on a CPU); and code 8 (-0), which the quantizer writes for small negative values,
    reads back as -0 on a CPU and +0 on a GPU (Triton's unary minus is ``0 - v``)."""
    _device(device)
    p, s = _bytes(quant_tensor, "quant_tensor"), _bytes(scale_factors, "scale_factors")
    if p.ndim != 3:
        raise ValueError(f"quant_tensor: expected (B, M, N/2) bytes, got shape {p.shape}")
    b, m, n = p.shape[0], p.shape[1], 2 * p.shape[2]
    if (m * n) % BLOCK:
        raise ValueError(f"quant_tensor: M*N must be a multiple of {BLOCK} (shape {p.shape})")
    if s.shape != (b, m * n // BLOCK):
        raise ValueError(f"scale_factors: expected shape {(b, m * n // BLOCK)} for quant_tensor {p.shape}, got "
                         f"{s.shape}")
    vals = E2M1_VALUES[unpack_e2m1(p)].reshape(b, m * n // BLOCK, BLOCK)
    scale = np.ldexp(np.float32(1), s.astype(np.int32) - _BIAS).astype(np.float32)  # 2^128 -> Inf
    if device == "cuda":
        scale = np.where(s == 0, np.float32(0), scale)
        # torch.where(sign, -v, v) compiled to Triton: its unary minus is 0 - v, so code 8 (-0) reads back as +0
        vals = np.where(vals == 0, np.float32(0), vals)
    out = round_to((vals * scale[..., None]).reshape(b, m, n), "bf16")  # the FP32 product, then BF16
    nan = np.isnan(out)
    if nan.any():
        bits = out.view(np.uint16)
        bits[nan] = _NAN_BF16[device]
    return out


def quantize_mla_kv(k_nope: npt.ArrayLike, k_rope: npt.ArrayLike, *,
                    device: Device = "cuda") -> tuple[np.ndarray, np.ndarray]:
    """``MLATokenToKVPoolFP4.set_mla_kv_buffer`` (memory_pool.py:5223-5276): ``k_nope`` (T, 1, 512) and ``k_rope``
    (T, 1, 64), BF16 values -> the token rows of ``kv_buffer`` (T, 1, 288) and of ``kv_scale_buffer`` (T, 36)."""
    nope_p, nope_s = batched_quantize(k_nope, device=device)
    rope_p, rope_s = batched_quantize(k_rope, device=device)
    if nope_p.shape[:2] != rope_p.shape[:2]:
        raise ValueError(f"k_rope: expected {nope_p.shape[:2]} tokens and heads as k_nope, got {rope_p.shape[:2]}")
    return np.concatenate([nope_p, rope_p], axis=-1), np.concatenate([nope_s, rope_s], axis=-1)


def dequantize_mla_kv(kv_buffer: npt.ArrayLike, kv_scale_buffer: npt.ArrayLike, *,
                      device: Device = "cuda") -> np.ndarray:
    """``MLATokenToKVPoolFP4.get_key_buffer`` (memory_pool.py:5171-5188): rows (T, 1, 288) and (T, 36) -> the
    keys FlashInfer's MLA kernel reads, BF16 (T, 1, 576)."""
    return batched_dequantize(kv_buffer, kv_scale_buffer, device=device)


def through_fp4_pool(kv: npt.ArrayLike, *, device: Device = "cuda") -> np.ndarray:
    """MLA keys ``(..., 576)`` (BF16 values: the 512 latent columns then the 64 rope ones) written to SGLang's FP4
    pool and read back (:func:`quantize_mla_kv` then :func:`dequantize_mla_kv`): the BF16 keys FlashInfer's
    kernel reads, in `kv`'s shape."""
    x = np.asarray(kv)
    if x.ndim < 1 or x.shape[-1] != D_K:
        raise ValueError(f"kv: expected (..., {D_K}) MLA keys, got shape {x.shape}")
    rows = x.reshape(-1, 1, D_K)
    buf, scales = quantize_mla_kv(rows[..., :D_V], rows[..., D_V:], device=device)
    return dequantize_mla_kv(buf, scales, device=device).reshape(x.shape)

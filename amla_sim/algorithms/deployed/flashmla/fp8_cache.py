"""FlashMLA's FP8 KV-cache layouts: the quantizer that writes them and the dequantizer the sparse decode kernel
runs.

Upstream: deepseek-ai/FlashMLA 9241ae3, ``tests/quant.py`` (the quantizer), ``csrc/sm90/decode/sparse_fp8/
components/dequant.h`` (the dequantizer).

Two layouts, a page of ``P`` tokens each, one KV head:

- ``v32`` (DeepSeek V3.2, d_qk 576): 656 bytes a token: 512 E4M3 values, four FP32 scales (one per 128 values),
  the 64 RoPE values in BF16.
- ``model1`` (d_qk 512): a page holds ``P`` tokens of 448 E4M3 values and 64 BF16 RoPE values (576 bytes each),
  then ``P`` groups of seven E8M0 scales (one per 64 values) and a pad byte: 584 bytes a token on average, which
  is how the kernel sees a page, as (P, 1, 584) bytes.

The quantizer is FlashMLA's ``tests/quant.py``: a scale is ``2^ceil(log2(max(amax / 448, 1e-4)))`` in FP32 and a
value ``e4m3(x / scale)``, round to nearest even. The kernel's dequantizer (``components/dequant.h``) widens each
E4M3 value to BF16 (exact), rounds the scale to BF16 (exact for a power of two, not for a scale another quantizer
wrote) and multiplies in BF16 (``__hmul2``: the product rounded to BF16). A cache is uint8 bytes, so that any
scale a cache holds, not only this quantizer's, is representable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....formats import is_float_dtype, round_to
from ..._common import D_ROPE
from ...quantizers import E4M3_MAX

__all__ = ["CacheLayout", "LAYOUTS", "layout_of", "quantize_kv_cache", "dequantize_kv_cache", "pages"]

_SCALE_FLOOR = np.float32(1e-4)  # quant.py's clamp_min(1e-4), in FP32


@dataclass(frozen=True)
class CacheLayout:
    """One of FlashMLA's FP8 cache layouts: head dim, its FP8 part and tile, and bytes per token."""

    name: str
    d: int  # d_qk: the FP8 part and the BF16 RoPE part
    d_nope: int
    tile: int  # values sharing a scale
    scale_type: Literal["fp32", "e8m0"]
    bytes_per_token: int

    @property
    def num_tiles(self) -> int:
        return self.d_nope // self.tile

    @property
    def token_bytes(self) -> int:
        """A token's E4M3 values and BF16 RoPE values, without its scales."""
        return self.d_nope + 2 * D_ROPE


#: The FP8 cache layouts by name: DeepSeek V3.2's (``v32``) and MODEL1's.
LAYOUTS = {
    "v32": CacheLayout("v32", 576, 512, 128, "fp32", 656),
    "model1": CacheLayout("model1", 512, 448, 64, "e8m0", 584),
}


def layout_of(name_or_bytes: str | int, argname: str = "layout") -> CacheLayout:
    """A layout by name (``v32``, ``model1``) or by its bytes per token (656, 584)."""
    for lay in LAYOUTS.values():
        if name_or_bytes in (lay.name, lay.bytes_per_token):
            return lay
    raise ValueError(f"{argname}: expected one of {tuple(LAYOUTS)} (656 or 584 bytes a token), got {name_or_bytes!r}")


@quiet_fp
def _scales(x: np.ndarray, tile: int, power_of_two: bool = True) -> np.ndarray:
    """quant.py's scale of each `tile` values along the last axis: FP32 ``amax / 448``, floored at 1e-4, up to a
    power of two. ``log2`` of such a quotient lands on an integer only at an exact power of two (``amax`` has 8
    significant bits and 448 = 1.75 * 2^8), where every log2 is exact, so FP64's ceil is FlashMLA's."""
    t = np.abs(x.reshape(*x.shape[:-1], -1, tile)).max(axis=-1).astype(np.float32)
    s = np.maximum(t / np.float32(E4M3_MAX), _SCALE_FLOOR)  # torch's clamp_min keeps a NaN
    if not power_of_two:
        return s
    return np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)


@quiet_fp
def quantize_kv_cache(kv: npt.ArrayLike, layout: str = "v32", *, power_of_two: bool = True) -> np.ndarray:
    """FlashMLA's quantizer (``tests/quant.py``): BF16 pages (num_blocks, P, 1, d) or (num_blocks, P, d) -> the
    packed cache, uint8 (num_blocks, P, 1, bytes_per_token). The MODEL1 pad bytes are zero (FlashMLA leaves
    them unwritten); its pages are contiguous (FlashMLA pads each to a multiple of 576 bytes; the kernel reads
    the page stride it is given).

    power_of_two: False writes the FP32 scale ``max(amax / 448, 1e-4)`` itself (V3.2 only), as a quantizer
    other than FlashMLA's might: a cache the kernel takes, on which its BF16 scale and product round."""
    lay = layout_of(layout)
    if not isinstance(power_of_two, (bool, np.bool_)):
        raise TypeError(f"power_of_two: expected True or False, got {power_of_two!r}")
    if not power_of_two and lay.scale_type != "fp32":
        raise ValueError(f"power_of_two: layout {lay.name} stores E8M0 scales, which are powers of two")
    x = np.asarray(kv)
    if not is_float_dtype(x.dtype):
        raise TypeError(f"kv: expected BF16 values (a float array), got {x.dtype}")
    if x.ndim == 4:
        if x.shape[2] != 1:
            raise ValueError(f"kv: one KV head (num_blocks, P, 1, d), got shape {x.shape}")
        x = x[:, :, 0]
    if x.ndim != 3 or x.shape[-1] != lay.d:
        raise ValueError(f"kv: expected pages (num_blocks, P, {lay.d}) for layout {lay.name}, got shape {x.shape}")
    if 0 in x.shape[:2]:
        raise ValueError(f"kv: no tokens to quantize (pages of shape {x.shape})")
    x = np.asarray(x, np.float32)
    if not np.array_equal(round_to(x, "bf16"), x, equal_nan=True):
        raise ValueError("kv: the cache quantizer takes BF16 values (round them first)")
    nb, P, _ = x.shape
    nope, rope = x[..., :lay.d_nope], x[..., lay.d_nope:]
    s = _scales(nope, lay.tile, power_of_two)  # (nb, P, tiles)
    q8 = (nope.reshape(nb, P, lay.num_tiles, lay.tile) / s[..., None]).reshape(nb, P, lay.d_nope)
    q8 = q8.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    rope_b = np.ascontiguousarray(rope).astype(ml_dtypes.bfloat16).view(np.uint8).reshape(nb, P, 2 * D_ROPE)
    if lay.name == "v32":  # per token: values, FP32 scales, RoPE
        out = np.concatenate([q8, s.astype("<f4").view(np.uint8).reshape(nb, P, 4 * lay.num_tiles), rope_b], axis=-1)
        return out.reshape(nb, P, 1, lay.bytes_per_token)
    page = np.zeros((nb, P * lay.bytes_per_token), np.uint8)  # per page: every token's values and RoPE, then scales
    head = P * lay.token_bytes
    page[:, :head] = np.concatenate([q8, rope_b], axis=-1).reshape(nb, head)
    e8 = np.zeros((nb, P, lay.num_tiles + 1), np.uint8)  # 7 scales and a pad byte
    e8[..., :-1] = s.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    page[:, head:] = e8.reshape(nb, -1)
    return page.reshape(nb, P, 1, lay.bytes_per_token)


_E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # every E4M3 code's value


def _fields(cache: np.ndarray, lay: CacheLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(E4M3 bytes (n, d_nope), scales as FP32 (n, tiles), RoPE as FP32 (n, 64)) of every token of a cache."""
    nb, P = cache.shape[:2]
    n, v = nb * P, lay.d_nope
    if lay.name == "v32":
        t = cache.reshape(n, lay.bytes_per_token)
        scales = np.ascontiguousarray(t[:, v:v + 4 * lay.num_tiles]).view("<f4").astype(np.float32)
        rope = t[:, v + 4 * lay.num_tiles:]
    else:
        flat = cache.reshape(nb, P * lay.bytes_per_token)
        t = flat[:, :P * lay.token_bytes].reshape(n, lay.token_bytes)
        e8 = np.ascontiguousarray(flat[:, P * lay.token_bytes:].reshape(n, lay.num_tiles + 1)[:, :-1])
        scales, rope = e8.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), t[:, v:]
    return t[:, :v], scales, np.ascontiguousarray(rope).view(ml_dtypes.bfloat16).astype(np.float32)


@quiet_fp
def dequantize_kv_cache(cache: npt.ArrayLike, layout: str | None = None, *, as_kernel: bool = True) -> np.ndarray:
    """The cache's keys as BF16 values in float32, (num_blocks * P, d): as the kernel dequantizes them
    (`as_kernel`: E4M3 -> BF16, the scale rounded to BF16, their BF16 product) or as FlashMLA's reference
    dequantizer does for V3.2 (the FP32 product of the E4M3 value and the FP32 scale, then BF16)."""
    c = np.asarray(cache)
    if c.dtype != np.uint8 or c.ndim != 4 or c.shape[2] != 1:
        raise ValueError(f"kv_cache: expected uint8 pages (num_blocks, P, 1, bytes), got {c.dtype} {c.shape}")
    lay = layout_of(c.shape[-1] if layout is None else layout, "kv_cache" if layout is None else "layout")
    if c.shape[-1] != lay.bytes_per_token:
        raise ValueError(f"kv_cache: layout {lay.name} has {lay.bytes_per_token} bytes a token, got {c.shape[-1]}")
    q8, s, rope = _fields(c, lay)
    v = _E4M3[q8].reshape(len(q8), lay.num_tiles, lay.tile)  # a table of the 256 codes: ml_dtypes' own values
    if as_kernel:
        s16 = round_to(s, "bf16").astype(np.float32)
        nope = round_to(v * s16[..., None], "bf16")  # the exact product of two BF16 values, rounded once
    else:  # FP32 product (rounded), then BF16: two roundings
        nope = round_to(v * s[..., None], "bf16")
    keys = np.empty((len(q8), lay.d), np.float32)
    keys[:, :lay.d_nope] = nope.reshape(len(q8), lay.d_nope)
    keys[:, lay.d_nope:] = rope
    return keys


def pages(kv: npt.ArrayLike, page: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """A (b, S, d) cache as pages (b * n, page, 1, d), zero past S, and each request's first token index in the
    paged cache (request i owns pages i n .. i n + n - 1): token t of request i is ``base[i] + t``."""
    x = np.asarray(kv)
    if x.ndim != 3 or min(x.shape) < 1:
        raise ValueError(f"kv: expected a cache (b, S, d), got shape {x.shape}")
    check_int(page, "page", lo=1)
    b, S, d = x.shape
    n = -(-S // page)
    out = np.zeros((b, n * page, d), x.dtype)
    out[:, :S] = x
    return out.reshape(b * n, page, 1, d), np.arange(b, dtype=np.int64) * n * page

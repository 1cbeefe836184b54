"""Number formats of low-precision attention kernels, and rounding into them.

Every format is described once, from ``ml_dtypes.finfo`` where ml_dtypes has the type. TF32 has no NumPy
dtype: it lives in a float32 container whose low 13 fraction bits are zero, as on the tensor cores.

Rounding is exact: the input is widened to float64 (exact for every format here), scaled by a power of two so
that the target's quantum becomes 1, rounded to an integer, and scaled back. No step rounds twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .engine import get_engine

__all__ = [
    "Format",
    "FORMATS",
    "RoundingMode",
    "Overflow",
    "ROUNDING_MODES",
    "OVERFLOW_MODES",
    "get_format",
    "fsum_to_fp32",
    "is_float_dtype",
    "round_to",
    "round_significand",
    "Accumulator",
    "ACCUMULATORS",
    "round_accumulator",
    "FP32_MIN_NORMAL",
    "exponent",
    "flush_subnormals",
    "tf32_operand",
]

#: The rounding modes of :func:`round_to`.
RoundingMode = Literal["nearest-even", "toward-zero", "stochastic"]
#: What :func:`round_to` does past the largest finite value.
Overflow = Literal["ieee", "satfinite"]
#: The values of RoundingMode.
ROUNDING_MODES: tuple[str, ...] = ("nearest-even", "toward-zero", "stochastic")
#: The values of Overflow.
OVERFLOW_MODES: tuple[str, ...] = ("ieee", "satfinite")

_ML_FLOAT_DTYPES = frozenset(
    np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
)


@dataclass(frozen=True)
class Format:
    """A binary floating-point format: field widths, bias and the extreme values.

    ``dtype`` is the NumPy storage type (float32 for TF32 and for custom significand widths).
    """

    name: str
    dtype: np.dtype
    exponent_bits: int
    mantissa_bits: int  # stored fraction bits; precision is mantissa_bits + 1
    bias: int
    max_finite: float
    min_normal: float
    min_subnormal: float
    has_inf: bool

    @property
    def bits(self) -> int:
        """Width of the format itself (19 for TF32, although it is stored in 32)."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def precision(self) -> int:
        """Significand bits including the implicit one."""
        return self.mantissa_bits + 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        return int(np.frexp(self.max_finite)[1]) - 1

    @property
    def int_dtype(self) -> np.dtype:
        """Signed integer type of the storage width (for bit views)."""
        return np.dtype(f"int{8 * self.dtype.itemsize}")

    @property
    def uint_dtype(self) -> np.dtype:
        """Unsigned integer type of the storage width."""
        return np.dtype(f"uint{8 * self.dtype.itemsize}")

    def __repr__(self) -> str:
        return f"Format({self.name!r})"


def _from_finfo(name: str, dtype: npt.DTypeLike) -> Format:
    dt = np.dtype(dtype)
    fi = ml_dtypes.finfo(dt)
    with np.errstate(over="ignore", invalid="ignore"):
        has_inf = bool(np.isinf(np.array(np.inf).astype(dt).astype(np.float64)))
    return Format(
        name=name,
        dtype=dt,
        exponent_bits=int(fi.nexp),
        mantissa_bits=int(fi.nmant),
        bias=1 - int(fi.minexp),
        max_finite=float(fi.max),
        min_normal=float(fi.smallest_normal),
        min_subnormal=float(fi.smallest_subnormal),
        has_inf=has_inf,
    )


def _fp32_container(name: str, mantissa_bits: int) -> Format:
    """A format with FP32's exponent range and a narrower significand, stored as float32."""
    return Format(
        name=name,
        dtype=np.dtype(np.float32),
        exponent_bits=8,
        mantissa_bits=mantissa_bits,
        bias=127,
        max_finite=float(np.ldexp(2.0 - 2.0**-mantissa_bits, 127)),
        min_normal=float.fromhex("0x1p-126"),
        min_subnormal=float(np.ldexp(1.0, -126 - mantissa_bits)),
        has_inf=True,
    )


#: Every supported format by name.
FORMATS: dict[str, Format] = {
    "fp64": _from_finfo("fp64", np.float64),
    "fp32": _from_finfo("fp32", np.float32),
    "tf32": _fp32_container("tf32", 10),
    "fp16": _from_finfo("fp16", np.float16),
    "bf16": _from_finfo("bf16", ml_dtypes.bfloat16),
    "e4m3": _from_finfo("e4m3", ml_dtypes.float8_e4m3fn),
    "e5m2": _from_finfo("e5m2", ml_dtypes.float8_e5m2),
}

_ALIASES = {
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "e4m3",
    "e4m3fn": "e4m3",
    "fp8_e4m3": "e4m3",
    "float8_e5m2": "e5m2",
    "fp8_e5m2": "e5m2",
}
_BY_DTYPE = {f.dtype: f for name, f in FORMATS.items() if name != "tf32"}

FormatLike = Union[Format, str, npt.DTypeLike]
_FAST_SOURCES = frozenset(np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16))
_FAST_TARGETS = frozenset(("fp32", "fp16", "bf16", "e4m3", "e5m2"))


def get_format(fmt: FormatLike, *, argname: str = "fmt") -> Format:
    """Look a format up by `Format`, name (``"bf16"``, ``"e4m3"``, ``"float8_e4m3fn"``...) or dtype."""
    if isinstance(fmt, Format):
        return fmt
    if fmt is None:  # np.dtype(None) would silently mean float64
        raise TypeError(f"{argname}: expected a Format, a format name or a float dtype, got None")
    if isinstance(fmt, str):
        key = _ALIASES.get(fmt.lower(), fmt.lower())
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(f"{argname}: unknown format {fmt!r}; expected one of {sorted(FORMATS)}")
    try:
        dt = np.dtype(fmt)
    except TypeError:
        raise TypeError(f"{argname}: expected a Format, a format name or a float dtype, got {fmt!r}") from None
    if dt in _BY_DTYPE:
        return _BY_DTYPE[dt]
    raise ValueError(f"{argname}: dtype {dt} is not one of the supported formats {sorted(FORMATS)}")


def is_float_dtype(dtype: npt.DTypeLike) -> bool:
    """True for NumPy's float16/32/64 and ml_dtypes' bfloat16 and FP8 types."""
    dt = np.dtype(dtype)
    if not dt.isnative:  # big-endian data is the same numbers: callers convert it with as_native
        dt = dt.newbyteorder("=")
    return dt in _ML_FLOAT_DTYPES or dt in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def as_native(x: npt.ArrayLike) -> np.ndarray:
    """`x` as an array in this machine's byte order (a copy only when it is not), so that bit views are right."""
    arr = np.asarray(x)
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _as_float64(x: npt.ArrayLike, argname: str) -> np.ndarray:
    """Widen a float array (or Python float) to float64, exactly; reject everything else."""
    if isinstance(x, (float, int)) and not isinstance(x, bool):
        return np.asarray(float(x), dtype=np.float64)
    arr = np.asarray(x)
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{argname}: expected a float array (float16/32/64, bfloat16, float8), got dtype {arr.dtype}")
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
        return arr.astype(np.float64, copy=False)  # no caller writes to it


#: The least normal FP32 value, 2^-126.
FP32_MIN_NORMAL = np.float32(2.0**-126)


def exponent(x: np.ndarray, emin: int) -> np.ndarray:
    """The unnormalised exponent of each (finite, nonzero) x as int64: floor(log2|x|), at least `emin`, so that a
    subnormal of a format with that emin counts with it. Zeros, Inf and NaN give no meaningful value (-1, or
    `emin` if that is larger): callers mark them. ``frexp`` never sees a non-finite value, which on some NumPy
    builds raises the invalid flag (a RuntimeWarning)."""
    x = np.asarray(x)
    finite = np.isfinite(x)
    if not finite.all():
        x = np.where(finite, x, 0.5)  # frexp(0.5) = (0.5, 0): the -1 frexp(NaN) gives where it does not warn
    return np.maximum(np.frexp(x)[1].astype(np.int64) - 1, emin)


def tf32_operand(x: np.ndarray) -> np.ndarray:
    """An FP32 array as the tensor core reads it in TF32: its 19 high bits (sign, exponent, 10 fraction bits), the
    13 low fraction bits cleared, which truncates toward zero (an FP32 NaN whose payload is all in those bits
    reads as Inf)."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    return (x32.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def flush_subnormals(x: np.ndarray, *, keep_sign: bool = True) -> np.ndarray:
    """FP32 subnormals replaced by zero: of their sign (PTX ``.ftz``) or +0 (``atom.add.f32``)."""
    tiny = np.abs(x) < FP32_MIN_NORMAL
    if not tiny.any():
        return x
    return np.where(tiny, np.copysign(0.0, x) if keep_sign else 0.0, x).astype(x.dtype)


def _check_mode(mode: str, overflow: str) -> None:
    if mode not in ROUNDING_MODES:
        raise ValueError(f"mode: unknown rounding mode {mode!r}; expected one of {ROUNDING_MODES}")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow: unknown overflow behaviour {overflow!r}; expected one of {OVERFLOW_MODES}")


def _round_float64(
    x: np.ndarray,
    fmt: Format,
    mode: str,
    overflow: str,
    rng: np.random.Generator | np.ndarray | None,
) -> np.ndarray:
    """Round float64 values to `fmt`'s grid; the result is float64 and exactly representable in `fmt`.

    rng (stochastic only): a Generator, or the uniforms in [0, 1) to use, one per element."""
    ax = np.abs(x)
    finite = np.isfinite(ax)
    ax_f = np.where(finite, ax, 0.0)
    q = exponent(ax_f, fmt.emin) - fmt.mantissa_bits  # exponent of the quantum at ax
    scaled = np.ldexp(ax_f, -q)  # exact: a multiplication by a power of two that neither under- nor overflows
    if mode == "nearest-even":
        r = np.rint(scaled)
    elif mode == "toward-zero":
        r = np.trunc(scaled)
    else:  # stochastic: up with probability equal to the discarded fraction
        assert rng is not None
        lo = np.floor(scaled)
        u = rng.random(scaled.shape) if isinstance(rng, np.random.Generator) else rng  # or the draws themselves
        r = lo + (u < (scaled - lo))
    mag = np.ldexp(r, q)

    too_big = mag > fmt.max_finite
    if overflow == "satfinite" or mode == "toward-zero":
        # satfinite clamps (cvt.rn.satfinite); IEEE round-toward-zero never leaves the finite range either
        mag = np.where(too_big, fmt.max_finite, mag)
    else:
        mag = np.where(too_big, np.inf if fmt.has_inf else np.nan, mag)

    # non-finite inputs
    inf_in = np.isinf(ax)
    if overflow == "satfinite":
        inf_val = fmt.max_finite
    else:
        inf_val = np.inf if fmt.has_inf else np.nan
    mag = np.where(inf_in, inf_val, mag)
    mag = np.where(np.isnan(ax), np.nan, mag)
    return np.copysign(mag, x)


def _toward_zero_fp32(x: np.ndarray, fmt: Format, overflow: str) -> np.ndarray:
    """Toward zero from FP32 on the bits: where x and the result are normal in `fmt`, clearing the 23 - m low
    fraction bits is the rounding (the result is on `fmt`'s grid, so the final cast is exact); every other element
    (subnormal in `fmt`, past its largest finite, Inf, NaN) takes :func:`_round_float64`."""
    x = np.ascontiguousarray(x).reshape(-1)  # 0-d too: the caller restores the shape
    u = x.view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    drop = 23 - fmt.mantissa_bits
    lo = np.float32(fmt.min_normal).view(np.uint32)
    hi = np.uint32(int(np.float32(fmt.max_finite).view(np.uint32)) + (1 << drop))  # truncates to <= max_finite
    fast = (a >= lo) & (a < hi)
    y = (u & np.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)).view(np.float32)
    if not fast.all():
        slow = np.nonzero(~fast)
        with np.errstate(invalid="ignore", over="ignore"):
            y[slow] = _round_float64(x[slow].astype(np.float64), fmt, "toward-zero", overflow, None)
    with np.errstate(invalid="ignore", over="ignore"):
        return y.astype(fmt.dtype)


def _round_float64_rne(x: np.ndarray, fmt: Format, overflow: str, dtype: np.dtype | None = None) -> np.ndarray:
    """Nearest-even on the float64 bits (add half a target ulp minus one, plus the kept lsb, then truncate), on one
    uint64 buffer; exact wherever input and result are normal in `fmt`; every other element (zero, subnormal, past
    the largest finite, Inf, NaN) takes :func:`_round_float64`. The result in `dtype` (float64 if None).

    Element by element, so done in pieces that stay in cache (a replay's inputs are tens of millions of values:
    whole-array passes ran at the speed of memory, each temporary a fresh array to fault in)."""
    x = np.ascontiguousarray(x)
    flat = x.reshape(-1)
    out = np.empty(flat.shape, np.float64 if dtype is None else dtype)
    shift = np.uint64(52 - fmt.mantissa_bits)
    half = np.uint64((1 << (52 - fmt.mantissa_bits - 1)) - 1)
    keep = ~((np.uint64(1) << shift) - np.uint64(1))
    magnitude = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
    lo, inf = np.float64(fmt.min_normal).view(np.uint64), np.float64(np.inf).view(np.uint64)
    hi = np.float64(fmt.max_finite).view(np.uint64)
    buf = np.empty(min(flat.size, _RNE_CHUNK), np.uint64)
    for i in range(0, flat.size, _RNE_CHUNK):
        u = flat[i : i + _RNE_CHUNK].view(np.uint64)
        r = buf[: u.size]
        np.right_shift(u, shift, out=r)
        r &= np.uint64(1)  # the kept lsb: a tie goes to even
        r += u
        r += half
        r &= keep
        a = u & magnitude
        ok = a >= lo
        ok &= a < inf  # a NaN's bits may carry into the sign
        ok &= (r & magnitude) <= hi
        rf = r.view(np.float64)
        if not ok.all():
            slow = np.flatnonzero(~ok)
            rf[slow] = _round_float64(flat[i : i + _RNE_CHUNK][slow], fmt, "nearest-even", overflow, None)
        out[i : i + _RNE_CHUNK] = rf  # on `fmt`'s grid: a cast to its dtype is exact
    return out.reshape(x.shape)


_RNE_CHUNK = 1 << 15  # float64 values per piece of nearest-even rounding: its buffers fit in a core's L2


# bit generators whose Generator.random() is (next_uint64 >> 11) * 2^-53: one raw draw per uniform
_RAW_DOUBLES = (np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64)


def _stochastic_fp32(x: np.ndarray, fmt: Format, overflow: str, rng: np.random.Generator) -> np.ndarray:
    """Stochastic rounding from FP32 on the bits, with the very draws :func:`_round_float64` makes.

    Each element takes one raw 64-bit draw r, whose uniform is (r >> 11) 2^-53; with the d = 23 - m dropped bits
    holding R, "uniform < R / 2^d" is "r >> (64 - d) < R": add that bit above the dropped ones and clear them.
    Where x or the result is not normal in `fmt` (or past its largest finite), the element takes the general
    path with its own uniform."""
    u = np.ascontiguousarray(x).view(np.uint32).reshape(-1)
    y = np.empty_like(u)
    drop = 23 - fmt.mantissa_bits
    lo = np.float32(fmt.min_normal).view(np.uint32)
    hi = np.float32(fmt.max_finite).view(np.uint32)  # below it, rounding up stays finite
    for i in range(0, u.size, _DRAWS_CHUNK):  # the draws of a chunk stay in cache
        uc = u[i : i + _DRAWS_CHUNK]
        r = rng.bit_generator.random_raw(uc.size)
        if get_engine() == "numba":
            from ._formats_numba import stochastic_bits

            yc, slow = stochastic_bits(uc, r, drop, lo, hi)
        else:
            a = uc & np.uint32(0x7FFFFFFF)
            rem = a & np.uint32((1 << drop) - 1)
            up = ((r >> np.uint64(64 - drop)).astype(np.uint32) < rem).astype(np.uint32) << np.uint32(drop)
            yc = (uc - rem) + up
            slow = np.flatnonzero((a < lo) | (a >= hi))
        if slow.size:
            uniforms = (r[slow] >> np.uint64(11)).astype(np.float64) * 2.0**-53
            with np.errstate(invalid="ignore", over="ignore"):
                yc = yc.view(np.float32)
                yc[slow] = _round_float64(uc[slow].view(np.float32).astype(np.float64), fmt, "stochastic",
                                          overflow, uniforms)
        y[i : i + _DRAWS_CHUNK] = yc.view(np.uint32)
    with np.errstate(invalid="ignore", over="ignore"):
        return y.view(np.float32).reshape(x.shape).astype(fmt.dtype)


_DRAWS_CHUNK = 1 << 16


def _make_rng(seed: int | np.random.Generator | None, mode: str) -> np.random.Generator | None:
    if mode != "stochastic":
        return None
    if seed is None:
        raise ValueError("seed: mode='stochastic' needs a seed (an int or a numpy Generator)")
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return np.random.default_rng(int(seed))
    raise TypeError(f"seed: expected an int or a numpy Generator, got {type(seed).__name__}")


def round_to(
    x: npt.ArrayLike,
    fmt: FormatLike,
    *,
    mode: RoundingMode = "nearest-even",
    overflow: Overflow = "ieee",
    seed: int | np.random.Generator | None = None,
) -> np.ndarray:
    """Round a float array to `fmt` and return it in `fmt`'s dtype.

    mode: ``"nearest-even"``, ``"toward-zero"`` or ``"stochastic"`` (needs `seed`; rounds up with probability
        equal to the discarded fraction of a quantum).
    overflow: ``"ieee"``: a finite value whose rounded magnitude exceeds the largest finite number becomes Inf
        (NaN for e4m3fn, which has no Inf), except under ``"toward-zero"``, which IEEE 754 keeps finite; Inf
        inputs stay Inf (NaN for e4m3fn). ``"satfinite"``: both clamp to +-max finite, as PTX
        ``cvt.rn.satfinite`` does. NaN stays NaN. Signed zeros keep their sign.
    """
    f = get_format(fmt)
    _check_mode(mode, overflow)
    rng = _make_rng(seed, mode)
    if isinstance(x, (float, int)) and not isinstance(x, bool):
        x = float(x)
    arr = as_native(x)
    # every path returns an array of x's shape, 0-d for a scalar
    return np.asarray(_round_to(arr, f, mode, overflow, rng)).reshape(arr.shape)


def _round_to(arr: np.ndarray, f: Format, mode: str, overflow: str, rng) -> np.ndarray:
    if _BY_DTYPE.get(arr.dtype) is f and overflow == "ieee" and mode != "stochastic":
        return arr.copy()  # already on the grid: every deterministic mode is the identity
    if mode == "toward-zero" and arr.dtype in _FAST_SOURCES and f.name in _FAST_TARGETS and f.bits < 32:
        return _toward_zero_fp32(np.asarray(arr, dtype=np.float32), f, overflow)
    if (mode == "stochastic" and arr.dtype in _FAST_SOURCES and f.name in _FAST_TARGETS and f.bits < 32
            and type(rng.bit_generator) in _RAW_DOUBLES):
        return _stochastic_fp32(np.asarray(arr, dtype=np.float32), f, overflow, rng)
    if mode == "nearest-even" and arr.dtype in _FAST_SOURCES and f.name in _FAST_TARGETS:
        # from FP32 (or narrower), NumPy's and ml_dtypes' casts round once, to nearest even: the tests hold
        # them to the integer oracle bit for bit
        with np.errstate(invalid="ignore", over="ignore"):
            src = np.asarray(arr, dtype=np.float32)
            if overflow == "satfinite":
                src = np.clip(src, np.float32(-f.max_finite), np.float32(f.max_finite))
            return src.astype(f.dtype)
    x64 = _as_float64(arr, "x")
    with np.errstate(invalid="ignore", over="ignore"):
        if mode == "nearest-even" and f.name != "fp64":
            return _round_float64_rne(x64, f, overflow, f.dtype)
        return _round_float64(x64, f, mode, overflow, rng).astype(f.dtype)


def round_significand(
    x: npt.ArrayLike,
    significant_bits: int,
    *,
    mode: RoundingMode = "toward-zero",
    seed: int | np.random.Generator | None = None,
) -> np.ndarray:
    """Round to `significant_bits` significant bits with FP32's exponent range; return float32.

    This is the FP8 tensor-core accumulator (14 significant bits in an FP32 container, low bits zero).
    """
    if not isinstance(significant_bits, (int, np.integer)) or isinstance(significant_bits, bool):
        raise TypeError(f"significant_bits: expected an int, got {type(significant_bits).__name__}")
    if not 1 <= significant_bits <= 24:
        raise ValueError(f"significant_bits: expected 1..24, got {significant_bits}")
    fmt = _fp32_container(f"fp32[{significant_bits}]", int(significant_bits) - 1)
    return round_to(x, fmt, mode=mode, overflow="ieee", seed=seed)


# --- tensor-core accumulators: the final normalisation of an exact sum --------------------------------------

#: The tensor cores' accumulator formats.
Accumulator = Literal["fp32-rz", "e8m13-rz", "fp16-rne", "fp32-rne"]


@dataclass(frozen=True)
class AccumulatorFormat:
    """How a tensor-core accumulator holds a sum: significant bits, rounding, and the storage dtype."""

    significant_bits: int
    mode: RoundingMode
    dtype: np.dtype  # the storage type (FP16 or FP32); nearest-even rounds into it


#: Each accumulator format by name.
ACCUMULATORS: dict[str, AccumulatorFormat] = {
    "fp32-rz": AccumulatorFormat(24, "toward-zero", np.dtype(np.float32)),
    "e8m13-rz": AccumulatorFormat(14, "toward-zero", np.dtype(np.float32)),  # FP8 wgmma's 14 bits
    "fp16-rne": AccumulatorFormat(11, "nearest-even", np.dtype(np.float16)),
    "fp32-rne": AccumulatorFormat(24, "nearest-even", np.dtype(np.float32)),
}


def round_accumulator(v: np.ndarray, accumulator: str) -> np.ndarray:
    """An exact float64 sum rounded as the accumulator holds it, as float64; overflow gives Inf (toward zero too,
    as the hardware does). Toward zero in FP32's normal range clears the low bits of the float64 significand;
    below 2^-126 the grid is FP32's subnormal one (2^-149; 2^-139 for 14 bits)."""
    acc = ACCUMULATORS[accumulator]
    v = np.ascontiguousarray(v, dtype=np.float64)
    if acc.mode == "nearest-even":
        return round_to(v, acc.dtype).astype(np.float64)
    drop = 53 - acc.significant_bits
    r = (v.view(np.uint64) & np.uint64(~((1 << drop) - 1) & 0xFFFF_FFFF_FFFF_FFFF)).view(np.float64)
    tiny = (np.abs(v) < 2.0**-126) & (v != 0)
    if tiny.any():
        r[tiny] = round_significand(v[tiny], acc.significant_bits).astype(np.float64)
    return np.where(np.abs(v) >= 2.0**128, np.copysign(np.inf, v), r)


def fsum_to_fp32(terms: list[float]) -> float:
    """The exact sum of float64 terms rounded once to FP32, nearest even (fsum, then midpoints settled by the sign of
    the exact residual); Inf and NaN as IEEE addition has them."""
    if not all(map(math.isfinite, terms)):  # Inf and NaN as IEEE addition has them: inf - inf is NaN
        with np.errstate(invalid="ignore"):
            return float(np.sum(np.asarray(terms, dtype=np.float64)))
    s = math.fsum(terms)  # products of formats up to FP32 stay below 2^256: no float64 overflow
    if not math.isfinite(s):
        return s
    r = float(np.float32(s))
    if r == s:
        return r
    lo, hi = (r, float(np.nextafter(np.float32(r), np.float32(np.inf if s > r else -np.inf))))
    lo, hi = min(lo, hi), max(lo, hi)
    mid = (lo + hi) / 2  # exact in float64
    if math.isfinite(mid) and lo < s < hi and abs(s - mid) < abs(hi - lo) * 2.0**-27:
        # s may have been rounded onto or across the midpoint: the sign of the exact residual decides
        residual = math.fsum([*terms, -mid])
        if residual > 0:
            return hi
        if residual < 0:
            return lo
        return lo if int(np.float32(lo).view(np.uint32)) % 2 == 0 else hi
    return r

"""Testing helpers in numpy.testing's style: bitwise assertions, ULP distances, hypothesis strategies.

``hypothesis`` is imported only when a strategy is asked for, so that this module works without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .formats import Format, FormatLike, get_format, is_float_dtype

__all__ = ["assert_bitwise_equal", "ulp_distance", "row_ulp_distance", "bits_of", "float_arrays", "flashmla_check", "snapmla_check"]


def bits_of(x: npt.ArrayLike) -> np.ndarray:
    """The raw bits of a float array as unsigned integers of its width."""
    arr = np.asarray(x)
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"x: expected a float array, got dtype {arr.dtype}")
    return np.array(arr, order="C").view(get_format(arr.dtype).uint_dtype)


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Map sign-magnitude patterns to int64s that increase with the value (-0 and +0 both map to 0)."""
    b = bits.astype(np.uint64)
    sign = np.uint64(1) << np.uint64(width - 1)
    mag = (b & (sign - np.uint64(1))).astype(np.int64)
    return np.where((b & sign) != 0, -mag, mag)


def ulp_distance(actual: npt.ArrayLike, desired: npt.ArrayLike) -> np.ndarray:
    """Number of representable values between `actual` and `desired` elementwise (0 for +0 vs -0), as int64.

    Both must have the same float dtype (ml_dtypes types included). NaN on either side gives -1; an infinity
    counts as the value one past the largest finite number. Saturates at 2^63 - 1 (float64 pairs of opposite
    sign only).
    """
    a, d = np.asarray(actual), np.asarray(desired)
    if a.dtype != d.dtype:
        raise TypeError(f"actual and desired: dtypes differ ({a.dtype} vs {d.dtype})")
    width = 8 * a.dtype.itemsize
    oa, od = _ordered(bits_of(a), width), _ordered(bits_of(d), width)
    same_side = (oa >= 0) == (od >= 0)
    # opposite signs: |oa| + |od| may pass 2^63 - 1 for float64 only; add in uint64 and saturate
    across = np.minimum(np.abs(oa).astype(np.uint64) + np.abs(od).astype(np.uint64), np.uint64(2**63 - 1))
    dist = np.where(same_side, np.abs(oa - np.where(same_side, od, 0)), across.astype(np.int64))
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
        nan = np.isnan(a.astype(np.float64)) | np.isnan(d.astype(np.float64))
    return np.where(nan, -1, dist).astype(np.int64)


def row_ulp_distance(actual: npt.ArrayLike, desired: npt.ArrayLike, fmt: FormatLike | None = None) -> np.ndarray:
    """``|actual - desired|`` in ULPs of its row's largest finite magnitude (the last axis, over both arrays), as
    float64: the scale a reader judges an output's difference by. :func:`ulp_distance` counts the values between
    the two, which near zero is many for a change far below the row's rounding. An ULP of ``x`` is
    ``2^(max(floor(log2 |x|), emin) - mantissa bits)`` in `fmt` (default: the arrays' format); NaN where either
    side is NaN or not finite (a ULP distance of NaN or an infinity against a number means nothing)."""
    a, d = np.asarray(actual), np.asarray(desired)
    if a.dtype != d.dtype or a.shape != d.shape:
        raise TypeError(f"actual and desired: expected one dtype and shape, got {a.dtype} {a.shape} and {d.dtype} "
                        f"{d.shape}")
    f = get_format(a.dtype if fmt is None else fmt)
    with np.errstate(invalid="ignore", over="ignore"):  # ml_dtypes warns when it widens a NaN
        wa, wd = np.atleast_1d(a.astype(np.float64)), np.atleast_1d(d.astype(np.float64))
        finite = np.isfinite(wa) & np.isfinite(wd)
        big = np.max(np.where(finite, np.maximum(np.abs(wa), np.abs(wd)), 0.0), axis=-1, keepdims=True)
        e = np.maximum(np.frexp(big)[1] - 1, f.emin)
        out = np.where(finite, np.abs(wa - wd) / np.ldexp(1.0, e - f.mantissa_bits), np.nan)
    return out.reshape(a.shape)


def _fmt_elem(v: Any, b: Any, hexw: int) -> str:
    return f"{float(v)!r} (0x{int(b):0{hexw}x})"


def assert_bitwise_equal(
    actual: npt.ArrayLike,
    desired: npt.ArrayLike,
    *,
    err_msg: str = "",
    verbose: bool = True,
    max_shown: int = 8,
    allow_empty: bool = False,
) -> None:
    """Raise AssertionError unless `actual` and `desired` have the same dtype, shape and bits.

    The message gives the number of differing elements and the first `max_shown` of them with their indices,
    values, hex bits and ULP distance. NaNs compare by payload, as bits do. Two arrays of no element compare
    nothing: an error unless `allow_empty` (a check that compared nothing is never a pass by default).
    """
    __tracebackhide__ = True
    a, d = np.asarray(actual), np.asarray(desired)
    header = "\nArrays are not bitwise equal"
    if err_msg:
        header += "\n" + err_msg
    if a.dtype != d.dtype:
        raise AssertionError(f"{header}\n(dtype mismatch) actual: {a.dtype}, desired: {d.dtype}")
    if a.shape != d.shape:
        raise AssertionError(f"{header}\n(shapes mismatch) actual: {a.shape}, desired: {d.shape}")
    if a.size == 0 and not allow_empty:
        raise AssertionError(f"{header}\n(nothing compared) both arrays have shape {a.shape}, no element; pass "
                             "allow_empty=True where that is what is meant")
    ba, bd = bits_of(a), bits_of(d)
    diff = ba != bd
    if not diff.any():
        return
    n_bad = int(diff.sum())
    lines = [header, f"Mismatched elements: {n_bad} / {diff.size} ({100.0 * n_bad / diff.size:.3g}%)"]
    if verbose:
        hexw = 2 * a.dtype.itemsize
        ulps = ulp_distance(a, d)
        idx = np.argwhere(diff) if diff.ndim else np.zeros((1, 0), dtype=np.intp)
        for pos in idx[:max_shown]:
            t = tuple(int(p) for p in pos)
            lines.append(
                f" at {t}: actual {_fmt_elem(a[t], ba[t], hexw)}, desired {_fmt_elem(d[t], bd[t], hexw)},"
                f" {int(ulps[t])} ulp"
            )
        if n_bad > max_shown:
            lines.append(f" ... and {n_bad - max_shown} more")
        lines.append(f"Max ULP distance: {int(ulps.max())}")
    raise AssertionError("\n".join(lines))


def _raw_bits(f: Format, allow_nan: bool, allow_infinity: bool, allow_subnormal: bool) -> Any:
    """Strategy of raw bit patterns (Python ints) of `f`'s storage width, filtered by class."""
    from hypothesis import strategies as st

    store = get_format("fp32") if f.name == "tf32" else f
    width = 8 * store.dtype.itemsize
    low_zero = ~((1 << 13) - 1) if f.name == "tf32" else -1  # TF32: the 13 low fraction bits are zero

    def ok(raw: int) -> bool:
        with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
            x = float(np.array(raw, dtype=store.uint_dtype).view(store.dtype).astype(np.float64))
        if np.isnan(x):
            return allow_nan
        if np.isinf(x):
            return allow_infinity
        return allow_subnormal or x == 0.0 or abs(x) >= f.min_normal

    return st.integers(0, (1 << width) - 1).map(lambda r: r & low_zero).filter(ok)


def float_arrays(
    fmt: FormatLike,
    shape: int | tuple[int, ...],
    *,
    allow_nan: bool = False,
    allow_infinity: bool = False,
    allow_subnormal: bool = True,
    min_value: float | None = None,
    max_value: float | None = None,
) -> Any:
    """A hypothesis strategy of arrays of `fmt` (its ml_dtypes dtype; float32 for TF32).

    Elements are drawn as bit patterns, so every code of the format can appear: finite only by default,
    subnormals unless ``allow_subnormal=False``, Inf and NaN on request. `min_value` / `max_value` bound the
    finite values.
    """
    from hypothesis import strategies as st

    f = get_format(fmt)
    store = get_format("fp32") if f.name == "tf32" else f
    shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    size = int(np.prod(shp, dtype=np.int64))
    raw = _raw_bits(f, allow_nan, allow_infinity, allow_subnormal)
    if min_value is not None or max_value is not None:
        lo = -np.inf if min_value is None else float(min_value)
        hi = np.inf if max_value is None else float(max_value)
        if lo > hi:
            raise ValueError(f"min_value: {lo} is above max_value {hi}")

        def in_range(r: int) -> bool:
            x = float(np.array(r, dtype=store.uint_dtype).view(store.dtype).astype(np.float64))
            return not np.isfinite(x) or lo <= x <= hi

        raw = raw.filter(in_range)
    return st.lists(raw, min_size=size, max_size=size).map(
        lambda r: np.array(r, dtype=store.uint_dtype).reshape(shp).view(store.dtype)
    )


def flashmla_check(out: npt.ArrayLike, ref: npt.ArrayLike) -> dict[str, float | bool]:
    """FlashMLA's test criteria against a reference: every element within 8e-4 absolute or 2.01/128 relative, and
    ``cos_diff`` below 5e-6. Returns the fraction of elements passing, the cos_diff and whether both hold."""
    from .experiments.metrics import cos_diff

    o, r = np.asarray(out).astype(np.float64), np.asarray(ref).astype(np.float64)
    err = np.abs(o - r)
    with np.errstate(divide="ignore", invalid="ignore"):
        passing = float(np.mean((err < 8e-4) | (err / np.abs(r) < 2.01 / 128)))
    cd = cos_diff(o, r)
    return {"elements_passing": passing, "cos_diff": cd, "ok": passing == 1.0 and cd < 5e-6}


def snapmla_check(out: npt.ArrayLike, ref: npt.ArrayLike) -> dict[str, float | bool]:
    """SnapMLA's port's test criteria against FP32 attention: relative L2 error <= 5e-2 and 1 - cos <= 1e-3."""
    o, r = np.asarray(out).astype(np.float64), np.asarray(ref).astype(np.float64)
    rel = float(np.linalg.norm(o - r) / np.linalg.norm(r))
    cos = float(1 - np.sum(o * r) / np.linalg.norm(o) / np.linalg.norm(r))
    return {"rel_l2": rel, "one_minus_cos": cos, "ok": rel <= 5e-2 and cos <= 1e-3}

"""Scalars as a deployed kernel's API takes them, and the constants each kernel derives from them.

Every kernel modelled here takes its softmax scale, descales and cache scales as a C++ ``float`` (FlashMLA's
``const float softmax_scale``, FA3's ``float const softmax_scale``) or as a Python float that Triton passes as
``fp32``: the value the kernel sees is the caller's number rounded to FP32 once, on every machine (the rounding is
the interface's, not the arithmetic's). :func:`api_float` is that rounding: a descale or cache scale is taken
whatever its value, 0, negative, subnormal, infinite or NaN (no kernel checks them; what each computes with them is
its arithmetic, captured). A softmax scale is taken as the kernels take it (:func:`api_scale`): any finite number,
0, negative and subnormal ones included (a fast-math build's instructions read a subnormal constant as 0, wherever
the constant is formed, on the host or on the device); NaN and infinities are refused.

The kernels then derive their constants in two ways, both kept here so no model derives one by hand:

- :func:`scale_log2`: ``float(softmax_scale * M_LOG2E)``, the FP32 scale times the *double* ``M_LOG2E``, rounded
  once (FlashMLA's dense decode, ``csrc/api/dense_decode.h:139``; FlashMLA-ETAP; FA3's ``flash_api.cpp``);
- :func:`scale_log2_f32`: ``sm_scale * LOG_2_E`` with ``LOG_2_E = 1.44269504f``, an FP32 product (FlashMLA's
  sparse decode and prefill, ``csrc/api/sparse_decode.h:387``, ``csrc/api/sparse_fwd.h:171``).

For a scale whose FP32 value times log2 e lies near a midpoint of FP32, the two differ by an ULP, and so does a
model that forgets the API's rounding: 192^-0.5 (DeepSeek-V3's scale without YaRN) is such a scale for FlashMLA's
dense decode.
"""

from __future__ import annotations

import math

import numpy as np

from ...machines import Machine
from .._common import DEFAULT_SCALE

__all__ = ["api_float", "api_scale", "softmax_scale", "scale_log2", "scale_log2_f32"]

#: log2 e: ``M_LOG2E`` in double, and ``LOG_2_E = 1.44269504f`` (FlashMLA's ``csrc/api/common.h``) or
#: ``CUDART_L2E_F`` as ``mc.f`` rounds it on FP32 machines (the same float, 0x3FB8AA3B); exact on ``golden``.
_LOG2E = math.log2(math.e)


def _real(x: object, name: str, want: str) -> float:
    """`x` as a Python float (an int beyond any float: inf), or a ValueError naming `name` if it is no real number
    (a bool, a string...)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: expected {want}, got {x!r}")
    try:
        return float(x)
    except OverflowError:
        return math.inf


def api_float(x: object, name: str) -> np.float32:
    """`x` as a kernel's ``float`` parameter (or one-element FP32 tensor) holds it: rounded to FP32 once, whatever it
    is: 0, negative, subnormal, infinite or NaN (a number beyond FP32 becomes an infinity, one below it a zero). No
    kernel checks its descales and cache scales; what each computes with them is its arithmetic, captured. A
    ValueError names `name` for what is no real number (a bool, a string...)."""
    v = _real(x, name, "a float32 number")
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(v)


def api_scale(x: object, name: str = "scale") -> np.float32:
    """A softmax scale as a kernel's ``float`` parameter holds it: rounded to FP32 once. Any real number whose FP32
    value is finite is taken, 0, negative and subnormal ones included: no kernel checks them (a fast-math kernel's
    instructions read a subnormal one as 0, :meth:`~amla_sim.machines.Machine.ftz`). Refused, naming `name`: NaN
    and infinities (FA3 and FlashInfer raise on them; what the others compute, NaN throughout, is not captured)."""
    with np.errstate(over="ignore"):
        f = np.float32(_real(x, name, "a finite float32 number"))
    if not np.isfinite(f):
        raise ValueError(f"{name}: expected a finite float32 number, got {x!r} (NaN and infinities are not "
                         "modelled; FA3 and FlashInfer refuse them)")
    return f


def softmax_scale(scale: float | None, default: float = DEFAULT_SCALE, *,
                  double: bool = False) -> np.float32 | np.float64:
    """The API's ``float softmax_scale`` (None: `default`, 576^-0.5 unless the kernel's interface says
    otherwise), taken as :func:`api_scale` takes it. double: the API takes a ``double`` (a torch op's ``float``, as
    vLLM's and SGLang's FlashMLA ops do): the caller's number itself, as float64, checked as a float would be."""
    value = default if scale is None else scale
    f = api_scale(value, "scale")
    return np.float64(value) if double else f


def scale_log2(mc: Machine, scale: np.float32 | np.float64) -> np.ndarray:
    """``float(softmax_scale * M_LOG2E)``: the API's scale (FP32, or a double) times log2 e in double, rounded once
    to the machine's float (exact on ``golden``)."""
    return mc.f(np.float64(scale) * _LOG2E)


def scale_log2_f32(mc: Machine, scale: np.float32 | np.float64) -> np.ndarray:
    """``sm_scale * LOG_2_E``: the API's FP32 scale times fl32(log2 e), an FP32 product on FP32 machines; a double
    scale makes it a double product, rounded once."""
    if isinstance(scale, np.float64) and mc.dtype == np.float32:
        return mc.f(scale * np.float64(np.float32(_LOG2E)))
    return mc.f(mc.f(scale) * mc.f(_LOG2E))

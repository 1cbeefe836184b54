"""Independent reference arithmetic for the tests: Python integers and Fractions only, no NumPy rounding."""

from __future__ import annotations

import math
from fractions import Fraction


def round_fraction(v: Fraction, mant_bits: int, emin: int, emax: int, mode: str = "rne",
                   max_finite: float | None = None) -> float:
    """Round a Fraction to a binary format (mant_bits fraction bits, normal exponents emin..emax).

    mode "rne" or "rz"; overflow gives +-inf for rne and for rz when the exponent passes emax (as tensor cores do).
    """
    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    q = max(e, emin) - mant_bits
    scaled = a / Fraction(2) ** q
    n = scaled.numerator // scaled.denominator
    rem = scaled - n
    if mode == "rne" and (rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1)):
        n += 1
    r = Fraction(n) * Fraction(2) ** q
    top = (2 - Fraction(1, 2**mant_bits)) * Fraction(2) ** emax if max_finite is None else Fraction(max_finite)
    if r > top:
        return sign * math.inf
    return sign * float(r)


def to_fp32(v: Fraction, mode: str = "rne") -> float:
    return round_fraction(v, 23, -126, 127, mode)


def t_fdpa(a: list[float], b: list[float], c: float, emin_in: int, F: int, out: str) -> float:
    """The T-FDPA definition, term by term, in Fractions (zeros take no part in e_max)."""

    def expo(x: float, emin: int) -> int:
        return max(math.frexp(x)[1] - 1, emin)

    terms, exps = [], []
    for x, y in zip(a, b):
        if x != 0 and y != 0:
            terms.append(Fraction(x) * Fraction(y))
            exps.append(expo(x, emin_in) + expo(y, emin_in))
    if c != 0:
        terms.append(Fraction(c))
        exps.append(expo(c, -126))
    if not terms:
        return 0.0
    e_max = max(exps)
    unit = Fraction(2) ** (e_max - F)
    s = sum(int(t / unit) for t in terms)  # int() truncates toward zero
    v = s * unit
    if out == "fp32-rz":
        return to_fp32(v, "rz")
    if out == "e8m13-rz":
        return round_fraction(v, 13, -126, 127, "rz")
    if out == "fp16-rne":
        return round_fraction(v, 10, -14, 15, "rne")
    raise ValueError(out)

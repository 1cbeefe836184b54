"""The ``amla-sim`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from . import __version__
from .bits import as_int, lemma_domain, mul_pow2_via_int_add
from .formats import get_format

def lemma_examples(fmt_name: str = "fp32") -> list[tuple[str, float, int]]:
    """(case, x, n) triples: Fig. 3, cases inside Lemma 3.1's domain, and each way out of it, for one format."""
    f = get_format(fmt_name)
    top = (1 << f.exponent_bits) - 1  # the all-ones exponent field: Inf and NaN

    def value(e_field: int, frac: float = 0.0) -> float:
        return float(np.ldexp(1.0 + frac, e_field - f.bias))

    return [
        (f"Fig. 3: 0.5 is {f.bias - 1} * 2^{f.mantissa_bits} as INT", 0.5, 0),
        ("in domain: 0.5 * 2^1", 0.5, 1),
        ("in domain: 3 * 2^5", 3.0, 5),
        ("in domain: -1.5 * 2^-10", -1.5, -10),
        (f"in domain: smallest normal * 2^{top - 2}", f.min_normal, top - 2),
        ("out: zero (E = 0), n = -3", 0.0, -3),
        ("out: zero (E = 0), n = +3", 0.0, 3),
        ("out: subnormal (E = 0), n = +1", 3 * f.min_subnormal, 1),
        ("out: exponent underflow (E + n <= 0)", value(7), -10),
        (f"out: E + n = {top} (Inf)", value(top - 28), 28),
        (f"out: exponent overflow (E + n > {top})", value(top - 28, 0.25), 40),
    ]


def _lemma_rows(fmt_name: str) -> list[dict[str, object]]:
    fmt = get_format(fmt_name)
    rows = []
    width = 2 * fmt.dtype.itemsize
    for case, x, n in lemma_examples(fmt_name):
        with np.errstate(over="ignore", under="ignore"):
            xv = np.array(x).astype(fmt.dtype)
            got = mul_pow2_via_int_add(xv, n)
            x64 = xv.astype(np.float64)
            exact = float(np.ldexp(x64, n))  # Inf where even float64 cannot hold it
            representable = np.isfinite(exact) and np.ldexp(exact, -n) == x64
        ix, ig = int(as_int(xv)), int(as_int(got))
        mask = (1 << (4 * width)) - 1
        rows.append(
            {
                "case": case,
                "x": float(xv.astype(np.float64)),
                "x_bits": f"0x{ix & mask:0{width}x}",
                "x_as_int": ix,
                "n": n,
                "int_add": float(got.astype(np.float64)),
                "int_add_bits": f"0x{ig & mask:0{width}x}",
                "x_times_2^n": exact,
                "in_domain": bool(lemma_domain(xv, n)),
                "bitwise_equal": bool(
                    representable
                    and float(got.astype(np.float64)) == exact
                    and np.signbit(got.astype(np.float64)) == np.signbit(exact)
                ),
            }
        )
    return rows


def _cmd_lemma(args: argparse.Namespace) -> int:
    rows = _lemma_rows(args.format)
    if args.json:
        print(json.dumps({"format": args.format, "examples": rows}, indent=2))
        return 0
    print(f"Lemma 3.1 on {args.format}: AS_FLOAT(AS_INT(x) + n * 2^m) against x * 2^n\n")
    hdr = f"{'case':40s} {'x':>12s} {'bits':>10s} {'n':>4s}   {'int add':>13s} {'bits':>10s}   {'x * 2^n':>13s}  dom  ok"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['case']:40s} {r['x']:12.5g} {r['x_bits']:>10s} {r['n']:4d}   {r['int_add']:13.5g}"
            f" {r['int_add_bits']:>10s}   {r['x_times_2^n']:13.5g}  {'yes' if r['in_domain'] else 'no ':3s}"
            f"  {'=' if r['bitwise_equal'] else 'X'}"
        )
    fig3 = rows[0]
    f = get_format(args.format)
    print(f"\n0.5 as INT = {fig3['x_as_int']} = {f.bias - 1} * 2^{f.mantissa_bits}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command."""
    parser = argparse.ArgumentParser(
        prog="amla-sim",
        description="Bit-exact simulator of low-precision MLA attention kernels (AMLA, SnapMLA, ETAP, FlashMLA).",
    )
    parser.add_argument("--version", action="version", version=f"amla-sim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("lemma", help="show the AMLA Lemma 3.1 bit trick in and out of its domain")
    p.add_argument("--format", default="fp32", choices=["fp32", "fp16", "bf16", "fp64"], help="float format")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_lemma)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``amla-sim`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

"""amla-sim: what low-precision MLA attention kernels compute, bit for bit.

Layers (see README): ``formats`` and ``bits`` (number formats, rounding, bit views, Lemma 3.1), ``arith``
(tensor-core MMA models, elementwise ops, reductions, global memory with atomics), and on top of them the
algorithms. Importing ``amla_sim`` never needs torch.
"""

from . import bits, formats, machines
from .arith import mma
from ._version import __version__
from .bits import lemma_domain, mul_pow2_via_int_add
from .comparison import ComparisonReport, StageComparison, compare
from .formats import FORMATS, Format, get_format, round_significand, round_to

__all__ = [
    "__version__",
    "bits",
    "formats",
    "machines",
    "mma",
    "FORMATS",
    "Format",
    "get_format",
    "round_to",
    "round_significand",
    "mul_pow2_via_int_add",
    "lemma_domain",
    "compare",
    "ComparisonReport",
    "StageComparison",
]

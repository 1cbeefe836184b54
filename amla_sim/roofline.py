"""Arithmetic intensity of decode attention (AMLA paper Section 2.4, Table 2; FlashMLA deep dive).

FLOPs = 2 N1 S1 S2 (Dk + Dv). KV bytes (BF16): MHA/GQA read K and V of every KV head, 2 N2 S2 (Dk + Dv); MLA reads
one latent cache shared by K and V, 2 S2 Dk. The intensity is N1 S1 / N2 for MHA/GQA (the paper prints N1 S1,
dropping the N2 that its own Table 2 divides by) and N1 S1 (Dk + Dv) / Dk for MLA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AttentionShape", "flops", "kv_bytes", "intensity", "compute_bound_threshold", "TABLE2"]


@dataclass(frozen=True)
class AttentionShape:
    """One decode step: N1 query heads, N2 KV heads, S1 query tokens, S2 KV tokens, head dims Dk, Dv."""

    name: str
    kind: Literal["mha", "gqa", "mla"]
    n1: int
    n2: int
    s1: int = 1
    s2: int = 8192
    dk: int = 128
    dv: int = 128

    def __post_init__(self) -> None:
        for f in ("n1", "n2", "s1", "s2", "dk", "dv"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if self.kind not in ("mha", "gqa", "mla"):
            raise ValueError(f"kind: expected 'mha', 'gqa' or 'mla', got {self.kind!r}")


def flops(s: AttentionShape) -> int:
    return 2 * s.n1 * s.s1 * s.s2 * (s.dk + s.dv)


def kv_bytes(s: AttentionShape, bytes_per_value: int = 2) -> int:
    if s.kind == "mla":
        return bytes_per_value * s.s2 * s.dk
    return bytes_per_value * s.n2 * s.s2 * (s.dk + s.dv)


def intensity(s: AttentionShape) -> float:
    """FLOPs per byte of KV traffic (the query and output are negligible next to the cache)."""
    return flops(s) / kv_bytes(s)


def compute_bound_threshold(
    peak_tflops: float, bandwidth_tbs: float, *, dk: int = 576, dv: int = 512, flashmla_approximation: bool = True
) -> float:
    """The h_q s_q above which MLA decode is compute-bound on a machine of this peak and bandwidth.

    FlashMLA's blog approximates (Dk + Dv) / Dk by 2 and gets h_q s_q >= peak / bandwidth / 2 (= 128 on an H800
    at 865 TFLOP/s and 3.35 TB/s); without the approximation the factor is (Dk + Dv) / Dk = 1.89.
    """
    for name, v in (("peak_tflops", peak_tflops), ("bandwidth_tbs", bandwidth_tbs)):
        if not (v > 0 and v != float("inf")):
            raise ValueError(f"{name}: expected a positive finite number, got {v!r}")
    ratio = peak_tflops / bandwidth_tbs  # FLOPs per byte the machine balances at
    if not 0 < ratio < float("inf"):
        raise ValueError(f"peak_tflops and bandwidth_tbs: their ratio ({peak_tflops!r} / {bandwidth_tbs!r}) is "
                         "past the float range")
    return ratio / (2.0 if flashmla_approximation else (dk + dv) / dk)


#: AMLA's Table 2: the variants and the arithmetic intensity the paper gives.
TABLE2 = (
    (AttentionShape("MHA", "mha", 64, 64), 1),
    (AttentionShape("GQA", "gqa", 64, 8), 8),
    (AttentionShape("MLA-64", "mla", 64, 1, dk=576, dv=512), 121),
    (AttentionShape("MLA-128", "mla", 128, 1, dk=576, dv=512), 242),
    (AttentionShape("MLA-128 (S_q = 2)", "mla", 128, 1, s1=2, dk=576, dv=512), 484),
)

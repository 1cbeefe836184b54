"""The row sums of FlashAttention's ``softmax.h`` as the CUDA decodes derived from it keep them over an m64nN wgmma
accumulator: each of a row's four lanes sums its own 16 columns of a 64-key block, and the lanes meet once, at the
end. FlashAttention-3's MLA decode (:mod:`amla_sim.algorithms.deployed.fa3.mla`) and vLLM's dense FP8 FlashMLA
decode (:mod:`amla_sim.algorithms.deployed.flashmla.dense_fp8`) share them."""

from __future__ import annotations

import numpy as np

from ...machines import Machine

__all__ = ["lane_sums", "quad_total"]


def lane_sums(mc: Machine, part: np.ndarray | None, s: np.ndarray | None, P: np.ndarray) -> np.ndarray:
    """The four lanes' partial row sums after a block, P (R, N) -> (R, 4) (N a multiple of 8: 64 keys in the
    decodes, 128 or 96 in FA3's prefill): lane t adds its columns 8j + 2t + e in (j, e) order (``thread_reduce_``),
    from the first column (first block: `part` None) or onto ``fma(l, s, .)`` (``row_sum *= scores_scale``
    contracted into the first add)."""
    groups = P.shape[-1] // 8
    Pl = P.reshape(P.shape[:-1] + (groups, 4, 2))  # column 8j + 2t + e -> (j, t, e)
    terms = [Pl[..., j, :, e] for j in range(groups) for e in range(2)]
    acc = terms[0] if part is None else mc.mul_add(part, s[..., None], terms[0])
    for x in terms[1:]:
        acc = mc.f(acc + x)
    return acc


def quad_total(mc: Machine, part: np.ndarray) -> np.ndarray:
    """``quad_allreduce_``: the four lanes' sums in a butterfly, xor 2 and then xor 1: ``(l0 + l2) + (l1 + l3)``."""
    return mc.f(mc.f(part[..., 0] + part[..., 2]) + mc.f(part[..., 1] + part[..., 3]))

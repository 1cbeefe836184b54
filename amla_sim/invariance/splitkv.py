"""What the split/merge Triton decodes share in the invariance study (SGLang's,
:mod:`~amla_sim.invariance.sglang`, and vLLM's, :mod:`~amla_sim.invariance.vllm`): one query a request, each
request cut into a count of equal splits (:func:`~amla_sim.algorithms.deployed.splitkv.split_ranges`), and stage
1's grid, which holds the split count in CUDA's z extent and the head tiles in its y extent (at most 65535 each).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.sglang.scheduler import deterministic_kv_splits
from ..algorithms.deployed.splitkv import split_ranges
from .kernel import DenseDecode, Plan, Request
from .launches import Launch

__all__ = ["SplitKVDecode", "MAX_GRID", "SHARED_NUMERICS"]

#: CUDA's grid y and z extents: stage 1's head tiles and splits.
MAX_GRID = 65535
#: The steps every member computes alike (stage 1 and stage 2 of ``decode_attention.py``).
SHARED_NUMERICS = {
    "keys": ("bf16", "BF16"),
    "scores": ("mma.sync 512 + 64", "mma.sync m16n8k16: q[:512] K^T then q[512:] K_rope^T chained in one FP32 "
                                    "accumulator, then times sm_scale"),
    "max": ("natural units", "running max of the scaled scores (natural units)"),
    "exp": ("ex2(fl(x log2 e))", "tl.exp: ex2.approx of fl(x log2 e)"),
    "P": ("bf16", "BF16"),
    "row sum": ("mma.sync layout", "mma.sync accumulator layout: 2 adjacent columns a thread, 4 threads, then the "
                                   "warps"),
    "normalise": ("div.full", "div.full (acc / l)"),
    "combine": ("online merge", "stage 2: an online merge over the splits in order, natural-log weights, acc / l "
                                "at the end"),
}


class SplitKVDecode(DenseDecode):
    """A member of the split/merge family: `split_counts` says how many splits each request of a launch gets,
    `min_block_kv` the smallest split."""

    row_tile = 16  # BLOCK_H
    takes_s_q = False
    takes_num_kv_splits = True
    min_block_kv: int

    @abstractmethod
    def split_counts(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> np.ndarray:
        """Every request's split count in `launch` (int64, one a request)."""

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        tiles = -(-heads // self.row_tile)
        if tiles > MAX_GRID:
            raise ValueError(f"heads: {heads} heads make {tiles} head tiles of {self.row_tile}, more than stage 1's "
                             f"grid holds in CUDA's y extent ({MAX_GRID})")
        if launch.num_kv_splits is not None:  # the models' own bound, named as the study's
            check_int(launch.num_kv_splits, "num_kv_splits", lo=1, hi=MAX_GRID)
        top = int(self.split_counts(launch, heads=heads, options=options).max())
        if top > MAX_GRID:
            raise ValueError(f"num_sms: {self.name} would cut a request of the launch {launch.label!r} into {top} "
                             f"splits, more than stage 1's grid holds in CUDA's z extent ({MAX_GRID})")
        # the request runs its non-empty splits; split_ranges holds every request's up to the launch's most
        return min(top, -(-launch.length // self.min_block_kv)), top * launch.batch

    def max_splits(self, launch: Launch, *, heads: int) -> int:
        return MAX_GRID

    def _ranges(self, lengths: tuple[int, ...], counts: np.ndarray) -> list[Plan]:
        top = int(np.max(counts))
        return [[(int(a), int(b)) for a, b in r if b > a]
                for r in split_ranges(lengths, counts, top, min_block_kv=self.min_block_kv)]

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        return self._ranges(launch.lengths, self.split_counts(launch, heads=req.heads, options=req.recipe))

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        counts = np.ones(launch.batch, np.int64) if split_tokens is None else \
            deterministic_kv_splits(launch.lengths, split_tokens)
        return self._ranges(launch.lengths, counts)

    def _count(self, req: Request, plan: Plan) -> int:
        """The split count that cuts the request as `plan` does (empty splits add nothing)."""
        n = len(plan)
        if split_ranges([req.length], [n], n, min_block_kv=self.min_block_kv)[0].tolist() != [list(r) for r in plan]:
            raise ValueError(f"plan: {self.name} cuts a request into equal splits of a multiple of "
                             f"{self.min_block_kv} token(s); {plan} is not such a cut")
        return n

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        out = super().batch(req, launch)
        return {**out, "q": out["q"][:, -1]}  # one query a request: (b, heads, 576)

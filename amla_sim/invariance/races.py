"""Which rows of a request FlashMLA-ETAP's two data races can change from run to run: :func:`etap_race_exposure`.

The model of :func:`amla_sim.algorithms.flashmla_etap` is the race-free kernel; the published one
(pengcuo/FlashMLA-ETAP 39e6160, ``csrc/flash_fwd_mla_kernel.h``) reads shared memory twice before the data in it
is sure to be there:

- ``p-transpose``: the S^T warpgroup stores ``P^T`` with generic stores (``compute_attn_1rowblock_splitkv_mla``,
  ``cute::copy(rP, mtPsP)``), only *arrives* at the ``SReady`` barrier, and its own wgmma and then the other
  warpgroup's read ``P^T`` through the async proxy, with no ``fence.proxy.async`` between;
- ``epilogue``: ``store`` writes the accumulator to ``sOaccumTranspose`` (``cute::copy``) and every thread reads
  other threads' entries back in the transposing loop, with no barrier between the write and the read.

Both land on the same elements, which the tile layout fixes. A tile is 16 query rows (``kBlockM``: row
``r = s * heads + h`` of the request, m-block ``r // 16``) against a split's keys; in either store a thread
holds its queries as ``2t, 2t + 1`` and ``2t + 8, 2t + 9`` (the n8 halves of the wgmma m64n16 fragment) and
writes the second half last. So rows ``r % 16 >= 8`` are exposed, the other half never. Among their columns the
first read are d_v 0-63: warpgroup 0's first m64 fragment, which the epilogue's loop reads in its first four
iterations (d_v ``16k`` to ``16k + 15`` in iteration ``k``) and which the first of warpgroup 0's four m64 wgmmas
computes from ``P^T``; then d_v 256-319, the other warpgroup's first. The LSE comes from registers and never
races. Every tile of a request is a chance: each of its splits, in each m-block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._validate import check_int
from ..algorithms._common import D_V
from ..algorithms.deployed.flashmla.combine import combine_width
from ..algorithms.deployed.flashmla.scheduler import etap_num_sm_parts, etap_schedule
from ..resources import check_fits
from .launches import INT32_MAX, MAX_BATCH

__all__ = ["Race", "ETAP_RACES", "RequestExposure", "RaceExposure", "etap_race_exposure"]

ETAP_BLOCK_M = 16  # Flash_fwd_kernel_traits_mla<576, 16, 64, 8>: query rows a tile
LAST_HALF = 8  # the second n8 half of a thread's queries: stored last
FIRST_READ = (range(64), range(256, 320))  # d_v columns read first: each warpgroup's first m64 fragment
_PER_ROW = 120  # bytes of an exposed row's (s, h) pair, half the rows exposed


@dataclass(frozen=True)
class Race:
    """One missing synchronisation of the published kernel."""

    name: str
    where: str  # the upstream function and statement
    missing: str  # what the race-free build inserts


#: FlashMLA-ETAP 39e6160's two races, in the order the kernel reaches them.
ETAP_RACES = (
    Race("p-transpose", "compute_attn_1rowblock_splitkv_mla: cute::copy(rP, mtPsP), then NamedBarrier::arrive "
                        "(SReady) and the wgmmas that read P^T",
         "fence_view_async_shared() and a barrier of the 128 consumer threads after the P^T stores"),
    Race("epilogue", "store: cute::copy(..., taccOsOaccum) to sOaccumTranspose, then the transposing loop "
                     "sOaccum(j, i) = sOaccumTranspose(i, j)",
         "__syncthreads() between the write and the loop"),
)


@dataclass(frozen=True)
class RequestExposure:
    """One request: its exposed rows and how many tiles give the races a chance."""

    request: int
    rows: tuple[tuple[int, int], ...]  # (query position, head), exposed to both races
    total_rows: int
    splits: int  # the scheduler's splits of the request
    tiles: int  # splits x m-blocks: each one runs both races once


@dataclass(frozen=True)
class RaceExposure:
    """Per request of a launch, the output rows FlashMLA-ETAP's races can change between runs."""

    s_q: int
    heads: int
    requests: tuple[RequestExposure, ...]
    races: tuple[Race, ...] = ETAP_RACES

    def mask(self, *, first_read: bool = False) -> np.ndarray:
        """Bool (b, s_q, heads, 512): True where a race can change the output; `first_read`, only the columns
        read first after the racing stores (d_v 0-63 and 256-319)."""
        rows = np.arange(self.s_q * self.heads).reshape(self.s_q, self.heads) % ETAP_BLOCK_M >= LAST_HALF
        cols = np.zeros(D_V, bool)
        if first_read:
            for r in FIRST_READ:
                cols[r.start:r.stop] = True
        else:
            cols[:] = True
        one = rows[:, :, None] & cols[None, None, :]
        return np.broadcast_to(one, (len(self.requests), *one.shape)).copy()

    def format(self) -> str:
        n = self.s_q * self.heads
        lines = [f"FlashMLA-ETAP's races (the published build; the model is the race-free one), s_q {self.s_q}, "
                 f"{self.heads} heads: rows r = s * heads + h with r mod 16 in 8..15 are exposed, "
                 f"{sum(1 for r in range(n) if r % ETAP_BLOCK_M >= LAST_HALF)} of {n} a request; d_v 0-63 first"]
        for race in self.races:
            lines.append(f"  {race.name}: {race.where}; missing: {race.missing}")
        for e in self.requests:
            lines.append(f"  request {e.request}: {len(e.rows)} of {e.total_rows} rows exposed "
                         f"({_ranges(e.rows, self.s_q)}), {e.splits} split(s), {e.tiles} tile(s)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def runs(values: list[int]) -> str:
    """Sorted ints as runs, '8-15, 24-31'."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def _ranges(rows: tuple[tuple[int, int], ...], s_q: int) -> str:
    """(s, h) pairs as 's0 h8-15, 24-31; s1 h...'."""
    return "; ".join(f"s{s} h{runs([h for t, h in rows if t == s])}" for s in range(s_q)
                     if any(t == s for t, _ in rows))


def etap_race_exposure(seqlens: npt.ArrayLike, *, s_q: int = 1, heads: int = 128,
                       num_sms: int = 132) -> RaceExposure:
    """For a FlashMLA-ETAP launch (requests of `seqlens` tokens, `s_q` query rows of `heads` heads each), the
    rows of each request its two races can change from run to run, and the tiles that run them."""
    lens = np.asarray(seqlens)
    if lens.ndim != 1 or lens.size == 0 or lens.dtype.kind not in "iu" or (lens < 1).any() or lens.size > MAX_BATCH \
            or (lens > INT32_MAX).any():
        raise ValueError(f"seqlens: a list of 1 to {MAX_BATCH} request lengths in [1, {INT32_MAX}], got "
                         f"{seqlens!r:.80}")
    s_q = check_int(s_q, "s_q", lo=1)
    heads = check_int(heads, "heads", lo=1)
    num_sms = check_int(num_sms, "num_sms", lo=1, hi=INT32_MAX)
    parts = etap_num_sm_parts(s_q=s_q, heads_q=heads, num_sms=num_sms)
    if parts < 1:
        raise ValueError(f"num_sms: {num_sms} SMs leave no part for {s_q} x {heads} query rows")
    combine_width(parts, num_sms)  # the model's own bound: at most 160 parts
    check_fits(_PER_ROW * s_q * heads, what=f"heads, s_q: the race exposure of {s_q} x {heads} query rows",
               lower="them")
    _, cum = etap_schedule(lens, parts)
    m_blocks = -(-(s_q * heads) // ETAP_BLOCK_M)
    rows = tuple((r // heads, r % heads) for r in range(s_q * heads) if r % ETAP_BLOCK_M >= LAST_HALF)
    requests = tuple(RequestExposure(i, rows, s_q * heads, int(n), int(n) * m_blocks)
                     for i, n in enumerate(np.diff(cum)))
    return RaceExposure(s_q, heads, requests)

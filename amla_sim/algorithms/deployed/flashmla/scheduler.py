"""FlashMLA's split-KV scheduler, both generations, on the host: how each request's KV blocks of 64 tokens are
cut into splits over the SMs, so that a simulation cuts at the same tokens.

Upstream: deepseek-ai/FlashMLA 9241ae3 ``csrc/smxx/decode/get_decoding_sched_meta/`` (the dense and sparse
decodes: :func:`decoding_schedule`); pengcuo/FlashMLA-ETAP 39e6160 ``csrc/flash_fwd_mla_metadata.cu``, the older
``get_mla_metadata`` that FlashMLA's forks keep (:func:`etap_schedule`): the same payload walk, its ends written in
tokens.

``num_sm_parts = max(num_sms / h_k / cdiv(s_q h_q / h_k, 64), 1)`` parts share the total work, each request
costing its blocks plus a fixed overhead of 5; part i takes ``cdiv(total, num_sm_parts) + 5`` units, whole
requests while they fit and the rest of one request as a split. Checked against the schedules FlashMLA returned
on an H100 and an H200 (``tests/data/flashmla_decode.npz``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["SchedPart", "decoding_schedule", "num_sm_parts", "request_splits", "etap_num_sm_parts", "etap_schedule",
           "metadata_splits", "check_splits", "fixed_splits", "block_ranges"]

BLOCK_SIZE_N = 64
FIXED_OVERHEAD_BLOCKS = 5


@dataclass(frozen=True)
class SchedPart:
    """One SM part's work: requests begin..end (inclusive), blocks [begin_block of the first, end_block of the
    last), the first request's split index, and whether the first / last request is split."""

    begin_req: int
    end_req: int
    begin_block: int
    end_block: int
    begin_split: int
    first_split: bool
    last_split: bool

    def as_ints(self) -> list[int]:
        """The 8 int32 of FlashMLA's DecodingSchedMeta (the last is padding)."""
        return [self.begin_req, self.end_req, self.begin_block, self.end_block, self.begin_split,
                int(self.first_split), int(self.last_split), 0]


def num_sm_parts(*, s_q: int, heads_q: int, heads_k: int = 1, num_sms: int = 132) -> int:
    return max(num_sms // heads_k // -(-(s_q * heads_q // heads_k) // 64), 1)


def decoding_schedule(seqlens: npt.ArrayLike, parts: int) -> tuple[list[SchedPart], np.ndarray]:
    """The parts and the cumulative split counts (b + 1 ints, as FlashMLA's num_splits).

    The walk is bounded by the work: once every request is placed, the remaining parts are the same idle part."""
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"parts: expected an int >= 1, got {parts!r}")
    lens = [int(v) for v in np.asarray(seqlens).ravel()]
    b = len(lens)
    blocks = [max(n - 1, 0) // BLOCK_SIZE_N + 1 for n in lens]
    last_block = [max(n - 1, 0) // BLOCK_SIZE_N for n in lens]
    total = sum(blocks) + FIXED_OVERHEAD_BLOCKS * b
    payload = -(-total // parts) + FIXED_OVERHEAD_BLOCKS
    req, block, split, cum = 0, 0, 0, 0
    num_splits = [0] * (b + 1)
    out = []
    for _ in range(parts):
        # past the last request the kernel reads first_block_idx[b], which in its shared memory is last_block_idx[0]
        begin = (req, block + (0 if req < b else last_block[0]), split, block != 0)
        remain = payload
        while req < b:
            left = blocks[req] - block
            if remain >= left + FIXED_OVERHEAD_BLOCKS:
                cum += split + 1
                num_splits[req + 1] = cum
                remain -= left + FIXED_OVERHEAD_BLOCKS
                req, block, split = req + 1, 0, 0
            else:
                if remain - FIXED_OVERHEAD_BLOCKS > 0:
                    block += remain - FIXED_OVERHEAD_BLOCKS
                    split += 1
                    remain = 0
                break
        end_req = req if block > 0 else req - 1
        end_block = block if block > 0 else (0 if lens[req - 1] == 0 else last_block[req - 1] + 1)
        last_split = end_block != last_block[end_req] + 1 and lens[end_req] != 0
        first_split = begin[3]
        if begin[0] == end_req:
            first_split = last_split = first_split or last_split
        out.append(SchedPart(begin[0], end_req, begin[1], end_block, begin[2], first_split, last_split))
        if begin[0] >= b:  # idle: so is every part after it
            out += [out[-1]] * (parts - len(out))
            break
    return out, np.array(num_splits, np.int32)


def request_splits(seqlens: npt.ArrayLike, parts: int) -> list[list[tuple[int, int]]]:
    """Per request, its splits as token ranges [start, end), in split order."""
    sched, _ = decoding_schedule(seqlens, parts)
    lens = [int(v) for v in np.asarray(seqlens).ravel()]
    splits: list[list[tuple[int, int]]] = [[] for _ in lens]
    for p in sched:
        for r in range(p.begin_req, p.end_req + 1):
            if r >= len(lens):
                continue
            lo = p.begin_block if r == p.begin_req else 0
            hi = p.end_block if r == p.end_req else (max(lens[r] - 1, 0) // BLOCK_SIZE_N + 1)
            if hi > lo:
                splits[r].append((lo * BLOCK_SIZE_N, min(hi * BLOCK_SIZE_N, lens[r])))
    return splits


def check_splits(splits: object, lengths: list[int], max_splits: int) -> list[list[tuple[int, int]]]:
    """A caller's split plan in place of the scheduler's: per request, token ranges [start, end) in order, each
    starting on a block of 64, together covering the request (an empty request: the one range (0, 0)), at most
    `max_splits` of them (what the combine kernel holds). A ValueError names ``splits`` otherwise."""
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__len__") or len(splits) != len(lengths):
        raise ValueError(f"splits: expected one list of (start, end) token ranges per request ({len(lengths)}), "
                         f"got {splits!r:.80}")
    plan = []
    for i, (ranges, n) in enumerate(zip(splits, lengths)):
        try:
            got = [(int(a), int(b)) for a, b in ranges]
        except (TypeError, ValueError):
            raise ValueError(f"splits[{i}]: expected (start, end) pairs of ints, got {ranges!r:.80}") from None
        ends = [0] + [b for _, b in got]
        ok = bool(got) and all(a == e and a % BLOCK_SIZE_N == 0 and (b > a or (n == 0 and b == a == 0))
                               for (a, b), e in zip(got, ends)) and got[-1][1] == n
        if not ok:
            raise ValueError(f"splits[{i}]: the ranges must tile the request's {n} tokens in order from 0, each "
                             f"starting on a multiple of {BLOCK_SIZE_N}, got {got}")
        if len(got) > max_splits:
            raise ValueError(f"splits[{i}]: {len(got)} splits, more than the combine kernel holds ({max_splits})")
        plan.append(got)
    return plan


def block_ranges(plan: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """A plan's token ranges as the kernels walk them: block ranges [lo, hi) of 64 tokens."""
    return [[(lo // BLOCK_SIZE_N, -(-hi // BLOCK_SIZE_N)) for lo, hi in r] for r in plan]


def fixed_splits(lengths: npt.ArrayLike, tokens: int | None) -> list[list[tuple[int, int]]]:
    """A batch-invariant plan: every request cut into splits of `tokens` (a multiple of 64), whoever shares its
    launch; None: each request in one split."""
    lens = [int(v) for v in np.asarray(lengths).ravel()]
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer))
                               or tokens < BLOCK_SIZE_N or tokens % BLOCK_SIZE_N):
        raise ValueError(f"split_tokens: expected a multiple of {BLOCK_SIZE_N} tokens, got {tokens!r}")
    step = tokens or max(lens + [1])
    return [[(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)] for n in lens]


# --- the older generation: get_mla_metadata (FlashMLA before get_decoding_sched_meta; FlashMLA-ETAP 39e6160,
#     csrc/flash_fwd_mla_metadata.cu), a part's ends in tokens ---------------------------------------------------


def etap_num_sm_parts(*, s_q: int, heads_q: int, num_sms: int = 132) -> int:
    """``get_mla_metadata``'s part count: num_sms / h_k / cdiv(s_q h_q / h_k, 64), h_k = 1 (the kernel's m-block
    is 16 rows, but the metadata divides by 64)."""
    return num_sms // -(-(s_q * heads_q) // 64)


def etap_schedule(seqlens: npt.ArrayLike, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile-scheduler metadata as ``get_mla_metadata_kernel`` writes it: (parts, 5) int32, per part
    ``[begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx]`` (the kernel's rows have 8 ints, the
    last 3 never written), and the cumulative split counts (b + 1 int32). The payload walk is FlashMLA's
    (:func:`decoding_schedule`); this commit writes its ends in tokens, and the seqlen itself where
    a part ends with a request."""
    lens = [int(v) for v in np.asarray(seqlens).ravel()]
    sched, num_splits = decoding_schedule(lens, parts)
    b = len(lens)
    meta = np.zeros((parts, 5), np.int32)
    for i, p in enumerate(sched):
        begin_tokens = 0 if p.begin_req >= b else p.begin_block * BLOCK_SIZE_N
        end_tokens = min(p.end_block * BLOCK_SIZE_N, lens[p.end_req])
        meta[i] = (p.begin_req, begin_tokens, p.end_req, end_tokens, p.begin_split)
    return meta, num_splits


def metadata_splits(meta: np.ndarray, lens: list[int]) -> list[list[tuple[int, int]]]:
    """Per request, its splits as block ranges [n_block_min, n_block_max), read from the metadata as the kernel
    reads it, in split order."""
    out: list[list[tuple[int, int]]] = [[] for _ in lens]
    for begin_idx, begin_seqlen, end_idx, end_seqlen, *_ in meta.tolist():
        for r in range(begin_idx, min(end_idx, len(lens) - 1) + 1):
            lo = begin_seqlen // BLOCK_SIZE_N if r == begin_idx else 0
            hi = -(-end_seqlen // BLOCK_SIZE_N) if r == end_idx else -(-lens[r] // BLOCK_SIZE_N)
            out[r].append((lo, hi))
    return out

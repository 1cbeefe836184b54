"""The launches a request can share: who its batchmates are, where it sits, how many SMs and query rows there
are. A kernel's scheduler sees only these, so they are all that can change a request's bits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._validate import check_int

__all__ = ["Launch", "variations", "MAX_BATCH", "MAX_REQUESTS", "INT32_MAX"]

#: The most requests a launch of the study holds: more than any serving engine batches in one decode step (the
#: schedulers' host walks are Python loops over the batch).
MAX_BATCH = 65536
#: The most requests a study's launches hold together.
MAX_REQUESTS = 1 << 20
#: Lengths and SM counts are int32 in every modelled kernel's API.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Launch:
    """One launch holding the request under study.

    lengths: every request's length as the scheduler counts it (tokens; topk slots for a sparse decode), the
    request's own at `position`. s_q: query rows per request (MTP or speculative rows; the request's row of
    interest is its last). num_sms: the SMs the scheduler divides the work among. num_kv_splits: the split count
    handed to a kernel whose API takes one (SGLang's decode); None: the serving framework's own choice."""

    label: str
    lengths: tuple[int, ...]
    position: int = 0
    s_q: int = 1
    num_sms: int = 132
    num_kv_splits: int | None = None

    def __post_init__(self) -> None:
        lengths = self.lengths
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (Sequence, np.ndarray)) or not len(lengths):
            raise ValueError(f"lengths: a launch holds at least the request's own length, got {lengths!r:.80} "
                             f"({self.label!r})")
        if len(lengths) > MAX_BATCH:
            raise ValueError(f"lengths: {len(lengths)} requests in a launch, more than the study takes "
                             f"({MAX_BATCH}) ({self.label!r})")
        object.__setattr__(self, "lengths", tuple(check_int(n, "lengths", lo=1, hi=INT32_MAX) for n in lengths))
        check_int(self.position, "position", lo=0, hi=len(self.lengths) - 1)
        check_int(self.s_q, "s_q", lo=1)
        check_int(self.num_sms, "num_sms", lo=1, hi=INT32_MAX)
        if self.num_kv_splits is not None:
            check_int(self.num_kv_splits, "num_kv_splits", lo=1)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """The request's own length."""
        return self.lengths[self.position]

    def to_dict(self) -> dict:
        return {"label": self.label, "lengths": list(self.lengths), "position": self.position, "s_q": self.s_q,
                "num_sms": self.num_sms, "num_kv_splits": self.num_kv_splits}


def variations(length: int, *, batchmates: Sequence[int] = (1, 3, 7), mixed: int | None = 3,
               num_sms: Sequence[int] = (132,), s_q: Sequence[int] = (1,),
               num_kv_splits: Sequence[int] = (), seed: int = 0) -> list[Launch]:
    """The request alone, then one change at a time: `batchmates` more requests of its own length; `mixed`
    batchmates of lengths drawn between 64 and twice its length (seeded), with the request first and then last;
    each other SM count of `num_sms` and each other `s_q`; each split count of `num_kv_splits`. The first of
    `num_sms` and `s_q` is the reference's. Every argument is checked before a launch is built."""
    check_int(length, "length", lo=1, hi=INT32_MAX)
    for name, values in (("batchmates", batchmates), ("num_sms", num_sms), ("s_q", s_q),
                         ("num_kv_splits", num_kv_splits)):
        if not isinstance(values, (Sequence, np.ndarray)) or isinstance(values, (str, bytes)):
            raise TypeError(f"{name}: expected a sequence of ints, got {values!r:.80}")
        if len(values) > MAX_REQUESTS:
            raise ValueError(f"{name}: {len(values)} values, a launch each: more than the study takes")
    batchmates = [check_int(n, "batchmates", lo=1, hi=MAX_BATCH - 1) for n in batchmates]
    if not len(num_sms) or not len(s_q):
        raise ValueError("num_sms, s_q: each needs at least one value (the first is the reference's)")
    num_sms = [check_int(n, "num_sms", lo=1, hi=INT32_MAX) for n in num_sms]
    s_q = [check_int(n, "s_q", lo=1) for n in s_q]
    num_kv_splits = [check_int(n, "num_kv_splits", lo=1) for n in num_kv_splits]
    if mixed is not None:
        check_int(mixed, "mixed", lo=0, hi=MAX_BATCH - 1)
    check_int(seed, "seed", lo=0)
    total = 1 + sum(n + 1 for n in batchmates) + 2 * ((mixed or 0) + 1) + len(num_sms) + len(s_q) + len(num_kv_splits)
    if total > MAX_REQUESTS:
        raise ValueError(f"batchmates: the launches would hold {total} requests in all, more than the study takes "
                         f"({MAX_REQUESTS})")
    sms0, sq0 = num_sms[0], s_q[0]
    base = {"num_sms": sms0, "s_q": sq0}
    out = [Launch("alone", (length,), **base)]
    out += [Launch(f"with {n} batchmate{'s' * (n > 1)} of its length", (length,) * (n + 1), **base)
            for n in batchmates]
    if mixed:
        rng = np.random.default_rng([seed, 41])
        lo, hi = sorted((64, 2 * length))
        mates = tuple(int(v) for v in rng.integers(lo, min(hi, INT32_MAX) + 1, mixed))
        shown = ", ".join(map(str, mates[:8])) + (f", ... ({mixed} in all)" if mixed > 8 else "")
        out.append(Launch(f"first of {mixed + 1}, batchmates {shown} long", (length,) + mates, **base))
        out.append(Launch(f"last of {mixed + 1}, the same batchmates", mates + (length,), position=mixed, **base))
    out += [Launch(f"alone on {n} SMs", (length,), num_sms=n, s_q=sq0) for n in num_sms[1:]]
    out += [Launch(f"alone with s_q = {n}", (length,), num_sms=sms0, s_q=n) for n in s_q[1:]]
    out += [Launch(f"alone, num_kv_splits = {n}", (length,), num_kv_splits=n, **base) for n in num_kv_splits]
    return out

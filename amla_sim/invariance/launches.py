"""The launches a request can share: who its batchmates are, where it sits, how many SMs and query rows there
are. A kernel's scheduler sees only these, so they are all that can change a request's bits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._validate import check_int

__all__ = ["Launch", "variations"]


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
        if not self.lengths:
            raise ValueError(f"lengths: a launch holds at least the request itself ({self.label})")
        for n in self.lengths:
            check_int(n, "lengths", lo=1)
        check_int(self.position, "position", lo=0, hi=len(self.lengths) - 1)
        check_int(self.s_q, "s_q", lo=1)
        check_int(self.num_sms, "num_sms", lo=1)
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
    batchmates of lengths drawn from 64 .. 2 `length` (seeded), with the request first and then last; each other SM
    count of `num_sms` and each other `s_q`; each split count of `num_kv_splits`. The first of `num_sms` and
    `s_q` is the reference's."""
    check_int(length, "length", lo=1)
    for n in batchmates:
        check_int(n, "batchmates", lo=1)
    if not num_sms or not s_q:
        raise ValueError("num_sms, s_q: each needs at least one value (the first is the reference's)")
    sms0, sq0 = check_int(num_sms[0], "num_sms", lo=1), check_int(s_q[0], "s_q", lo=1)
    base = {"num_sms": sms0, "s_q": sq0}
    out = [Launch("alone", (length,), **base)]
    out += [Launch(f"with {n} batchmate{'s' * (n > 1)} of its length", (length,) * (n + 1), **base)
            for n in batchmates]
    if mixed:
        check_int(mixed, "mixed", lo=1)
        rng = np.random.default_rng([check_int(seed, "seed", lo=0), 41])
        mates = tuple(int(v) for v in rng.integers(64, 2 * length + 1, mixed))
        out.append(Launch(f"first of {mixed + 1}, batchmates {', '.join(map(str, mates))} long", (length,) + mates,
                          **base))
        out.append(Launch(f"last of {mixed + 1}, the same batchmates", mates + (length,), position=mixed, **base))
    out += [Launch(f"alone on {n} SMs", (length,), num_sms=check_int(n, "num_sms", lo=1), s_q=sq0)
            for n in num_sms[1:]]
    out += [Launch(f"alone with s_q = {n}", (length,), num_sms=sms0, s_q=check_int(n, "s_q", lo=1))
            for n in s_q[1:]]
    out += [Launch(f"alone, num_kv_splits = {n}", (length,), num_kv_splits=check_int(n, "num_kv_splits", lo=1),
                   **base) for n in num_kv_splits]
    return out

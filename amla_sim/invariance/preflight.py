"""What the invariance study and the kernel diff check before they draw a request or build a plan: every launch
against its kernel's bounds (:meth:`~amla_sim.invariance.kernel.BatchKernel.bounds`), the what-if's split size,
and the memory the run will need (:mod:`amla_sim.resources`). Each error names the argument to change, and the
launch where one is at fault.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..resources import address_space_bytes, available_bytes, check_fits, query_bytes, run_bytes, split_bytes
from .kernel import BatchKernel
from .launches import MAX_REQUESTS, Launch

__all__ = ["check_launches", "check_what_if", "check_memory", "request_bytes"]


def check_launches(k: BatchKernel, launches: Sequence[Launch], *, length: int, heads: int,
                   options: Mapping[str, Any]) -> tuple[int, int]:
    """Every launch of a study of `k` (a request of `length` and `heads`), before a plan is built: the most
    splits the request gets in one of them, and the splits of every plan together."""
    if not launches:
        raise ValueError("launches: at least the reference launch")
    for L in launches:
        if not isinstance(L, Launch):
            raise TypeError(f"launches: expected Launch objects, got {type(L).__name__} {L!r:.60}")
    requests = sum(L.batch for L in launches)
    if requests > MAX_REQUESTS:
        raise ValueError(f"launches: {requests} requests in all, more than the study takes ({MAX_REQUESTS})")
    most = total = 0
    for L in launches:
        if L.length != length:
            raise ValueError(f"launches: {L.label!r} gives the request {L.length} tokens, it has {length}")
        if not k.lengths_vary and set(L.lengths) != {length}:
            raise ValueError(f"launches: every request of a {k.name} launch is {length} slots long "
                             f"({L.label!r} has {sorted(set(L.lengths))[:8]})")
        if L.num_kv_splits is not None and not k.takes_num_kv_splits:
            raise ValueError(f"num_kv_splits: {k.name}'s API takes no split count (launch {L.label!r})")
        if L.s_q > 1 and not k.takes_s_q:
            raise ValueError(f"s_q: {k.name} takes one query a request (launch {L.label!r})")
        try:
            one, every = k.bounds(L, heads=heads, options=options)
        except ValueError as e:
            raise ValueError(f"{e} (launch {L.label!r})") from None
        most, total = max(most, one), total + every
    return most, total


def check_what_if(k: BatchKernel, launches: Sequence[Launch], *, length: int, heads: int,
                  split_tokens: int | None) -> tuple[int, int]:
    """The batch-invariant what-if (splits of `split_tokens`, None: one a request) in `launches`: the splits it
    runs the request in, and those of its plans together."""
    k.check_split_tokens(split_tokens)
    if split_tokens is None:
        return 1, sum(L.batch for L in launches)
    n = -(-length // split_tokens)
    ref = launches[0]
    cap = k.max_splits(ref, heads=heads)
    if n > cap:
        raise ValueError(f"split_tokens: splits of {split_tokens} tokens cut the request's {length} into {n}, more "
                         f"than {k.name} runs a request in ({cap}, launch {ref.label!r})")
    return n, sum(L.batch * -(-max(L.lengths) // split_tokens) for L in launches)


def request_bytes(*, heads: int, s_q: int, tokens: int, splits: int) -> int:
    """Peak bytes of one model run of one request (its inputs drawn, `splits` splits)."""
    return run_bytes(batch=1, sq=s_q, heads=heads, context=tokens, mufu_tables=True) + \
        query_bytes(batch=1, sq=s_q, heads=heads) + split_bytes(rows=s_q * heads, splits=splits)


def check_memory(terms: Sequence[tuple[str, int]], *, what: str, limit: int | None = None) -> None:
    """Refuse a run whose terms (the arguments that set a term, its bytes) need more memory than `limit` (None:
    what this machine has); the message opens with the arguments of the terms that weigh most."""
    need = sum(b for _, b in terms)
    heavy = [names for names, b in sorted(terms, key=lambda t: -t[1]) if b >= need / 10]
    args = list(dict.fromkeys(a.strip() for names in heavy for a in names.split(",")))
    if limit is None:  # an address-space limit (ulimit -v) bounds what this process may allocate, too
        left = address_space_bytes()
        limit = available_bytes() if left is None else min(available_bytes(), left)
    check_fits(need, what=f"{', '.join(args)}: {what}", lower="them", limit=limit)

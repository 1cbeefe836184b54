"""AMLA's Preload pipeline (AMLA paper Section 4.1, Theorem 4.1, Appendix B) as code.

A stage of n CV pairs runs the chain C_1 -> V_1 -> C_2 -> ... -> C_n -> V_n once per iteration, on one Cube unit
and one Vector unit. The Steady Loop repeats a *Cycle* that holds one instance of every stage, each from an
iteration that lags by d_p cycles; an edge X_p -> X_{p+1} of the chain is *internal* when both ends are in the
same Cycle (d_{p+1} = d_p) and external otherwise (d_{p+1} = d_p + 1, resolved by the Preload). With s internal
chains the Preload count, the number of C_1 run before the loop, is (2n - 1) - s (Lemma B.1).

The construction of Theorem B.1: in the Cube-dominated case (sum V <= sum C) put a_i = V_i - C_{i+1} (cyclic),
F(l) = a_1 + ... + a_l, and k the first index where F is smallest. The Cycle ends with cube C_{k+1}; every
C_i -> V_i except C_{k+1} -> V_{k+1} is internal (n - 1 chains), the Vector unit starts with the external
V_{k+1} and runs the others as soon as their cube ends, and the minimality of F(k) is exactly the condition that
they all finish within the Cycle (Eq. 20). The Vector-dominated case is the same construction in reversed time.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Cycle", "Timeline", "construct_cycle", "simulate", "best_internal_chains"]

def _durations(values: Sequence[float], argname: str) -> list[float]:
    try:
        vals = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{argname}: expected a sequence of numbers, got {values!r}") from None
    if not vals:
        raise ValueError(f"{argname}: expected at least one stage duration")
    if any(not (v >= 0) or v == float("inf") for v in vals):
        raise ValueError(f"{argname}: durations must be finite and non-negative, got {vals}")
    return vals


def _check(cube: Sequence[float], vector: Sequence[float]) -> tuple[list[float], list[float]]:
    c, v = _durations(cube, "cube"), _durations(vector, "vector")
    if len(c) != len(v):
        raise ValueError(f"cube and vector: one duration per CV pair, got {len(c)} and {len(v)}")
    if sum(c) + sum(v) == 0:
        raise ValueError("cube and vector: every duration is zero")
    return c, v


@dataclass(frozen=True)
class Cycle:
    """One Steady-Loop Cycle: the unit orders (0-based pair indices), the internal C_i -> V_i chains."""

    n: int
    case: Literal["cube-dominated", "vector-dominated"]
    cube_order: tuple[int, ...]
    vector_order: tuple[int, ...]
    internal: frozenset[tuple[str, int]]  # ("CV", i): C_i -> V_i internal; ("VC", i): V_i -> C_{i+1} internal
    k: int  # the minimising index of the partial sums (1-based, as in the paper)

    @property
    def internal_chains(self) -> int:
        return len(self.internal)

    @property
    def preload_count(self) -> int:
        return (2 * self.n - 1) - self.internal_chains

    def lags(self) -> list[int]:
        """d_p for the chain C_1, V_1, C_2, ..., V_n: each external edge adds one cycle of lag."""
        d = [0]
        for p in range(1, 2 * self.n):
            i = (p - 1) // 2
            edge = ("CV", i) if p % 2 == 1 else ("VC", i)
            d.append(d[-1] + (0 if edge in self.internal else 1))
        return d

    def describe(self) -> str:
        cubes = " ".join(f"C{i + 1}" for i in self.cube_order)
        vecs = " ".join(f"V{i + 1}" for i in self.vector_order)
        chains = ", ".join(
            f"C{i + 1}->V{i + 1}" if kind == "CV" else f"V{i + 1}->C{i + 2}" for kind, i in sorted(self.internal)
        )
        return f"Cube: {cubes} | Vector: {vecs} | internal: {chains or 'none'}"


def _rotation(dominant: list[float], dependent_next: list[float]) -> int:
    """The paper's k: the first index (1-based) minimising F(l) = sum_{i<=l} (dependent_i - dominant_{i+1})."""
    n = len(dominant)
    best, best_k, f = float("inf"), 1, 0.0
    for i in range(n):
        f += dependent_next[i] - dominant[(i + 1) % n]
        if f < best:
            best, best_k = f, i + 1
    return best_k


def construct_cycle(cube: Sequence[float], vector: Sequence[float]) -> Cycle:
    """The Cycle of Theorem B.1 (and its time-reversed twin for sum V > sum C): n - 1 internal chains."""
    c, v = _check(cube, vector)
    n = len(c)
    if sum(v) <= sum(c):
        k = _rotation(c, v)
        last = k % n  # 0-based index of C_{k+1}, the Cycle's last cube
        cube_order = tuple((last + 1 + j) % n for j in range(n))
        vector_order = (last,) + tuple((last + 1 + j) % n for j in range(n - 1))
        internal = frozenset(("CV", i) for i in range(n) if i != last)
        return Cycle(n, "cube-dominated", cube_order, vector_order, internal, k)
    # Vector-dominated: the Vector unit runs back to back from V_f; each internal C_i must end before V_i
    # starts, i.e. the partial sums of b_i = C_{i+1} - V_i from f on stay <= 0: start after the largest prefix.
    b = [c[(i + 1) % n] - v[i] for i in range(n)]
    g, best, first = 0.0, 0.0, 0
    for kk in range(1, n):
        g += b[kk - 1]
        if g > best:
            best, first = g, kk
    vector_order = tuple((first + j) % n for j in range(n))
    cube_order = tuple((first + 1 + j) % n for j in range(n - 1)) + (first,)
    internal = frozenset(("CV", i) for i in range(n) if i != first)
    return Cycle(n, "vector-dominated", cube_order, vector_order, internal, first + 1)


@dataclass
class Timeline:
    """A simulated run: every stage instance as (unit, label, iteration, cycle, start, end), and summaries."""

    intervals: list[tuple[str, str, int, int, float, float]] = field(default_factory=list)
    preload_cycles: int = 0
    iterations: int = 0
    total_time: float = 0.0
    cube_busy: float = 0.0
    steady_cube_idle: float = 0.0
    steady_vector_idle: float = 0.0

    @property
    def cube_utilization(self) -> float:
        return self.cube_busy / self.total_time if self.total_time else 0.0

    def steady(self, unit: str) -> list[tuple[float, float]]:
        """(start, end) of `unit`'s instances in the Steady Loop's Cycles."""
        return sorted((s, e) for u, _, _, cyc, s, e in self.intervals
                      if u == unit and self.preload_cycles <= cyc < self.iterations)


def simulate(cube: Sequence[float], vector: Sequence[float], cycle: Cycle, *, iterations: int = 8) -> Timeline:
    """Discrete-event run of `iterations` iterations on one Cube and one Vector unit.

    Stage X_p of iteration t belongs to Cycle t + d_p. Each unit runs its instances ordered by (Cycle, position
    in the Cycle's unit order); an instance starts when its unit is free and its chain predecessor has ended.
    Cycles below the largest lag D are the Preload, which completes before the Steady Loop (Cycles D to
    iterations - 1) starts; Cycles from `iterations` on drain the pipeline.
    """
    c, v = _check(cube, vector)
    n = cycle.n
    if n != len(c):
        raise ValueError(f"cycle: built for {n} pairs, durations have {len(c)}")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations: expected a positive int, got {iterations!r}")
    if sum(c) + sum(v) > sys.float_info.max / iterations:  # a bound of the total time
        raise ValueError(f"cube and vector: {iterations} iterations of these durations overflow a float")
    lags = cycle.lags()
    queues: dict[str, list[tuple[int, int, int, int]]] = {"cube": [], "vector": []}  # (cycle, pos, t, p)
    position = {"cube": {i: k for k, i in enumerate(cycle.cube_order)},
                "vector": {i: k for k, i in enumerate(cycle.vector_order)}}
    for t in range(iterations):
        for p in range(2 * n):
            unit = "cube" if p % 2 == 0 else "vector"
            queues[unit].append((t + lags[p], position[unit][p // 2], t, p))
    for q in queues.values():
        q.sort()
    end: dict[tuple[int, int], float] = {}
    free = {"cube": 0.0, "vector": 0.0}
    tl = Timeline(preload_cycles=lags[-1], iterations=iterations)
    D = lags[-1]
    # Two phases (Fig. 5): the Preload runs first; the Steady Loop (and the drain after it) starts once the
    # Preload has resolved its dependencies.
    for phase in (lambda cyc: cyc < D, lambda cyc: cyc >= D):
        pending = {u: deque(j for j in q if phase(j[0])) for u, q in queues.items()}
        _list_schedule(pending, c, v, end, free, tl)
        barrier = max(free.values())
        free = {"cube": barrier, "vector": barrier}
    tl.total_time = max(e for *_, e in tl.intervals)
    for unit in ("cube", "vector"):
        spans = [(s, e) for s, e in tl.steady(unit) if e > s]
        idle = sum(max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:]))
        setattr(tl, f"steady_{unit}_idle", idle)
    return tl


def _list_schedule(queues: dict, c: list[float], v: list[float], end: dict, free: dict, tl: Timeline) -> None:
    """Run each unit's queue (a deque) in order; an instance starts when its unit is free and its predecessor has
    ended. Linear in the number of instances."""
    while queues["cube"] or queues["vector"]:
        best = None
        for unit in ("cube", "vector"):
            if not queues[unit]:
                continue
            _, _, t, p = queues[unit][0]
            if p > 0 and (t, p - 1) not in end:
                continue
            start = max(free[unit], end.get((t, p - 1), 0.0))
            if best is None or start < best[0]:
                best = (start, unit)
        if best is None:
            raise RuntimeError("cycle: the unit orders deadlock on the chain's dependencies")
        start, unit = best
        cyc, _, t, p = queues[unit].popleft()
        dur = (c if unit == "cube" else v)[p // 2]
        end[(t, p)] = free[unit] = start + dur
        tl.intervals.append((unit, f"{'CV'[p % 2]}{p // 2 + 1}", t, cyc, start, start + dur))
        tl.cube_busy += dur if unit == "cube" else 0.0


def _feasible(c: list[float], v: list[float], cube_order: tuple[int, ...], vector_order: tuple[int, ...],
              internal: frozenset[tuple[str, int]]) -> bool:
    """Does a Cycle of length sum(C) (Cube-bound, cube stages back to back) fit every vector stage inside it?"""
    T = sum(c)
    c_start, t = {}, 0.0
    for i in cube_order:
        c_start[i] = t
        t += c[i]
    tv = 0.0
    v_end = {}
    for i in vector_order:
        release = c_start[i] + c[i] if ("CV", i) in internal else 0.0
        tv = max(tv, release) + v[i]
        v_end[i] = tv
    if tv > T + 1e-12:
        return False
    n = len(c)
    return all(v_end[i] <= c_start[i + 1] + 1e-12 for kind, i in internal if kind == "VC" and i + 1 < n)


def best_internal_chains(cube: Sequence[float], vector: Sequence[float]) -> int:
    """Exhaustive search (small n) over every Cycle ordering and every set of internal edges: the most internal
    chains any Cube-bound Cycle achieves. Lemma B.2: never more than n - 1 for the durations of Eq. 16."""
    c, v = _check(cube, vector)
    n = len(c)
    if n > 5:
        raise ValueError(f"cube: the exhaustive search is for n <= 5 pairs, got {n}")
    edges = [("CV", i) for i in range(n)] + [("VC", i) for i in range(n - 1)]
    best = -1
    for co in itertools.permutations(range(n)):
        for vo in itertools.permutations(range(n)):
            for r in range(len(edges), best, -1):
                if any(_feasible(c, v, co, vo, frozenset(s)) for s in itertools.combinations(edges, r)):
                    best = max(best, r)
                    break
    return best

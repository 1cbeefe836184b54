"""Resource bounds: what a simulation will need, and what this machine has, checked before any work starts.

The estimate of :func:`run_bytes` is calibrated on measured peaks (``tests/test_resources.py`` holds it above the
tracemalloc peak of the whole ``amla-sim run`` path, and within 3x of it): about 20 MB whatever the size, then
drawing the inputs in float64 and rounding them (in cache-sized pieces) about 7 to 12 bytes per element of the
latent cache, the golden's FP64 scores up to 32 bytes per score, and the sm90 machines' MUFU tables a fixed 0.3 GB once loaded. The pipeline simulation
keeps every interval it schedules: about 600 bytes each (368 MB measured for 100,000 cycles of 3 pairs).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["run_bytes", "pipeline_bytes", "split_bytes", "plan_bytes", "query_bytes", "available_bytes",
           "address_space_bytes", "check_fits", "ResourceError"]

_PER_RUN = 24 << 20  # bytes of a run whatever its size (20-24 MB measured at 256 tokens)
_PER_CACHE_ELEMENT = 16  # bytes per element of kv (b * context * d_k): float64 draw, rounding, widened copies
_PER_SCORE = 32  # bytes per score (b * s_q * heads * context): the golden's FP64 S and exp(S)
_BASE = 64 << 20
_MUFU_TABLES = 320 << 20
_PER_ROW_SPLIT = 20_000  # bytes per query row and split of a deployed model's run: partial outputs and LSEs in
# float64 and the copies made of them (18 KB measured: vLLM's Triton decode, 128 heads in 4,096 splits)
_PER_PLAN_SPLIT = 100  # bytes per split of a split plan held on the host: a pair of ints in a list, or int64 pairs


class ResourceError(ValueError):
    """A request that will not fit in this machine's memory."""


def run_bytes(*, batch: int, sq: int, heads: int, context: int, d_k: int = 576, mufu_tables: bool = False) -> int:
    """Peak bytes of one simulated decode step with its golden reference (the ``amla-sim run`` path)."""
    cache = batch * context * d_k
    scores = batch * sq * heads * context
    return _BASE + _PER_RUN + _PER_CACHE_ELEMENT * cache + _PER_SCORE * scores + (_MUFU_TABLES if mufu_tables else 0)


def pipeline_bytes(*, pairs: int, cycles: int) -> int:
    """Peak bytes of ``amla-sim pipeline``: two stage instances per pair and cycle, about 600 bytes each."""
    return _BASE + 600 * 2 * pairs * cycles


def available_bytes() -> int:
    """Memory this process may use: MemAvailable, bounded by a cgroup limit where one is set."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            candidates.append(int(text))
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - no sysconf
            return 1 << 62
    return min(candidates)


def check_fits(need: int, *, what: str, lower: str, limit: int | None = None) -> None:
    """Raise :class:`ResourceError` when `need` bytes exceed `limit` (default: :func:`available_bytes`).

    lower: the arguments that lower the need, named in the message.
    """
    have = available_bytes() if limit is None else limit
    if need > have:
        raise ResourceError(f"{what} needs about {need / 2**30:.1f} GiB of memory and {have / 2**30:.1f} GiB is "
                            f"available; lower {lower} (or set --max-memory GIB if the estimate is wrong for you)")


def split_bytes(*, rows: int, splits: int) -> int:
    """Bytes a deployed model's run holds for `rows` query rows (heads x s_q) cut into `splits` splits."""
    return _PER_ROW_SPLIT * rows * splits


def plan_bytes(splits: int) -> int:
    """Bytes of split plans holding `splits` splits in all (the invariance study's launches)."""
    return _PER_PLAN_SPLIT * splits


def query_bytes(*, batch: int, sq: int, heads: int, d_k: int = 576) -> int:
    """Bytes of drawing the queries (b * s_q * heads * d_k elements) as the inputs are drawn: the float64 draw,
    its rounding and the copies, as for the cache. :func:`run_bytes` leaves them out (a cache outweighs them
    unless the heads are many)."""
    return _PER_CACHE_ELEMENT * batch * sq * heads * d_k


def address_space_bytes() -> int | None:
    """What this process may still map under its address-space limit (``ulimit -v``, ``prlimit --as``): the soft
    limit less what it maps now; None where no limit is set."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):  # pragma: no cover - no resource module (Windows)
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(soft - int(line.split()[1]) * 1024, 0)
    except (OSError, ValueError, IndexError):
        pass
    return soft

"""Where a sweep's tasks run: a process pool on this machine, a Dask cluster started here, or an existing one.

Every task is a pure function of its arguments (its inputs come from a seed it carries), so the results do not
depend on the scheduler, the number of workers, their order or retries; only the process that owns the result
store writes to it, as each result arrives.

- ``local`` (default): ``jobs`` fresh processes on this machine (one BLAS thread each), or this process itself.
- ``dask``: a ``dask.distributed.LocalCluster`` of ``jobs`` single-threaded worker processes, started here, its
  scheduler and dashboard bound to 127.0.0.1 (for a dashboard others can reach, start a cluster and pass its
  address).
- ``tcp://HOST:PORT`` (or ``tls://``): an existing Dask scheduler, as ``dask scheduler`` / ``dask worker``,
  dask-jobqueue or dask-kubernetes start it; its workers need amla-sim installed (same version).

Dask (the ``[distributed]`` extra) retries the tasks of a worker that dies; a result is yielded once.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any

__all__ = ["SchedulerError", "check_scheduler", "check_run", "execute", "cap_jobs", "die_with_parent", "progress_bar"]

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
_CONNECT_TIMEOUT = "10s"


class SchedulerError(RuntimeError):
    """The scheduler cannot be used (Dask missing, an address that does not answer)."""


def check_scheduler(scheduler: str) -> str:
    """Validate a ``--scheduler`` value (the name, not whether it answers)."""
    if not isinstance(scheduler, str) or not scheduler:
        raise ValueError(f"scheduler: expected 'local', 'dask' or an address like tcp://HOST:PORT, got {scheduler!r}")
    if scheduler in ("local", "dask"):
        return scheduler
    proto, sep, rest = scheduler.partition("://")
    if not sep or proto not in ("tcp", "tls", "inproc", "ucx") or not rest:
        raise ValueError(f"scheduler: expected 'local', 'dask' or an address like tcp://HOST:PORT, got {scheduler!r}")
    return scheduler


def check_run(scheduler: str, jobs: int, engine: str) -> int:
    """Validate a sweep's scheduler, job count and engine before any work; the jobs to use (capped at this
    machine's CPUs for the local processes and for a Dask LocalCluster's workers)."""
    from .._validate import check_positive_int
    from ..engine import use_engine

    check_scheduler(scheduler)
    check_positive_int(jobs, "jobs")
    with use_engine(engine):  # refuses an unknown engine, or numba when it is not installed
        pass
    return cap_jobs(jobs) if scheduler in ("local", "dask") else jobs


def cap_jobs(jobs: int) -> int:
    """`jobs`, capped at the CPUs this process may use (with a warning): more processes only share them."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    if jobs > cpus:
        warnings.warn(f"jobs: {jobs} asked, {cpus} CPU(s) available; using {cpus}", stacklevel=3)
        return cpus
    return jobs


@contextmanager
def _one_thread_each() -> Iterator[None]:
    """Worker processes started inside inherit one BLAS (and numba) thread each: J processes sharing the cores,
    not J x cores threads."""
    saved = {k: os.environ.get(k) for k in THREAD_VARS}
    os.environ.update({k: "1" for k in THREAD_VARS})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute(fn: Callable[[Any], Any], tasks: Sequence[Any], *, scheduler: str = "local", jobs: int = 1,
            log: Callable[[str], None] | None = None) -> Iterator[Any]:
    """Yield fn(task) for every task, in the order they finish."""
    check_scheduler(scheduler)
    if not tasks:
        return iter(())
    if scheduler == "local":
        return _local(fn, tasks, jobs)
    return _dask(fn, tasks, scheduler, jobs, log or (lambda s: print(s, file=sys.stderr)))


def _local(fn: Callable[[Any], Any], tasks: Sequence[Any], jobs: int) -> Iterator[Any]:
    if jobs == 1 or len(tasks) <= 1:
        for t in tasks:
            yield fn(t)
        return
    with _one_thread_each(), ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=die_with_parent) as ex:
        futures = [ex.submit(fn, t) for t in tasks]
        try:
            for f in as_completed(futures):
                yield f.result()
        finally:
            for f in futures:
                f.cancel()


def _distributed():
    try:
        import distributed
    except ImportError:
        raise SchedulerError('scheduler: Dask is not installed: pip install "amla-sim[distributed]"') from None
    return distributed


@contextmanager
def dask_client(scheduler: str, jobs: int, log: Callable[[str], None]) -> Iterator[Any]:
    """A client of a LocalCluster of `jobs` workers started here (``dask``), or of the cluster at an address."""
    distributed = _distributed()
    if scheduler == "dask":
        with _one_thread_each(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LocalCluster's notes on ports and memory limits
            cluster = distributed.LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True,
                                               host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                               silence_logs=40)  # this machine only: start your own to share it
        try:
            with distributed.Client(cluster) as client:
                log(f"dask: {jobs} local worker(s), dashboard {client.dashboard_link}")
                yield client
        finally:
            cluster.close()
        return
    try:
        client = distributed.Client(scheduler, timeout=_CONNECT_TIMEOUT)
    except (OSError, TimeoutError) as e:
        raise SchedulerError(f"scheduler: no Dask scheduler answers at {scheduler} ({e})") from None
    try:
        workers = len(client.scheduler_info().get("workers", {}))
        log(f"dask: {scheduler}, {workers} worker(s), dashboard {client.dashboard_link}")
        yield client
    finally:
        client.close()


def _dask(fn: Callable[[Any], Any], tasks: Sequence[Any], scheduler: str, jobs: int,
          log: Callable[[str], None]) -> Iterator[Any]:
    distributed = _distributed()
    with dask_client(scheduler, jobs, log) as client:
        futures = client.map(fn, list(tasks), pure=False, retries=2)
        try:
            for f in distributed.as_completed(futures):
                yield f.result()
        finally:
            client.cancel(futures)


def die_with_parent() -> None:
    """Worker initializer: exit as soon as the parent process ends (even by SIGKILL), instead of waiting on a pipe
    that no one will write to."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar of `total` samples when enabled and tqdm is installed, else one that does nothing."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="sample")

import os
import sys


def _one_core_a_worker() -> None:
    """Under pytest-xdist, each worker's thread pools (BLAS, OpenMP, numba's parallel loops) get the cores divided
    among the workers, before numpy or numba is imported: two workers each spinning up threads for both cores
    made the same tests about 1.8x slower on 2 cores. Variables the caller set are kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            os.environ.setdefault(var, share)


_one_core_a_worker()

from hypothesis import HealthCheck, settings  # noqa: E402

# The test command draws the same examples every run and keeps no database ("ci", the default): a run cannot fail
# or pass by luck. Random exploration is the "dev" profile (HYPOTHESIS_PROFILE=dev), whose failures are replayed
# from .hypothesis/ until fixed and then kept as explicit examples.
settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from amla_sim.engine import numba_available, use_engine  # noqa: E402

_NO_NUMBA = pytest.mark.skipif(not numba_available(), reason="numba is not installed (the [fast] extra)")


FASTEST = "numba" if numba_available() else "numpy"


@pytest.fixture
def fastest_engine():
    """The fastest engine installed (numba, else NumPy), for a test whose subject is a model's bits against a
    device, not an engine: what a modelled choice is worth, where a race lands. The engines give the same bits;
    the replays check each engine on every kernel."""
    with use_engine(FASTEST):
        yield FASTEST


def capture_engines(captures: list[str], numpy_cases: list[int]) -> list:
    """(capture, engine, cases) for a kernel's replays: every capture in full on the fastest engine installed
    (numba, or NumPy without it), and `numpy_cases` of the first (its cheapest cases that still take each of the
    kernel's paths: formats, layouts, one split and many) on NumPy as well, so that the NumPy reference and the
    compiled kernels are each held to the device's bits on every kernel. cases None: all of them."""
    first, *rest = captures
    return [pytest.param(first, "numpy", numpy_cases, id=f"{first}-numpy-cases{'-'.join(map(str, numpy_cases))}"),
            *(pytest.param(c, FASTEST, None, id=f"{c}-{FASTEST}") for c in captures)]


def assert_replay_bit_exact(capture: str, engine: str, cases: list[int] | None, *, kernel: str, total: int,
                            stages: list[str]) -> None:
    """A capture's `cases` (None: all `total`) replayed on `engine`: `kernel`'s, every stage of every case
    compared (`stages`, in order) and bit-identical."""
    from amla_sim.crosscheck import replay

    with use_engine(engine):
        report = replay(capture, cases=cases)
    assert report.kernel == kernel and len(report.cases) == (total if cases is None else len(cases))
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()
        assert [s.name for s in row.stages] == stages


@pytest.fixture(params=["numpy", pytest.param("numba", marks=_NO_NUMBA)])
def engine(request):
    """Run the test on each engine: the NumPy reference and the compiled kernels must give the same bits."""
    with use_engine(request.param):
        yield request.param


@pytest.fixture
def frexp_refuses_nonfinite(monkeypatch):
    """np.frexp as the NumPy builds that raise the invalid flag on Inf and NaN behave (issue 23): an error on any
    non-finite input, so that a path handing one to frexp fails here too."""
    frexp = np.frexp

    def strict(x, *args, **kwargs):
        if not np.isfinite(x).all():
            raise FloatingPointError("invalid value encountered in frexp")
        return frexp(x, *args, **kwargs)

    monkeypatch.setattr(np, "frexp", strict)

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
settings.register_profile("dev", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402

from amla_sim.engine import numba_available, use_engine  # noqa: E402

_NO_NUMBA = pytest.mark.skipif(not numba_available(), reason="numba is not installed (the [fast] extra)")


@pytest.fixture(params=["numpy", pytest.param("numba", marks=_NO_NUMBA)])
def engine(request):
    """Run the test on each engine: the NumPy reference and the compiled kernels must give the same bits."""
    with use_engine(request.param):
        yield request.param

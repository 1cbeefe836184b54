"""Theorem 4.1 / B.1 and Lemma B.2 as properties; the roofline against Table 2 and FlashMLA's threshold."""

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from amla_sim.cli import main
from amla_sim.pipeline import best_internal_chains, construct_cycle, simulate
from amla_sim.roofline import TABLE2, AttentionShape, compute_bound_threshold, intensity

durations = st.lists(st.integers(0, 50).map(float), min_size=1, max_size=7)


@st.composite
def cube_dominated(draw):
    c = draw(durations)
    v = draw(st.lists(st.integers(0, 50).map(float), min_size=len(c), max_size=len(c)))
    assume(sum(c) > 0 and sum(v) <= sum(c))
    return c, v


@given(cube_dominated())
def test_theorem_b1_cube_dominated(cv):
    c, v = cv
    n = len(c)
    cycle = construct_cycle(c, v)
    assert cycle.case == "cube-dominated"
    assert cycle.internal_chains == n - 1 and cycle.preload_count == n
    tl = simulate(c, v, cycle, iterations=3 * n + 2)
    assert tl.steady_cube_idle == 0  # stall-free: the Cube never waits in the steady loop


@given(cube_dominated())
def test_theorem_b1_vector_dominated_by_symmetry(cv):
    v, c = cv  # swap the roles: now sum V >= sum C
    assume(sum(v) > sum(c))
    n = len(c)
    cycle = construct_cycle(c, v)
    assert cycle.case == "vector-dominated"
    assert cycle.internal_chains == n - 1 and cycle.preload_count == n
    tl = simulate(c, v, cycle, iterations=3 * n + 2)
    assert tl.steady_vector_idle == 0


@given(st.integers(2, 4), st.data())
def test_lemma_b2_adversarial_durations(n, data):
    """Eq. 16: some V_k with V_k + C_j > sum(C) for every j. No Cycle ordering gets more than n - 1 chains."""
    c = data.draw(st.lists(st.integers(1, 9).map(float), min_size=n, max_size=n))
    k = data.draw(st.integers(0, n - 1))
    rest = data.draw(st.lists(st.integers(0, 3).map(float), min_size=n, max_size=n))
    v = [0.0] * n
    v[k] = sum(c) - min(c) + 0.5  # V_k + C_j > sum C for all j
    for i in range(n):
        if i != k:
            v[i] = min(rest[i], (sum(c) - v[k]) / n)
    assume(sum(v) <= sum(c))
    assert best_internal_chains(c, v) <= n - 1
    assert construct_cycle(c, v).internal_chains == n - 1  # and the construction reaches the bound


def test_the_bound_is_not_universal_upper_for_easy_durations():
    """Lemma B.2 bounds what can be *guaranteed*; easy durations allow more than n - 1."""
    assert best_internal_chains([3, 2, 4], [1, 5, 2]) == 3


@pytest.mark.parametrize("c, v", [([3, 1], [2, 0]), ([4, 4], [3, 0]), ([2, 5], [1, 0])])
def test_amla_preset_has_no_cube_idle(c, v):
    cycle = construct_cycle(c, v)
    assert cycle.preload_count == 2  # Section 4.1.3: AMLA uses a Preload count of 2
    assert simulate(c, v, cycle, iterations=12).steady_cube_idle == 0


def test_papers_example_ordering():
    cycle = construct_cycle([3, 2, 4], [1, 5, 2])
    assert cycle.k == 1 and cycle.cube_order == (2, 0, 1) and cycle.vector_order == (1, 2, 0)


@pytest.mark.parametrize(
    "c, v, word",
    [([], [], "cube"), ([1, -1], [1, 1], "cube"), ([1, 2], [1], "cube and vector"), ([1], [float("nan")], "vector"),
     ([0, 0], [0, 0], "zero")],
)
def test_bad_durations(c, v, word):
    with pytest.raises(ValueError, match=word):
        construct_cycle(c, v)


def test_cli_pipeline_json_and_plot(tmp_path, capsys):
    args = ["pipeline", "--cube", "3,2,4", "--vector", "1,5,2", "--json"]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(tmp_path / "g.png")]
    except ImportError:
        pass
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["preload_count"] == 3 and report["internal_chains"] == 2
    if "plot" in report:
        assert (tmp_path / "g.png").stat().st_size > 1000


def test_roofline_reproduces_table2():
    for shape, paper in TABLE2:
        assert round(intensity(shape)) == paper, shape.name


def test_flashmla_threshold_on_h800():
    assert compute_bound_threshold(865, 3.35) == pytest.approx(129.1, abs=0.1)  # the blog's "= 128"
    assert compute_bound_threshold(865, 3.35, flashmla_approximation=False) == pytest.approx(136.7, abs=0.1)
    with pytest.raises(ValueError, match="bandwidth"):
        compute_bound_threshold(865, 0)
    with pytest.raises(ValueError, match="n1"):
        AttentionShape("x", "mla", 0, 1)


def test_cli_roofline(capsys):
    assert main(["roofline", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [round(r["intensity"]) for r in out["table2"]] == [1, 8, 121, 242, 484]

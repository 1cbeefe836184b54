"""The layer sweep (``sweep --reference layer``): its FP64 reference against the absorbed form's golden, its paths
against the layer's own functions, its grid's checks."""

from __future__ import annotations

import numpy as np
import pytest

from amla_sim.algorithms import golden
from amla_sim.algorithms.deployed.mla_layer import LAYER_MODES, absorbed_chunk, mha_chunk
from amla_sim.experiments.grid import Grid, run_grid
from amla_sim.experiments.inputs import make_inputs
from amla_sim.experiments.layer import LAYER_ALGORITHMS, layer_inputs, layer_reference, layer_weights
from amla_sim.crosscheck.layer import DEEPSEEK_V3_SCALE


def _sample(heads: int = 3, sq: int = 2, context: int = 40, batch: int = 1, seed: int = 0):
    return make_inputs("normal:1", batch=batch, heads=heads, sq=sq, context=context, seed=seed)


@pytest.mark.parametrize(("heads", "sq", "context", "batch"), [(3, 2, 40, 1), (2, 5, 5, 2), (1, 1, 300, 1)])
def test_the_reference_is_the_absorbed_forms_golden(heads, sq, context, batch):
    """The layer's FP64 attention equals, to FP64's rounding, the latent golden of the absorbed form: q_nope W_k
    over [c_kv, k_pe], its 512 columns times W_v^T (an independent route through the same weights)."""
    q, kv = _sample(heads, sq, context, batch)
    w, s = layer_weights(kv, heads)
    W = (w.astype(np.float64).reshape(-1, 128, 4, 128) * s[:, None, :, None]).reshape(heads, 256, 512)
    q_abs = np.concatenate([np.einsum("bthd,hdc->bthc", q[..., :128].astype(np.float64), W[:, :128]),
                            q[..., 512:].astype(np.float64)], axis=-1)
    latent = golden(q_abs, kv.astype(np.float64), scale=DEEPSEEK_V3_SCALE).out
    want = np.einsum("bthc,hdc->bthd", latent, W[:, 128:])
    np.testing.assert_allclose(layer_reference(q, kv), want, rtol=1e-10, atol=1e-12)


def test_the_weights_follow_the_inputs():
    q, kv = _sample()
    a, b = layer_weights(kv, 3), layer_weights(kv.copy(), 3)
    assert np.array_equal(a[0].view(np.uint8), b[0].view(np.uint8)) and np.array_equal(a[1], b[1])
    other = layer_weights(_sample(seed=1)[1], 3)
    assert not np.array_equal(a[0].view(np.uint8), other[0].view(np.uint8))
    assert np.all(np.log2(a[1]) == np.round(np.log2(a[1])))  # power-of-two block scales


@pytest.mark.parametrize("name", sorted(LAYER_ALGORITHMS))
def test_each_path_is_the_layers(name):
    """Each path gives the layer model's bits for its tokens: the MHA chunk after the context, the absorbed causal
    step, each token decoded alone; deterministic runs the engine's deterministic mode."""
    q, kv = _sample(sq=3, context=50)
    engine, _, path = name.partition("-")
    for deterministic in (False, True):
        if name == "sglang-prefill" and deterministic:
            continue
        mode = LAYER_MODES[(engine + ("-batch-invariant" if engine == "vllm" else "-deterministic"))
                           if deterministic else engine]
        x = layer_inputs(q, kv, 0)
        if path == "prefill":
            want = mha_chunk(x, 47, 3, mode).out
        else:
            want = absorbed_chunk(x, [47, 48, 49], mode, causal_step=path == "absorbed-prefill").out
        got = LAYER_ALGORITHMS[name](q, kv, deterministic=deterministic).out[0]
        assert np.array_equal(got, want.astype(np.float64)), (name, deterministic)


def test_a_layer_sweep_runs_and_sets_the_prefill_apart(tmp_path):
    """A small layer grid end to end: the decode's error is that of BF16 roundings; the MHA prefill's, whose
    kv_b_proj quantizes c_kv to E4M3 in groups of 128, about ten times more."""
    grid = Grid(algorithms=("vllm-prefill", "vllm-decode", "sglang-absorbed-prefill"), machines=("sm90-cuda",),
                contexts=(64,), heads=(2,), sq=(2,), samples=2, reference="layer")
    res = run_grid(grid, out_dir=tmp_path, progress=False)
    err = {c["algorithm"]: c["rel_frobenius"]["mean"] for c in res.summary["cells"]}
    assert set(err) == {"vllm-prefill", "vllm-decode", "sglang-absorbed-prefill"}
    assert 1e-4 < err["vllm-decode"] < 1e-2 and err["vllm-prefill"] > 5 * err["vllm-decode"]


@pytest.mark.parametrize(("kw", "match"), [
    ({"algorithms": ("vllm-prefill",)}, "algorithms: .*measure the MLA layer; give reference 'layer'"),
    ({"algorithms": ("vllm-prefill", "amla"), "reference": "layer", "machines": ("sm90-cuda",)},
     r"algorithms: a layer grid runs the layer's paths .*\['amla'\]"),
    ({"algorithms": ("vllm-decode",), "reference": "layer"}, r"machines: .*give \['sm90-cuda'\]"),
    ({"algorithms": ("vllm-decode",), "reference": "layer", "machines": ("sm90-cuda",), "blocks": (128,)},
     r"blocks: .*give \[64\]"),
    ({"algorithms": ("vllm-decode",), "reference": "layer", "machines": ("sm90-cuda",), "input_format": "fp16"},
     "input_format, schedule: a layer grid's inputs are BF16"),
    ({"algorithms": ("vllm-decode",), "reference": "layer", "machines": ("sm90-cuda",), "contexts": (2,),
      "sq": (4,)}, "contexts: a layer sample measures the last s_q"),
    ({"algorithms": ("vllm-decode:splits=2",), "reference": "layer", "machines": ("sm90-cuda",)},
     r"option 'splits=2' is not key=value with a key of vllm-decode \(\['deterministic'\]\)"),
])
def test_a_layer_grid_it_cannot_run_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        Grid(**kw)


def test_sglangs_deterministic_mha_prefill_is_refused_by_name(tmp_path):
    """SGLang's deterministic mode never runs the MHA form: the path refuses it before any sample runs."""
    grid = Grid(algorithms=("sglang-prefill:deterministic=true",), machines=("sm90-cuda",), contexts=(8,),
                heads=(1,), samples=1, reference="layer")
    with pytest.raises(ValueError, match="deterministic: SGLang's deterministic mode sends every extend to the "
                                         "absorbed form"):
        run_grid(grid, out_dir=tmp_path, progress=False)
    assert not (tmp_path / "results.csv").exists()

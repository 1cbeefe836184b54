"""Does a token's prefill give the bits of its decode? The prediction for each V3.2 serving stack against the
device: a request's prefill launch and its tokens' decode launches, run on an H100 and an H200 as each stack calls
the kernels (scripts/capture_prefill_decode.py), every bit of both predicted, and each token's verdict the device's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.cli import main
from amla_sim.engine import use_engine
from amla_sim.invariance.prefill_decode import STACKS, prefill_vs_decode, request_inputs

DATA = Path(__file__).parent / "data"
CAPTURES = {"NVIDIA H100 80GB HBM3": DATA / "prefill_decode_h100.npz", "NVIDIA H200": DATA / "prefill_decode_h200.npz"}


def _load(path: Path) -> tuple[dict, dict]:
    with np.load(path) as z:
        return json.loads(str(z["meta"])), {k: z[k] for k in z.files if k != "meta"}


@pytest.fixture(scope="module", params=sorted(CAPTURES))
def device(request):
    meta, arrays = _load(CAPTURES[request.param])
    assert meta["device"] == request.param
    return meta, arrays


@pytest.fixture(scope="module")
def predicted():
    """Each case's report (both devices ran the same cases), on the fastest engine; cases on the same request and
    stack share the modelled prefill launch."""
    meta, _ = _load(CAPTURES["NVIDIA H100 80GB HBM3"])
    reports, launches = [], {}
    with use_engine(FASTEST):
        for c in meta["cases"]:
            reports.append(_report(c, launches))
    return reports


def _report(c: dict, launches: dict):
    key = (c["stack"], c["length"], c["heads"], c["topk"], c["dist"], c["seed"])
    q, kv, idx = request_inputs(c["length"], heads=c["heads"], topk=c["topk"], dist=c["dist"], seed=c["seed"])
    rep = prefill_vs_decode(c["stack"], q, kv, idx, tokens=c["tokens"], decode_batch=c["decode_batch"],
                            scale=c["scale"], prefill_launch=launches.get(key))
    launches[key] = rep.prefill_launch
    return rep


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.astype(np.float32).view(np.uint32)


def test_every_bit_of_both_launches_is_predicted(device, predicted, fastest_engine):
    meta, arrays = device
    assert len(predicted) == len(meta["cases"]) == 5
    for k, rep in enumerate(predicted):
        for side, got in (("prefill", rep.prefill), ("decode", rep.decode)):
            for stage in ("out", "lse"):
                np.testing.assert_array_equal(_bits(got[stage]), arrays[f"c{k}_{side}_{stage}"],
                                              err_msg=f"case {k} ({rep.stack.name}) {side} {stage}")


def test_each_tokens_verdict_is_the_devices(device, predicted):
    """The device's prefill and decode bits are equal for exactly the tokens the model calls identical: every
    token of vLLM's FLASHMLA_SPARSE, none of SGLang's DSA (even deterministic: two kernels), vLLM's FA3 path where
    the two launches cut the token alike (a short list) and not where they do not."""
    meta, arrays = device
    seen = {}
    for k, rep in enumerate(predicted):
        dev = [bool(np.array_equal(arrays[f"c{k}_prefill_out"][j], arrays[f"c{k}_decode_out"][j])
                    and np.array_equal(arrays[f"c{k}_prefill_lse"][j], arrays[f"c{k}_decode_lse"][j]))
               for j in range(len(rep.tokens))]
        assert [v.identical for v in rep.tokens] == dev, f"case {k}"
        seen.setdefault(rep.stack.name, []).extend(dev)
    assert seen == {"sglang-dsa": [False] * 3, "vllm-fa3-sparse": [True, False, False],
                    "vllm-flashmla-sparse": [True] * 3, "sglang-dsa-deterministic": [False]}


def test_the_reasons(predicted):
    why: dict[str, set] = {}
    for rep in predicted:
        why.setdefault(rep.stack.name, set()).update(v.why for v in rep.tokens if not v.identical)
    assert why["sglang-dsa"] == {"two kernels (flashmla-sparse-prefill in the prefill, fa3-mla-sparse in the decode)"}
    assert why["vllm-fa3-sparse"] == {
        "FA3 cuts the token's 400 keys into 1 split(s) in the prefill launch and 7 in the decode launch",
        "FA3 cuts the token's 400 keys into 1 split(s) in the prefill launch and 2 in the decode launch"}
    assert why["vllm-flashmla-sparse"] == set()


def test_the_command(capsys, fastest_engine):
    code = main(["prefill-decode", "--stack", "vllm-flashmla-sparse", "--length", "130", "--topk", "128",
                 "--tokens", "0,-1"])
    out = capsys.readouterr().out
    assert code == 0 and "2 of 2 tokens bit-identical" in out
    code = main(["prefill-decode", "--stack", "sglang-dsa", "--length", "130", "--topk", "128", "--tokens", "-1",
                 "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 3 and rows[0]["stack"] == "sglang-dsa" and rows[0]["tokens"][0]["token"] == 129
    assert rows[0]["tokens"][0]["identical"] is False and "two kernels" in rows[0]["tokens"][0]["why"]


@pytest.mark.parametrize("argv, match", [
    (["--length", "100000"], "--length, --topk, --heads: .* products"),
    (["--heads", "200"], "--heads: .* at most 128"),
    (["--length", "10", "--tokens", "10"], r"--tokens: expected positions in 0\.\.9"),
    (["--topk", "100"], "--topk"),
    (["--topk", "200", "--length", "10"], "topk: .* multiple of 128"),
])
def test_bad_requests_are_refused_by_flag(argv, match, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["prefill-decode", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and re.search(match, err), err


def test_every_stack_is_named():
    assert set(STACKS) == {"sglang-dsa", "sglang-dsa-deterministic", "vllm-fa3-sparse", "vllm-flashmla-sparse"}
    with pytest.raises(ValueError, match="^stack: expected one of"):
        prefill_vs_decode("nope", *request_inputs(4, heads=16, topk=128))
    with pytest.raises(ValueError, match="^topk: the prefill kernel takes a multiple of 128"):
        request_inputs(4, heads=16, topk=200)


@pytest.mark.parametrize("stack, want", [
    # FlashMLA's kernel runs 64 heads for 1 and walks counts rounded up to 128: 64 (128 + 256 + 384), then the
    # decode of one token of the longest count, 64 x 384; FA3 walks the counts of 1 head and gathers 3 x 300 keys
    ("vllm-flashmla-sparse", (64 * (128 + 256 + 384) + 64 * 384, 0)),
    ("vllm-fa3-sparse", (1 + 129 + 300 + 300, 6 * 3 * 300 * 576)),
    ("sglang-dsa", (64 * (128 + 256 + 384) + 300, 6 * 1 * 300 * 576)),
])
def test_stack_work_counts_what_the_kernels_run(stack, want):
    from amla_sim.invariance.prefill_decode import stack_work

    assert stack_work(stack, [1, 129, 300], heads=1, tokens=1) == want


@pytest.mark.parametrize("argv, says", [
    (["--heads", "1", "--length", "5000", "--stack", "vllm-flashmla-sparse"], "--length, --topk, --heads: "
                                                                             "vllm-flashmla-sparse runs 5.3e+08"),
    (["--heads", "1", "--length", "10000", "--topk", "2048", "--stack", "vllm-fa3-sparse", "--max-memory", "8"],
     "prefill-decode --stack vllm-fa3-sparse needs about 65.9 GiB"),
    (["--length", "10", "--tokens", "0,0"], "--tokens: position 0 listed twice"),
    (["--length", "10", "--tokens=-1,9"], "--tokens: position 9 listed twice (-1,9; -1 is position 9)"),
])
def test_prefill_decode_refuses_before_any_work(argv, says, capsys):
    from amla_sim.cli import main

    with pytest.raises(SystemExit) as e:
        main(["prefill-decode", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err


def test_stack_work_names_an_unknown_stack():
    from amla_sim.invariance.prefill_decode import stack_work

    with pytest.raises(ValueError, match="^stack: expected one of"):
        stack_work("tgi", [1, 2], heads=1, tokens=1)

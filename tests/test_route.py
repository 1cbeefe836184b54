"""Which kernel computes a request's prefill (``amla-sim route``): vLLM's per-chunk threshold and SGLang's per-batch
one, through each engine's chunked-prefill scheduler; and the device check beside it: a request prefilled alone and
behind a batchmate that cuts it in two, through vLLM 0.33's shipped FA3 and its ``merge_attn_states`` on an H200
(``scripts/capture_route.py``), predicted in every bit both ways."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms.deployed.fa3.prefill import cu_seqlens, fa3_prefill
from amla_sim.algorithms.deployed.vllm.mla_prefill import vllm_mla_prefill
from amla_sim.cli import main
from amla_sim.invariance.routing import (Prompt, batchmates_change, parse_requests, route, route_sglang,
                                         route_vllm)

ROUTE = Path(__file__).parent / "data" / "route_vllm_h200.npz"


def _paths(chunks):
    return [(c.step, c.request, c.context, c.tokens, c.path) for c in chunks]


@pytest.mark.parametrize(("requests", "budget", "expected"), [
    ("512", 8192, [(0, 0, 0, 512, "absorbed")]),  # the threshold is inclusive
    ("513", 8192, [(0, 0, 0, 513, "mha")]),
    ("1000", 2048, [(0, 0, 0, 1000, "mha")]),
    ("1700,1000", 2048, [(0, 0, 0, 1700, "mha"), (0, 1, 0, 348, "absorbed"), (1, 1, 348, 652, "mha")]),
    # a prefilled request decodes one token a step, ahead of the waiting ones
    ("100,3000", 1000, [(0, 0, 0, 100, "absorbed"), (0, 1, 0, 900, "mha"), (1, 1, 900, 999, "mha"),
                        (2, 1, 1899, 999, "mha"), (3, 1, 2898, 102, "absorbed")]),
    ("4000+600", 8192, [(0, 0, 4000, 600, "mha")]),
])
def test_vllm_routes_each_chunk_by_its_new_tokens(requests, budget, expected):
    assert _paths(route_vllm(parse_requests(requests), budget=budget)) == expected


@pytest.mark.parametrize(("requests", "settings", "expected"), [
    ("4000+600", {}, [(0, 0, 4000, 600, "absorbed")]),  # a prefix under the threshold
    ("4000+600,5000+300", {}, [(0, 0, 4000, 600, "mha"), (0, 1, 5000, 300, "mha")]),  # the batch's sum reaches it
    ("1000", {}, [(0, 0, 0, 1000, "mha")]),  # no prefix
    ("1000", {"deterministic": True}, [(0, 0, 0, 1000, "absorbed")]),
    # a long prompt cut by the budget: its second chunk's prefix (4096) is under the threshold
    ("6000", {"budget": 4096}, [(0, 0, 0, 4096, "mha"), (1, 0, 4096, 1904, "absorbed")]),
    ("10000", {"budget": 8192}, [(0, 0, 0, 8192, "mha"), (1, 0, 8192, 1808, "mha")]),
])
def test_sglang_routes_each_extend_batch_by_its_prefixes(requests, settings, expected):
    assert _paths(route_sglang(parse_requests(requests), **settings)) == expected


def test_sglangs_mha_is_one_shot_up_to_128k_tokens():
    one = route_sglang([Prompt(1000, 120_000)], budget=8192)[0]
    many = route_sglang([Prompt(1000, 120_000), Prompt(500, 20_000)], budget=8192)[0]
    assert "one call" in one.kernels and "prefix (chunks)" in many.kernels and "merge_state_v2" in many.kernels


def test_batchmates_that_move_a_request_are_named():
    assert batchmates_change("vllm", parse_requests("1700,1000"), budget=2048) == {1: "its chunks and the kernel"}
    assert batchmates_change("sglang", parse_requests("4000+600,5000+300")) == {
        0: "a chunk's path and the kernel", 1: "a chunk's path and the kernel"}
    assert batchmates_change("vllm", parse_requests("600,700")) == {}


@pytest.mark.parametrize(("engine", "requests", "settings", "expected"), [
    ("vllm", "20,10", {}, {0: "the projections' kernel", 1: "the projections' kernel"}),
    ("vllm", "20,4", {}, {}),  # a step of 24 rows: FlashInfer's GEMM with and without the batchmate
    ("vllm", "20,10", {"deterministic": True}, {}),  # DeepGEMM at every size
    ("sglang", "20,10", {}, {}),
    # request 1 alone: steps of 30 (DeepGEMM) to its end; behind request 0 a last step of 10 and a decode (FlashInfer)
    ("vllm", "20,600", {"budget": 30}, {0: "the projections' kernel", 1: "its chunks and the projections' kernel"}),
])
def test_a_batchmate_that_moves_the_projections_is_named(engine, requests, settings, expected):
    """vLLM's default mode runs a step's FP8 block linears through FlashInfer's GEMM below 32 rows of its CUDA graph
    and DeepGEMM from 32: two short prompts together cross it (20 + 10 rows, padded to 32), 20 + 4 (24) do not."""
    assert batchmates_change(engine, parse_requests(requests), **settings) == expected


def test_a_steps_decodes_count_in_its_projections():
    """A prefilled request's decode shares vLLM's step: its token counts in the rows the projections run."""
    steps = route("vllm", [Prompt(10), Prompt(40)], budget=20)
    assert [(c.step, c.request, c.tokens) for c in steps] == [(0, 0, 10), (0, 1, 10), (1, 1, 19), (2, 1, 11)]
    assert [c.linear.split(": ")[1] for c in steps] == [
        "a step of 20 tokens (24 in its CUDA graph)", "a step of 20 tokens (24 in its CUDA graph)",
        "a step of 20 tokens (24 in its CUDA graph)", "a step of 12 tokens (16 in its CUDA graph)"]


@pytest.mark.parametrize(("argv", "match"), [
    (["--requests", "1,x"], "requests: expected N or C"),
    (["--requests", "0"], "requests"),
    (["--requests", "5+-1"], "requests"),
    (["--requests", "1000000000", "--budget", "1"], "requests, budget: 1000000000 new tokens at 1 a step"),
    (["--requests", "1,5", "--budget", "1"], "budget: the decodes of 1 prefilled requests take all 1 tokens"),
    (["--requests", ",".join(["1"] * 4097)], "requests: 4097 requests, more than a route walks"),
])
def test_bad_requests_are_refused_by_name(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["route", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_the_command_says_what_a_batchmate_changes(capsys):
    assert main(["route", "--requests", "1700,1000", "--budget", "2048"]) == 0
    text = capsys.readouterr().out
    assert "request 1: its batchmates change its chunks and the kernel (alone: 0..999 mha)" in text
    assert "348 new tokens <= 512" in text
    assert main(["route", "--engine", "sglang", "--requests", "4000+600,5000+300", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [c["path"] for c in got["chunks"]] == ["mha", "mha"] and got["alone"]["0"][0]["path"] == "absorbed"


def test_the_device_check_is_predicted_both_ways(fastest_engine):
    """Tokens 348-999 of the request: alone, one causal call; behind the batchmate, a causal call over them, the
    context of 348 and the merge. 40.9% of their output bits differ between the two on the device, and the models
    give both in every bit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture_route", Path(__file__).parents[1] / "scripts" /
                                                  "capture_route.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with np.load(ROUTE) as z:
        meta, alone_bits, batch_bits = json.loads(str(z["meta"])), z["alone_out"], z["batch_out"]
    r = meta["recipe"]
    assert meta["device"] == "NVIDIA H200" and r == script.RECIPE
    q, k, v = script.inputs(r)
    from amla_sim.crosscheck.files import input_crc

    assert input_crc(q, k, v) == meta["input_crc"]
    T, c, keep = r["tokens"], r["first_chunk"], r["keep_heads"]
    alone = fa3_prefill(q[:, :keep], k[:, :keep], v[:, :keep], cu_seqlens([T]), cu_seqlens([T]), scale=r["scale"],
                        causal=True, launch_heads=r["heads"])
    batch = vllm_mla_prefill(q[c:, :keep], k[c:, :keep], v[c:, :keep], k[:c, :keep], v[:c, :keep], [T - c], [c],
                             workspace=r["workspace"], block_size=r["block_size"], scale=r["scale"],
                             num_splits=r["num_splits"], launch_heads=r["heads"])
    assert np.array_equal(alone.out.view(np.uint16), alone_bits)
    assert np.array_equal(batch.out.view(np.uint16), batch_bits)
    assert 0.3 < np.mean(alone_bits[c:] != batch_bits) < 0.5
    assert route_vllm(parse_requests(f"{r['batchmate']},{T}"), budget=r["budget"])[1].tokens == c

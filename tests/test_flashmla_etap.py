"""FlashMLA-ETAP, the ETAP paper's own kernel (issue 20), bit for bit: captures of an H100 and an H200 (seed 0
through scripts/capture_thirdparty.py; fresh seeds through `amla-sim crosscheck --kernel flashmla-etap`), its
scheduler's metadata int for int, and its two data races (scripts/etap_race.py): the runs where no race fired
and the kernel with the missing synchronisation are the simulator's bits."""

import functools
import importlib
import json
import math

import ml_dtypes
import numpy as np
import pytest
from conftest import capture_engines

from amla_sim.algorithms import fa3_mla, flashmla_etap, golden
from amla_sim.algorithms.deployed.fast_math import logf
from amla_sim.algorithms.deployed.flashmla.scheduler import (
    etap_num_sm_parts,
    etap_schedule,
)
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.flashmla import ETAP_CASES
from amla_sim.crosscheck.kernel import case_inputs
from amla_sim.engine import numba_available, use_engine
from amla_sim.experiments.inputs import make_inputs
from amla_sim.machines import get_machine
from amla_sim.units import DivUnit, ExpUnit, FMAUnit, LogUnit

etap_module = importlib.import_module("amla_sim.algorithms.deployed.flashmla.etap")  # the module, not the function
combine_module = importlib.import_module("amla_sim.algorithms.deployed.flashmla.combine")
DATA = "tests/data/"
CAPTURES = ["flashmla_etap_decode.npz", "flashmla_etap_h100_fresh.npz", "flashmla_etap_h200_fresh.npz"]


def _meta(name):
    with np.load(DATA + name) as z:
        return json.loads(str(z["meta"])), {k: z[k] for k in z.files if k != "meta"}


# NumPy: BF16 causal s_q 2, FP16 at lengths 63 to 65; one split and 47
@pytest.mark.parametrize(("capture", "engine", "cases"), capture_engines(CAPTURES, [2, 3]))
def test_flashmla_etap_bit_exact(capture, engine, cases):
    with use_engine(engine):
        report = replay(DATA + capture, cases=cases)
    assert report.kernel == "flashmla-etap" and report.version == "39e6160"
    assert len(report.cases) == len(cases or range(8))
    for row in report.cases:
        assert row.first_difference is None, report.format()


def test_the_captures_cover_the_issue():
    """BF16 and FP16; 16, 32, 64 and 128 heads; s_q 1 and 2 (causal); batches of 1 to 16 with lengths 1, 63, 64,
    65 and past 16K; both scales; two distributions; an H100 and an H200; three seeds."""
    seen = {"format": set(), "heads": set(), "sq": set(), "batch": set(), "scale": set(), "dist": set(),
            "device": set(), "seed": set()}
    lengths = set()
    for capture in CAPTURES:
        meta, _ = _meta(capture)
        seen["device"].add(meta["device"])
        for c in meta["cases"]:
            for k in ("format", "heads", "sq", "batch", "scale", "dist"):
                seen[k].add(c[k])
            seen["seed"].add(c["seed"] // 1000)
            lengths.update(c["seqlens"])
            assert c["causal"] == (c["sq"] > 1) and c["page_size"] == 64
    assert seen["format"] == {"bf16", "fp16"} and seen["heads"] == {16, 32, 64, 128} and seen["sq"] == {1, 2}
    assert {1, 16} <= seen["batch"] and seen["scale"] == {None, 0.1352} and seen["dist"] == {"flashmla", "normal:1"}
    assert {1, 63, 64, 65} <= lengths and max(lengths) > 16384 and len(seen["seed"]) == 3
    assert seen["device"] == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_scheduler_writes_the_kernels_metadata(capture):
    meta, arrays = _meta(capture)
    for i, c in enumerate(meta["cases"]):
        parts = etap_num_sm_parts(s_q=c["sq"], heads_q=c["heads"])
        ours, splits = etap_schedule(c["seqlens"], parts)
        np.testing.assert_array_equal(ours, arrays[f"c{i}_sched"])  # every int of the 5 the kernel writes
        np.testing.assert_array_equal(splits, arrays[f"c{i}_num_splits"])


# --- the kernel's races -----------------------------------------------------------------------------------


def _races():
    with np.load(DATA + "flashmla_etap_races.npz") as z:
        return json.loads(str(z["meta"])), {k: z[k] for k in z.files if k != "meta"}


def test_the_kernel_races_and_the_fixed_kernel_does_not():
    """30 runs of every case and seed: the authors' kernel gives several outputs for some cases, never several LSEs;
    the same sources with the missing synchronisation give one output in all 30 runs of every case."""
    meta, _ = _races()
    for gpu, runs in meta["gpus"].items():
        assert runs["repeats"] == 30 and len(runs["unpatched"]) == len(runs["patched"]) == 24
        assert all(r["distinct_out"] == [30] and r["distinct_lse"] == [30] for r in runs["patched"]), gpu
        assert all(r["distinct_lse"] == [30] for r in runs["unpatched"]), gpu
        raced = {(r["seed"], r["case"]) for r in runs["unpatched"] if len(r["distinct_out"]) > 1}
        assert raced and {c for _, c in raced} <= set(meta["cases"]), (gpu, raced)


@pytest.mark.parametrize("seed", [0, 1000, 2000])
@pytest.mark.parametrize("case", [4, 5])
def test_where_the_races_land(case, seed, fastest_engine):
    """The simulator gives the fixed kernel's bits, which are also the authors' kernel's most frequent result; every
    other result it gave differs only in query rows 8..15 of an m-block (the second n8 half of the transposed
    tiles: the stores each thread makes last)."""
    meta, arrays = _races()
    b, sq, H, seqlens, fmt, dist, case_seed, scale = ETAP_CASES[case]
    q, kv = make_inputs(dist, batch=b, heads=H, sq=sq, context=max(seqlens), seed=case_seed + seed, fmt=fmt)
    with use_engine("numba" if numba_available() else "numpy"):
        res = flashmla_etap(q, kv, seqlens=np.array(seqlens), scale=scale, causal=sq > 1)
    for gpu in meta["gpus"]:
        key = f"{gpu}_s{seed}_c{case}"
        np.testing.assert_array_equal(res.out.view(np.uint16), arrays[f"{key}_out"])
        np.testing.assert_array_equal(res.lse.view(np.uint32), arrays[f"{key}_lse"])
        counts = arrays[f"{key}_out_count"]
        assert arrays[f"{key}_lse_count"].tolist() == [30] and arrays[f"{key}_lse0_at"].size == 0
        modal = int(np.argmax(counts))
        assert counts[modal] >= 20 and arrays[f"{key}_out{modal}_at"].size == 0, (gpu, counts)
        for j in range(len(counts)):
            at = arrays[f"{key}_out{j}_at"]
            _, s, h, _ = np.unravel_index(at, res.out.shape)
            assert ((s * H + h) % 16 >= 8).all(), (gpu, j)  # row r = s h_q + head; 16 rows an m-block


# --- each choice matters ----------------------------------------------------------------------------------

_W, _G = etap_module.WARPS, etap_module.GROUPS


def _thread_sum_unfused(mc, part, s, P):
    Pk = P.reshape(P.shape[0], _W, 2, _G)
    first = Pk[:, :, 0] if s is None else mc.f(mc.f(part * s[:, None, None]) + Pk[:, :, 0])
    return mc.f(first + Pk[:, :, 1])


def _thread_sum_adjacent(mc, part, s, P):
    Pk = P.reshape(P.shape[0], _W, _G, 2)  # keys 2g and 2g + 1 in a thread instead of g and g + 8
    first = Pk[..., 0] if s is None else mc.mul_add(part, s[:, None, None], Pk[..., 0])
    return mc.f(first + Pk[..., 1])


def _row_total_sequential(mc, part):
    terms = [part[:, w, g] for w in range(_W) for g in range(_G)]
    return functools.reduce(lambda a, x: mc.f(a + x), terms, np.zeros(part.shape[0], mc.dtype))


CHOICES = {  # name: (capture case where it bites, module function replaced, or machine units swapped)
    "scale-in-double": (6, ("softmax_scale", lambda scale, default=576**-0.5: default if scale is None else scale)),
    "blocks-forward": (7, ("_walk", lambda lo, hi: range(lo, hi))),
    "row-sum-unfused": (7, ("_thread_sum", _thread_sum_unfused)),
    "adjacent-keys": (6, ("_thread_sum", _thread_sum_adjacent)),
    "row-total-in-order": (6, ("_row_total", _row_total_sequential)),
    "lse-other-contraction": (6, ("_split_lse", lambda mc, M, sm, L: mc.mul_add(mc.log2(L), mc.f(math.log(2.0)),
                                                                             mc.f(M * sm)))),
    "combine-unfused": (6, (combine_module, "_combine_lse", lambda mc, total, M: mc.f(logf(mc, total) + M))),
    "no-fma": (6, {"fma": FMAUnit(contract=False)}),
    "ieee-exp2": (6, {"exponential": ExpUnit("correctly-rounded")}),
    "ieee-log2": (6, {"logarithm": LogUnit(ln=None, lg2="correctly-rounded")}),
    "ieee-reciprocal": (5, {"division": DivUnit("ieee")}),
}


@pytest.mark.parametrize("change", sorted(CHOICES))
def test_each_etap_choice_matters(change, monkeypatch, fastest_engine):
    """The replay fails when one of the model's choices is replaced by a plausible other."""
    case, swap = CHOICES[change]
    units = swap if isinstance(swap, dict) else {}
    if not units:
        monkeypatch.setattr(*((etap_module,) if len(swap) == 2 else ()), *swap)
    meta, arrays = _meta(CAPTURES[0])
    c = meta["cases"][case]
    q, kv = case_inputs(c)
    res = flashmla_etap(q, kv, seqlens=np.array(c["seqlens"]), scale=c["scale"], causal=c["causal"],
                        machine=get_machine("sm90-cuda", **units))
    same = np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]), np.mean(res.lse.view(np.uint32) ==
                                                                               arrays[f"c{case}_lse"])
    assert min(same) < 1, same


# --- other machines, bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("machine", ["golden", "ieee32", "sm90-cuda"])
def test_flashmla_etap_on_other_machines(machine, fmt):
    q, kv = make_inputs("normal:1", batch=2, sq=2, heads=16, context=700, seed=9, fmt=fmt)
    res = flashmla_etap(q, kv, seqlens=[700, 130], machine=machine, trace=True)  # causal, as golden's s_q = 2
    assert res.out.dtype == (np.float64 if machine == "golden" else q.dtype)
    for i, n in enumerate((700, 130)):
        ref = golden(q[i:i + 1], kv[i:i + 1, :n], scale=float(np.float32(576**-0.5)))  # the API's float scale
        err = np.linalg.norm(res.out[i:i + 1].astype(np.float64) - ref.out) / np.linalg.norm(ref.out)
        assert err < (1e-12 if machine == "golden" else 8e-3 if fmt == "bf16" else 1e-3), err
        np.testing.assert_allclose(res.lse[i], ref.lse[0].T, rtol=1e-12 if machine == "golden" else 1e-5)
    assert len(res.trace["split_blocks"]) == 2 and res.trace["split_out"][0].shape[1:] == (32, 512)


def test_causal_rows_see_the_keys_up_to_their_position():
    """s_q = 2, causal: query 0 sees keys up to seqlen - 2, query 1 all; a request of one key leaves query 0 with
    none (the kernel's +inf LSE and zero output)."""
    q, kv = make_inputs("normal:1", batch=2, sq=2, heads=16, context=200, seed=3)
    res = flashmla_etap(q, kv, seqlens=[200, 1], machine="golden")
    for s, n in ((0, 199), (1, 200)):
        ref = golden(q[:1, s:s + 1], kv[:1, :n], scale=float(np.float32(576**-0.5)))  # the API's float
        np.testing.assert_allclose(res.out[0, s], ref.out[0, 0], rtol=1e-12, atol=1e-14)
    assert np.isposinf(res.lse[1, :, 0]).all() and (res.out[1, 0] == 0).all()
    np.testing.assert_allclose(res.out[1, 1], kv[1, 0, :512].astype(np.float64)[None].repeat(16, 0), rtol=1e-12)


@pytest.mark.parametrize("kwargs, name", [
    ({"seqlens": [0]}, "seqlens"), ({"seqlens": [65]}, "seqlens"), ({"seqlens": [64], "scale": float("nan")}, "scale"),
    ({"seqlens": [64], "num_sms": 0}, "num_sms"), ({"seqlens": [64], "num_sms": 1000}, "num_sms"),
    ({"seqlens": [64], "machine": "b200"}, "machine"), ({"seqlens": [64], "causal": "yes"}, "causal"),
])
def test_flashmla_etap_bad_input_names_the_argument(kwargs, name):
    q, kv = make_inputs("normal:1", heads=16, context=64)
    with pytest.raises((ValueError, TypeError), match=name):
        flashmla_etap(q, kv, **kwargs)


@pytest.mark.parametrize("kwargs, name", [({"block": 128}, "block"), ({"schedule": "nope"}, "schedule"),
                                          ({"num_sms": 0}, "num_sms"), ({"machine": "h100"}, "machine")])
def test_the_sweep_entry_names_the_argument(kwargs, name):
    """`flashmla-etap` as run, reproduce and sweep call it: the kernel's own block only, a known schedule."""
    from amla_sim.algorithms import ALGORITHMS

    q, kv = make_inputs("normal:1", heads=16, context=64)
    with pytest.raises((ValueError, TypeError), match=name):
        ALGORITHMS["flashmla-etap"](q, kv, **kwargs)


def test_flashmla_etap_takes_one_format_for_both():
    q = np.zeros((1, 1, 16, 576), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"kv: the kernel takes BF16 \(the format of q\), got float16"):
        flashmla_etap(q, np.zeros((1, 64, 576), np.float16), seqlens=[64])
    with pytest.raises(TypeError, match="q: the kernel takes BF16 or FP16, got float32"):
        flashmla_etap(q.astype(np.float32), np.zeros((1, 64, 576), np.float32), seqlens=[64])
    with pytest.raises(ValueError, match="q: expected shape"):
        flashmla_etap(np.zeros((1, 1, 16, 512), np.float16), np.zeros((1, 64, 576), np.float16), seqlens=[64])


def _edited(tmp_path, edit):
    meta, arrays = _meta(CAPTURES[0])
    edit(meta, arrays)
    path = tmp_path / "edited.npz"
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


@pytest.mark.parametrize("edit, words", [
    (lambda m, a: m["cases"][1].update(page_size=16), "page_size: the kernel takes pages of 64 tokens"),
    (lambda m, a: m["cases"][0].update(format="e4m3"), "format: the kernel takes bf16 or fp16"),
    (lambda m, a: m["cases"][2].update(head_dim=512), "head_dim"),
    (lambda m, a: m["cases"][2].pop("causal"), "has no 'causal'"),
    (lambda m, a: a.update(c3_out=a["c3_out"][..., :256]), "c3_out should be"),
])
def test_recipes_the_model_does_not_cover_are_refused(edit, words, tmp_path, capsys):
    from amla_sim.cli import main

    path = _edited(tmp_path, edit)
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", "--kernel", "flashmla-etap", "--replay", str(path)])
    err = capsys.readouterr().err
    assert e.value.code in (1, 2) and words in err and "Traceback" not in err, err


def test_cli_replays_flashmla_etap(capsys, tmp_path, fastest_engine):
    """The command line (the replay itself is checked on both engines above)."""
    from amla_sim.cli import main

    path = _edited(tmp_path, lambda m, a: (m.update(cases=m["cases"][:2]),  # and only those cases' arrays
                                           [a.pop(k) for k in list(a) if not k.startswith(("c0_", "c1_"))]))
    assert main(["crosscheck", "--kernel", "flashmla-etap", "--replay", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["first_difference"] for r in report["cases"]] == [None, None]
    assert report["cases"][0]["format"] == "fp16" and report["cases"][1]["format"] == "bf16"
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", "--kernel", "flashmla", "--replay", str(path)])
    assert e.value.code == 2 and "--kernel" in capsys.readouterr().err


# --- ETAP's Table 1 on the authors' kernel --------------------------------------------------------------


def test_table1_measured_on_the_kernel_replays_on_a_cpu():
    """The paper's setup (FP16, batch 16, 16 heads, s_q 1) on an H100: the race-free build's output bits at 512 and
    1024 tokens are the simulator's, so a CPU reproduces the device's RMSE; every run of that build gave the same
    RMSE at every context, while the authors' build gave several at some (its races)."""
    with np.load(DATA + "etap_table1_h100.npz") as z:
        meta = json.loads(str(z["meta"]))
        arrays = {k: z[k] for k in z.files if k != "meta"}
    both = {(r["dist"], r["context"]): r["rmse"] for r in meta["rmse"]["both"]}
    original = {(r["dist"], r["context"]): r["rmse"] for r in meta["rmse"]["original"]}
    assert len(both) == 16 and all(len(set(v)) == 1 for v in both.values())
    assert sum(len(set(v)) > 1 for v in original.values()) >= 4
    for dist in ("normal:1", "fa3-outliers"):
        for ctx in meta["kept"]:
            q, kv = make_inputs(dist, batch=16, heads=16, sq=1, context=ctx, seed=meta["seed"], fmt="fp16")
            with use_engine("numba" if numba_available() else "numpy"):
                res = flashmla_etap(q, kv)
            key = f"{dist.split(':')[0]}_{ctx}"
            np.testing.assert_array_equal(res.out.view(np.uint16), arrays[f"{key}_out"])
            np.testing.assert_array_equal(res.lse.view(np.uint32), arrays[f"{key}_lse"])
            rmse = np.sqrt(np.mean((res.out.astype(np.float64) - golden(q, kv).out) ** 2))
            np.testing.assert_allclose(rmse, both[(dist, ctx)][0], rtol=1e-9)  # FP64 sums in two orders
            assert original[(dist, ctx)][0] == both[(dist, ctx)][0]  # no race fired at these contexts


def test_the_kernel_table_runs_through_reproduce(tmp_path):
    """`reproduce etap-table1-kernel`: the kernel's model is a sweep algorithm; its row is its RMSE on the same
    draw, computed here directly."""
    import csv

    from amla_sim._seeds import derive_seed
    from amla_sim.cli import main

    assert main(["reproduce", "etap-table1-kernel", "--samples", "1", "--context", "128", "--machine", "sm90-cuda",
                 "--out", str(tmp_path), "--quiet"]) == 0
    with open(tmp_path / "etap-table1-kernel" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted({r["algorithm"] for r in rows}) == ["etap", "fa3-base", "fa3-mla", "flashmla-etap"]
    assert len(rows) == 8
    q, kv = make_inputs("normal:1", heads=16, sq=1, context=128, fmt="fp16",
                        seed=derive_seed(0, "etap-table1-kernel", "normal:1", 0))
    for alg, model in (("flashmla-etap", flashmla_etap), ("fa3-mla", fa3_mla)):
        want = np.sqrt(np.mean((model(q, kv).out.astype(np.float64) - golden(q, kv).out) ** 2))
        got = next(float(r["rmse"]) for r in rows if r["algorithm"] == alg and r["distribution"] == "normal:1")
        assert got == pytest.approx(want, rel=1e-12), alg

"""The invariance study and the kernel diff refuse bad input by name and before any work: every bound is checked
before a plan is built and the memory a run needs before a request is drawn; a file's error names the file and the
launch at fault. The cases below are those a fuzz pass over ``amla-sim invariance``, ``amla-sim diff`` and the
public functions of :mod:`amla_sim.invariance` found, each with odd values (0, negative, 10^9, NaN, empty, unknown
names, damaged files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.cli import main
from amla_sim.engine import use_engine
from amla_sim.invariance import Launch, describe_plan, get_batch_kernel, invariance, kernel_diff, project, variations
from amla_sim.invariance.checks import device_launches, replay_invariance, scheduler_batches
from amla_sim.invariance.launches import MAX_BATCH
from amla_sim.invariance.registry import kernel_classes

CAPTURE = Path(__file__).parent / "data" / "invariance_h200.npz"
GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def _fastest_engine():
    with use_engine(FASTEST):
        yield


@pytest.fixture
def no_work(monkeypatch):
    """Any kernel that builds a plan or draws a request fails the test: the refusals come first."""

    def boom(*args, **kwargs):
        raise AssertionError("a plan was built or a request drawn before the bounds were checked")

    for cls in kernel_classes().values():
        monkeypatch.setattr(cls, "plans", boom)
        monkeypatch.setattr(cls, "request", boom)


def cli_error(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return e.value.code, err.strip().splitlines()[-1]


# --- every bound before any plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel, kwargs, match", [
    ("flashmla", {"num_sms": (10**9,)}, r"^num_sms: 1000000000 SMs give .* combine kernel .*\(launch 'alone'\)"),
    ("flashmla-etap", {"num_sms": (10**9,)}, "^num_sms: 1000000000 SMs"),
    ("flashmla-etap", {"heads": 10**6}, "^num_sms, heads, s_q: 132 SMs give no scheduler part"),
    ("flashmla-sparse-fp8", {"length": 64, "heads": 64, "num_sms": (10**9,)}, "^num_sms: 1000000000 SMs"),
    ("vllm-triton-mla", {"num_kv_splits": (10**9,)}, r"^num_kv_splits: expected an int in \[1, 65535\]"),
    ("sglang-triton", {"num_kv_splits": (10**9,)}, r"^num_kv_splits: expected an int in \[1, 65535\]"),
    ("fa3-mla", {"num_kv_splits": (257,)}, r"^num_kv_splits: expected an int in \[1, 256\]"),
    ("sglang-triton", {"max_context_len": 10**9, "num_sms": (10**9,)}, "^num_sms, max_context_len: .* max_kv_splits"),
    ("sglang-triton", {"heads": 2 * 10**6}, "^heads: 2000000 heads make 125000 head tiles"),
    ("flashmla", {"batchmates": (10**9,)}, r"^batchmates: expected an int in \[1, 65535\]"),
    ("flashmla", {"mixed": 10**9}, r"^mixed: expected an int in \[0, 65535\]"),
    ("flashmla", {"num_sms": (2**31,)}, "^num_sms: expected an int in"),
    ("flashmla", {"heads": 10**6, "max_memory": GIB}, r"heads.*: the study of flashmla .* needs about"),
    ("flashmla", {"s_q": (10**9,), "max_memory": GIB}, r"s_q.*: the study of flashmla .* needs about"),
    ("flashmla", {"length": 10**9, "max_memory": GIB}, "^length, heads, s_q: the study of flashmla"),
    ("vllm-triton-mla", {"num_kv_splits": (65535,), "length": 10**5, "max_memory": GIB}, "^heads, s_q, num_kv_splits"),
    ("flashmla", {"split_tokens": 64, "length": 64 * 200}, "^split_tokens: splits of 64 tokens cut the request's"),
    ("flashmla", {"split_tokens": 100}, "^split_tokens: expected a multiple of 64"),
    ("fa3-mla", {"split_tokens": 256}, "^split_tokens: FA3 takes a split count"),
    ("fa3-prefill", {"length": 10**7, "heads": 128, "s_q": (128,), "max_memory": GIB},
     "^length, heads, s_q: the study of fa3-prefill"),
    ("fa3-prefill", {"heads": 300}, r"^heads: expected an int in \[1, 256\]"),
    ("flashmla", {"launches": [Launch("a", (64,))], "length": 128}, "^launches: 'a' gives the request 64 tokens"),
    ("flashmla", {"launches": [Launch("a", (128,), num_kv_splits=4)]}, "^num_kv_splits: flashmla's API"),
    ("flashmla", {"launches": ["a"]}, "^launches: at least the reference launch, each a Launch"),
    ("flashmla", {"launches": "a"}, "^launches: expected a sequence"),
])
def test_every_bound_is_checked_before_a_plan_is_built(no_work, kernel, kwargs, match):
    kwargs = {"length": 128, "heads": 16, "batchmates": (1,), "mixed": None, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        invariance(kernel, **kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: Launch("a", (64,) * (MAX_BATCH + 1)), "^lengths: 65537 requests"),
    (lambda: Launch("a", (2**31,)), "^lengths: expected an int in"),
    (lambda: Launch("a", (64,), num_sms=2**31), "^num_sms"),
    (lambda: Launch("a", "64"), "^lengths: a launch holds at least the request's own length"),
    (lambda: variations(256, batchmates=(65535,) * 20), "^batchmates: the launches would hold"),
    (lambda: variations(256, batchmates=range(1, 10**9)), "^batchmates: 999999999 values, a launch each"),
    (lambda: variations(256, batchmates=5), "^batchmates: expected a sequence"),
    (lambda: variations(256, mixed=float("nan")), "^mixed: expected an int"),
    (lambda: variations(2**31), "^length: expected an int in"),
    (lambda: variations(256, num_kv_splits=(0,)), "^num_kv_splits"),
    (lambda: project(np.zeros((16, 512)), np.zeros((3, 4))), r"^projection: expected \(8192, vocab\)"),
    (lambda: get_batch_kernel(["flashmla"]), "^kernel: expected one of"),
    (lambda: invariance(123), "^kernel: expected a kernel's name"),
    (lambda: invariance("flashmla", dist=None, length=128, heads=16), "^dist: expected a distribution's name"),
    (lambda: kernel_diff("flashmla", None), r"^kernel: expected a kernel's name, got None \(the second kernel\)"),
    (lambda: describe_plan([]), "^plan: expected one or more"),
    (lambda: describe_plan([(5, 1)]), "^plan: expected one or more"),
    (lambda: device_launches("nope"), "^kernel: the device check covers"),
    (lambda: device_launches("flashinfer-mla"), "^kernel: flashinfer-mla's device check rebuilds its launches"),
    (lambda: scheduler_batches(n=10**9), r"^n: expected an int in \[0, 100000\]"),
    (lambda: scheduler_batches(seed=-1), "^seed: expected an int >= 0"),
    (lambda: replay_invariance(None, "sglang-triton"), "^replay: expected a capture file's path"),
])
def test_the_public_functions_refuse_odd_values_by_name(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_numpy_counts_make_the_same_launches():
    assert variations(256, batchmates=np.array([1, 2]), mixed=None) == variations(256, batchmates=(1, 2), mixed=None)
    assert Launch("a", np.array([64, 128])) == Launch("a", [64, 128]) == Launch("a", (64, 128))


def test_an_address_space_limit_is_the_memory_available():
    """Under ``ulimit -v`` (here 3 GB) a study that would not fit is refused by name, not killed half way."""
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, resource.RLIM_INFINITY))\n"
            "from amla_sim.cli import main\nsys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "invariance", "--kernel", "sglang-triton", "--length", "128",
                        "--heads", "100000", "--batchmates", "1", "--mixed", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--heads" in r.stderr and "needs about" in r.stderr and "is available" in r.stderr, r.stderr


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "flashmla", "--num-sms", "1000000000"], "--num-sms: 1000000000 SMs give"),
    (["--kernel", "vllm-triton-mla", "--num-kv-splits", "1000000000"], "--num-kv-splits: expected an int in [1, 65535]"),
    (["--kernel", "fa3-mla", "--num-kv-splits", "257"], "--num-kv-splits: expected an int in [1, 256]"),
    (["--kernel", "flashmla", "--heads", "1000000", "--max-memory", "1"], "--heads"),
    (["--kernel", "flashmla-etap", "--heads", "1000000"], "--num-sms, --heads, --sq: 132 SMs give no scheduler part"),
    (["--kernel", "sglang-triton", "--heads", "2000000"], "--heads: 2000000 heads make"),
    (["--kernel", "sglang-triton", "--max-context-len", "1000000000", "--num-sms", "1000000000"],
     "--num-sms, --max-context-len:"),
    (["--kernel", "flashmla", "--batchmates", "1000000000"], "--batchmates: expected an int in [1, 65535]"),
    (["--kernel", "flashmla", "--mixed", "1000000000"], "--mixed: expected an int in [0, 65535]"),
    (["--kernel", "flashmla", "--num-sms", "2147483648"], "--num-sms: expected an int in [1, 2147483647]"),
    (["--kernel", "flashmla", "--length", "1000000000", "--max-memory", "1"], "--length, --heads, --sq: the study"),
    (["--kernel", "flashmla", "--dist", ""], "--dist: expected one of"),
    (["--kernel", "flashmla", "--dist", "normal:nan"], "--dist: normal's parameter"),
    (["--kernel", "flashmla", "--tokens", "5"], "--tokens: not an option of flashmla"),
    (["--kernel", "flashmla", "--format", "fp16"], "--format: not an option of flashmla"),
    (["--kernel", "sglang-triton", "--max-context-len", "1"], "--length, --max-context-len: 128 tokens, past"),
    (["--kernel", "flashmla", "--split-tokens", "100"], "--split-tokens: expected a multiple of 64"),
    (["--kernel", "flashmla", "--length", "12800", "--split-tokens", "64"], "--split-tokens: splits of 64 tokens"),
    (["--kernel", "flashmla-sparse-fp8", "--length", "64", "--heads", "64", "--tokens", "10"], "--tokens: a request's"),
    (["--kernel", "flashmla", "--projection", "NAN"], "--projection: NAN: expected finite floats"),
    (["--kernel", "flashmla", "--projection", "NPZ"], "--projection: NPZ is not a .npy array"),
    (["--kernel", "flashmla", "--projection", "TRUNCATED"], "--projection: TRUNCATED is not a .npy array"),
])
def test_the_command_names_the_flag_before_any_work(no_work, tmp_path, capsys, argv, message):
    files = {"NAN": tmp_path / "nan.npy", "NPZ": tmp_path / "p.npz", "TRUNCATED": tmp_path / "cut.npy"}
    np.save(files["NAN"], np.full((16 * 512, 3), np.nan))
    np.savez(files["NPZ"], p=np.zeros((16 * 512, 3)))
    np.save(files["TRUNCATED"], np.zeros((16 * 512, 3)))
    files["TRUNCATED"].write_bytes(files["TRUNCATED"].read_bytes()[:500])
    argv = [str(files.get(a, a)) for a in argv]
    message = message.replace("NAN", str(files["NAN"])).replace("NPZ", str(files["NPZ"])) \
        .replace("TRUNCATED", str(files["TRUNCATED"]))
    code, err = cli_error(["invariance", "--length", "128", "--heads", "16", "--batchmates", "1", "--mixed", "0",
                           *argv], capsys)
    assert code == 2 and message in err, err


# --- requests shorter than the drawn batchmates ------------------------------------------------------------------


def test_a_request_under_32_tokens_gets_batchmates_of_its_scale(capsys):
    """Batchmates are drawn between 64 and twice the request's length, either way round."""
    mates = variations(16, batchmates=(), mixed=2)[1].lengths[1:]
    assert all(32 <= n <= 64 for n in mates)
    assert main(["invariance", "--kernel", "flashmla", "--length", "16", "--heads", "16", "--batchmates", "1",
                 "--mixed", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["length"] == 16


# --- the diff ----------------------------------------------------------------------------------------------------


def test_a_stage_one_kernel_returns_alone_is_never_identical(capsys):
    """SGLang's decode returns no LSE, vLLM's does: on a request of one split each their outputs agree, and the
    diff says so without calling the two identical (exit 4: a stage not compared)."""
    d = kernel_diff("sglang-triton", "vllm-triton-mla", length=32, heads=16, dist="normal:1")
    assert d.comparison.first_difference is None and not d.identical
    assert set(d.comparison.not_compared) == {"lse"} and "not shown identical" in d.explanation
    assert main(["diff", "--kernel", "sglang-triton", "--kernel", "vllm-triton-mla", "--length", "32", "--heads",
                 "16", "--dist", "normal:1"]) == 4
    out = capsys.readouterr().out
    assert "lse  not compared: only B (vllm-triton-mla) returns it" in out and "nothing to explain" not in out


def test_a_modelled_kernel_takes_its_own_launch_in_the_diff():
    """``flashmla:num_sms=8`` against ``flashmla``: the same kernel on two SM counts differs in its schedule only."""
    d = kernel_diff("flashmla:num_sms=8", "flashmla", length=1024, heads=16)
    assert d.plans[0] != d.plans[1] and d.differing_steps == ["schedule"]
    assert d.explanation.startswith("the schedule") and d.request["num_sms"] == [8, 132]


@pytest.mark.parametrize("argv, message", [
    (["flashmla:bogus=1", "flashmla-etap"], "--kernel: 'flashmla:bogus=1': 'bogus=1' is not an option of flashmla"),
    (["flashmla:num_sms=x", "flashmla-etap"], "--kernel: 'flashmla:num_sms=x': num_sms takes an int, got 'x'"),
    (["flashmla:num_sms=0", "flashmla-etap"], "--kernel: 'flashmla:num_sms=0': num_sms: expected an int in"),
    (["flashmla:num_kv_splits=2", "flashmla-etap"], "is not an option of flashmla here; a modelled kernel takes "
                                                    "num_sms=N"),
    (["flashmla:num_sms=1000000000", "flashmla-etap"], "--kernel: 'flashmla:num_sms=1000000000': num_sms:"),
    (["sglang-triton:num_kv_splits=1000000000", "flashmla"], "--kernel: 'sglang-triton:num_kv_splits=1000000000'"),
    (["flashmla-sparse-fp8", "flashmla"], "--heads: the sparse decode takes 64 or 128 heads, got 16"),
    (["flashmla", "flashmla-etap", "--num-sms", "1000000000"], "--num-sms: 1000000000 SMs give"),
    (["flashmla", "flashmla-etap", "--heads", "1000000", "--max-memory", "1"], "--heads"),
    (["flashmla", "flashmla-etap", "--length", "1000000000", "--max-memory", "1"], "--length, --heads, --sq: the diff"),
    (["sglang-triton", "flashmla", "--sq", "2"], "--sq: sglang-triton takes one query a request"),
    (["flashmla", "flashmla-etap", "--dist", "nope"], "--dist: expected one of"),
    (["nope", "flashmla"], "--kernel: 'nope': algorithm: unknown algorithm 'nope'"),
    (["amla:bogus=1", "flashmla"], "--kernel: 'amla:bogus=1': option 'bogus=1' is not key=value"),
    (["flashmla", "flashmla"], "--kernel: the two kernels are the same"),
])
def test_the_diff_names_its_own_flags(no_work, capsys, argv, message):
    args = ["diff", "--kernel", argv[0], "--kernel", argv[1], "--length", "128", "--heads", "16", *argv[2:]]
    code, err = cli_error(args, capsys)
    assert code == 2 and message in err, err
    assert not any(f in err for f in ("--inputs", "--num-kv-splits", "--tokens", "--split-tokens")), err


# --- --inputs ----------------------------------------------------------------------------------------------------


def _request_file(path: Path, *, requests: int = 1, dtype=ml_dtypes.bfloat16, tokens: int = 64, heads: int = 16) -> Path:
    rng = np.random.default_rng(3)
    q = rng.standard_normal((requests, 1, heads, 576)).astype(dtype)
    kv = rng.standard_normal((requests, tokens, 576)).astype(dtype)
    np.savez(path, q=q[0] if requests == 1 else q, kv=kv[0] if requests == 1 else kv)
    return path


@pytest.mark.parametrize("kernel, extra, message", [
    ("flashmla", ["--length", "64"], "--inputs: the request is the file's (its length, heads and values); drop --length"),
    ("flashmla-sparse-fp8", ["--tokens", "64"], "--tokens: the request's cache is the inputs' kv (64 tokens)"),
    ("sglang-triton", ["--max-context-len", "32"], ": length, max_context_len: 64 tokens, past the model's context "
                                                   "length (32)"),
    ("flashmla", ["--format", "fp16"], "--format: not an option of flashmla"),
])
def test_every_flag_given_with_inputs_is_honoured_or_refused(no_work, tmp_path, capsys, kernel, extra, message):
    f = _request_file(tmp_path / "req.npz", heads=64)
    code, err = cli_error(["invariance", "--kernel", kernel, "--inputs", str(f), *extra], capsys)
    assert code == 2 and message in err and ("--inputs" in err or "--tokens" in err or "--format" in err), err


def test_a_file_of_two_requests_is_refused(no_work, tmp_path, capsys):
    f = _request_file(tmp_path / "two.npz", requests=2)
    code, err = cli_error(["invariance", "--kernel", "flashmla", "--inputs", str(f)], capsys)
    assert code == 2 and f"--inputs: {f}: one request" in err, err


def test_inputs_bits_are_read_in_the_format_asked(tmp_path, capsys):
    """``--format fp16`` reads a file's 16-bit words as FP16: the request the library gets from FP16 arrays."""
    f = _request_file(tmp_path / "req16.npz", dtype=np.float16)
    with np.load(f) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(tmp_path / "bits.npz", **{k: v.view(np.uint16) for k, v in arrays.items()})
    assert main(["invariance", "--kernel", "flashmla-etap", "--inputs", str(tmp_path / "bits.npz"), "--format",
                 "fp16", "--batchmates", "1", "--mixed", "0", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = invariance("flashmla-etap", inputs=arrays, batchmates=(1,), mixed=None).to_dict()
    assert got["request"]["format"] == "fp16" and got["results"] == want["results"]


# --- --replay ----------------------------------------------------------------------------------------------------


def _capture(path: Path, edit) -> Path:
    with np.load(CAPTURE) as z:
        arrays = {k: z[k] for k in z.files if k.startswith("sglang_")}
    edit(arrays)
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.pop("sglang_l3_out"), "holds no sglang_l3_out (launch 3, 'with 7 batchmates of its length')"),
    (lambda a: a.update(sglang_l0_out=a["sglang_l0_out"][:5]), "sglang_l0_out (launch 0, 'alone'): expected shape"),
    (lambda a: a.update(sglang_l1_out=a["sglang_l1_out"].astype(np.float64)),
     "sglang_l1_out (launch 1, 'with 1 batchmate of its length'): expected bf16 or its 16-bit words, got float64"),
    (lambda a: a.update(sglang_l2_out=a["sglang_l2_out"].view(np.uint8)), "sglang_l2_out (launch 2"),
    (lambda a: a.update(sglang_l0_out=np.array(["x"] * 3)), "sglang_l0_out (launch 0, 'alone'): expected bf16"),
])
def test_a_damaged_capture_names_the_file_and_the_launch(no_work, tmp_path, capsys, edit, message):
    path = _capture(tmp_path / "bad.npz", edit)
    code, err = cli_error(["invariance", "--kernel", "sglang-triton", "--replay", str(path)], capsys)
    assert code == 1 and f"--replay: {path}" in err and message in err, err


@pytest.mark.parametrize("content, message", [
    (b"", "is not a readable capture"), (b"not a zip", "is not a readable capture"), (None, "is not a file"),
    ("half", "is not a readable capture"),
])
def test_an_unreadable_capture_names_the_file(no_work, tmp_path, capsys, content, message):
    path = tmp_path / "cap.npz"
    if content == "half":
        content = CAPTURE.read_bytes()[:200_000]
    if content is not None:
        path.write_bytes(content)
    code, err = cli_error(["invariance", "--kernel", "sglang-triton", "--replay", str(path)], capsys)
    assert code == 1 and f"--replay: {path}" in err and message in err, err


@pytest.mark.parametrize("extra, message", [
    (["--length", "64"], "--replay: the device check fixes its request and launches; drop --length"),
    (["--kernel", "flashmla-etap"], "--kernel: the device check covers"),
])
def test_replay_takes_no_request_flags(no_work, capsys, extra, message):
    argv = ["invariance", "--kernel", "sglang-triton", "--replay", str(CAPTURE), *extra]
    code, err = cli_error(argv, capsys)
    assert code == 2 and message in err, err

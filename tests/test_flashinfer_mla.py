"""FlashInfer 0.7.2's sm90 MLA decode (``BatchMLAPagedAttentionWrapper``, backend fa3): the model on the golden and
IEEE FP32 machines against float64 attention; the plan against ``MLAPlan`` compiled from the release's source on
the host; each modelled choice shown to be a switch that changes bits. No device capture is checked here yet: the
model is not claimed bit-exact."""

from __future__ import annotations

import importlib
import tracemalloc
import zlib

import numpy as np
import pytest

from amla_sim.algorithms import golden
from amla_sim.algorithms.deployed import row_sums, scalars
from amla_sim.algorithms.deployed.flashinfer import flashinfer_mla, flashinfer_mla_decode, flashinfer_mla_plan
from amla_sim.algorithms.deployed.flashinfer import scheduler
from amla_sim.experiments.inputs import make_inputs
from amla_sim.formats import round_to
from amla_sim.machines import get_machine
from amla_sim.units import DivUnit, ExpUnit, FMAUnit, LogUnit

mla = importlib.import_module("amla_sim.algorithms.deployed.flashinfer.mla")  # the module, not the function
LN2 = float(np.log(2.0))


def _api(scale: float) -> float:
    return float(np.float32(scale))  # the kernel's float sm_scale


# --- the model against float64 attention --------------------------------------------------------------------

# (format, s_q, heads, seqlens, num_sms, causal): splits into chunks of 32 keys and a request of none; a causal
# MTP step over clusters of two CTAs, split; one chunk of 4 tiles (one cluster of two SMs)
CASES = [("bf16", 1, 16, (700, 130, 0), 132, False), ("fp16", 2, 64, (300, 65), 8, True),
         ("bf16", 1, 128, (200,), 2, False)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("machine", ["golden", "ieee32"])
def test_against_float64_attention(machine, case):
    """Golden: the mathematics (1e-12). IEEE FP32: the output is rounded to its format three ways (P, the split
    partials, the output), each a rounding to the same format, the first two averaged over at least 32 keys: the
    error stays below twice the output's own rounding error; the LSE, kept in FP32 throughout, within 1e-5."""
    fmt, s_q, H, lens, sms, causal = CASES[case]
    q, kv = make_inputs("normal:1", batch=len(lens), sq=s_q, heads=H, context=max(lens), seed=7 + case, fmt=fmt)
    res = flashinfer_mla(q, kv, seqlens=np.array(lens), causal=causal, num_sms=sms, machine=machine)
    assert res.out.dtype == (np.float64 if machine == "golden" else q.dtype) and res.lse.shape == (len(lens) * s_q, H)
    lse = res.lse.reshape(len(lens), s_q, H) * LN2  # base 2 as the wrapper returns it
    for i, n in enumerate(lens):
        if n == 0:  # no keys: the kernel writes 0 and -inf
            assert not res.out[i].any() and np.isneginf(lse[i]).all()
            continue
        ref = golden(q[i:i + 1], kv[i:i + 1, :n], scale=_api(576**-0.5))
        err = np.linalg.norm(res.out[i:i + 1].astype(np.float64) - ref.out) / np.linalg.norm(ref.out)
        if machine == "golden":
            assert err < 1e-12, err
            np.testing.assert_allclose(lse[i], ref.lse[0], rtol=1e-12)
        else:
            own = np.linalg.norm(round_to(ref.out, fmt).astype(np.float64) - ref.out) / np.linalg.norm(ref.out)
            assert err < 2 * own, (err, own)
            np.testing.assert_allclose(lse[i], ref.lse[0], rtol=0, atol=1e-5)


def _fp8_cache(fmt_seed: int = 3):
    q, kv = make_inputs("normal:1", batch=2, heads=16, context=300, seed=fmt_seed)
    ckv, kpe = 0.0371, 0.0113  # neither is a BF16 number
    kv8 = np.concatenate([round_to(kv[..., :512].astype(np.float64) / ckv * 0.05, "e4m3"),
                          round_to(kv[..., 512:].astype(np.float64) / kpe * 0.05, "e4m3")], axis=-1)
    return q, kv8, ckv, kpe


def _dequantised(kv8: np.ndarray, ckv: float, kpe: float, bf16_scale: bool = True) -> np.ndarray:
    """An independent recipe: bf16(e4m3 * bf16(fl32(scale))) (fl32 only, unrounded to BF16, if not bf16_scale)."""
    def s(x):
        x = float(np.float32(x))
        return float(round_to(np.array(x), "bf16")) if bf16_scale else x

    x = kv8.astype(np.float64)
    return round_to(np.concatenate([x[..., :512] * s(ckv), x[..., 512:] * s(kpe)], axis=-1), "bf16")


@pytest.mark.parametrize("machine", ["golden", "ieee32"])
def test_fp8_cache_against_float64_attention(machine):
    """An E4M3 cache with per-tensor scales: golden is attention over ``e4m3 * scale``; IEEE FP32 over the cache
    dequantised as the kernel does it (the scale rounded to BF16, the product too), within the bound above."""
    q, kv8, ckv, kpe = _fp8_cache()
    res = flashinfer_mla(q, kv8, seqlens=[300, 170], ckv_scale=ckv, kpe_scale=kpe, num_sms=4, machine=machine)
    x = kv8.astype(np.float64)
    exact = np.concatenate([x[..., :512] * _api(ckv), x[..., 512:] * _api(kpe)], axis=-1)
    ref_kv = exact if machine == "golden" else _dequantised(kv8, ckv, kpe)
    for i, n in enumerate((300, 170)):
        ref = golden(q[i:i + 1], ref_kv[i:i + 1, :n].astype(np.float64), scale=_api(576**-0.5))
        err = np.linalg.norm(res.out[i:i + 1].astype(np.float64) - ref.out) / np.linalg.norm(ref.out)
        own = np.linalg.norm(round_to(ref.out, "bf16").astype(np.float64) - ref.out) / np.linalg.norm(ref.out)
        assert err < (1e-12 if machine == "golden" else 2 * own), err


def test_fp8_dequant_is_the_recipe():
    """The dequantisation bit for bit: per-tensor ``bf16(e4m3 * bf16(scale))``; per-token FP32 scales
    ``bf16(fl32(e4m3 * s))``; the BF16 rounding of the scale changes values."""
    _, kv8, ckv, kpe = _fp8_cache()
    mc = get_machine("sm90-cuda")
    got = mla._dequant(mc, kv8[0], scalars.api_float(ckv, "c"), scalars.api_float(kpe, "k"), None)
    want = _dequantised(kv8[0], ckv, kpe)
    np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert (want != _dequantised(kv8[0], ckv, kpe, bf16_scale=False)).any()
    arr = np.random.default_rng(0).uniform(0.01, 0.05, (300, 4)).astype(np.float32)
    got = mla._dequant(mc, kv8[0], np.float32(1), scalars.api_float(kpe, "k"), arr)
    nope = round_to((kv8[0, :, :512].astype(np.float32) * np.repeat(arr, 128, axis=1)).astype(np.float64), "bf16")
    np.testing.assert_array_equal(got[:, :512].astype(np.float32), nope.astype(np.float32))


def test_an_empty_request_and_the_lse_bases():
    q, kv = make_inputs("normal:1", batch=2, heads=16, context=100, seed=4)
    two = flashinfer_mla(q, kv, seqlens=[100, 0], machine="ieee32")
    e = flashinfer_mla(q, kv, seqlens=[100, 0], machine="ieee32", return_lse_base_on_e=True)
    np.testing.assert_array_equal(e.out.view(np.uint16), two.out.view(np.uint16))
    np.testing.assert_array_equal(e.lse, (two.lse * np.float32(LN2)).astype(np.float32))  # fl(lse * loge2)
    assert not two.out[1].any() and np.isneginf(two.lse[1]).all()


# --- how the kernel's arithmetic differs from FA3's ---------------------------------------------------------


def test_o_scale_is_not_one_where_the_max_stays():
    """``ex2(fma(m, c, -fl(m c)))``: 2 to the rounding error of fl(m c), which MUFU.EX2 can read as less than 1
    (FA3's ``exp2(fl(fl(M - M) c))`` is exactly 1)."""
    mc = get_machine("sm90-cuda")
    u = mla._Units(mc, "bf16", scalars.api_float(0.1352, "scale"))
    m = np.linspace(1, 40, 4001).astype(np.float32)
    s = mla._o_scale(u, m, m, np.fmax(mc.f(m * u.c), u.neg_max))
    assert (s == 1).any() and (s < 1).any() and (s > 0.99999).all()
    assert mla._o_scale(u, np.float32([-np.inf]), np.float32([3]), mc.f(np.float32([3]) * u.c))[0] == 0


def test_rows_meet_only_through_the_plan():
    """A request's rows never meet another's: in a batch of two like requests on 132 SMs it is the request alone
    on 66 (the same chunks of 64 keys); alone on 132 its chunks are 32 keys long and other bits come out."""
    q, kv = make_inputs("normal:1", batch=1, heads=16, context=600, seed=5)
    both = flashinfer_mla(np.concatenate([q, q]), np.concatenate([kv, kv]), num_sms=132, trace=True)
    alone = flashinfer_mla(q, kv, num_sms=66, trace=True)
    assert both.trace["mla_plan"][0].kv_len_limit == alone.trace["mla_plan"][0].kv_len_limit == 64
    np.testing.assert_array_equal(both.out[:1].view(np.uint16), alone.out.view(np.uint16))
    np.testing.assert_array_equal(both.lse[:1].view(np.uint32), alone.lse.view(np.uint32))
    assert both.trace["plan"].shape == (18,) and both.trace["plan"].tolist() == list(both.trace["mla_plan"][0].info)
    other = flashinfer_mla(q, kv, num_sms=132, trace=True)
    assert other.trace["mla_plan"][0].kv_len_limit == 32
    assert (other.out.view(np.uint16) != alone.out.view(np.uint16)).any()


# --- the plan -----------------------------------------------------------------------------------------------

ORDER = ("work_indptr", "q_indptr", "kv_indptr", "partial_indptr", "merge_packed_offset_start",
         "merge_packed_offset_end", "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
         "merge_partial_stride", "q_len", "kv_len", "q_start", "kv_start", "kv_end")
_OFFSETS = [0, 65536, 131072, 196608, 197136, 197664, 198192, 198720, 199248, 264784, 330320, 395856, 461392,
            526928, 0, 17301504]
# MLAPlan of flashinfer-python 0.7.2 (scheduler.cuh) compiled with nvcc 13.0 / g++ on the host, the SM count stubbed:
# its 18 MLAPlanInfo values and the CRC-32 of its 14 staged int32 arrays (as int64, in ORDER); kv_indptr = the
# running sum of seqlens (pages of one token)
MLAPLAN = [
    (([4096], 128, 1, False), 132, [2, 66] + _OFFSETS, 1620906410),
    (([1, 63, 64, 65, 700, 2500, 4097, 129], 128, 1, False), 132, [2, 66] + _OFFSETS, 84915962),
    (([512, 0, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000], 16, 1, False), 132,
     [1, 132] + _OFFSETS, 1548323027),
    (([1025, 4097], 128, 2, True), 132, [2, 66] + _OFFSETS, 3336060747),
    (([700, 9000, 33], 16, 4, True), 132, [1, 132] + _OFFSETS, 3541857789),
    (([16000] * 3, 64, 1, False), 78, [1, 78, 0, 65536, 131072, 196608, 196928, 197248, 197568, 197888, 198208,
                                        263744, 329280, 394816, 460352, 525888, 0, 10223616], 1448408102),
]


@pytest.mark.parametrize("case", range(len(MLAPLAN)))
def test_the_plan_is_mlaplans(case):
    (lens, H, s_q, causal), sms, info, crc = MLAPLAN[case]
    p = flashinfer_mla_plan(lens, heads=H, q_lens=s_q, causal=causal, num_sms=sms)
    assert list(p.info) == info
    a = p.arrays()
    assert zlib.crc32(np.concatenate([a[k] for k in ORDER]).astype(np.int64).tobytes()) == crc


def _check_plan(p, lens, q_lens, H, causal, sms):
    cs = 2 if sum(q * H for q in q_lens) // len(lens) > 64 else 1
    ctq = 64 * cs
    assert p.cluster_size == cs and p.info[:2] == (cs, sms // cs) and len(p.work_indptr) == sms // cs + 1
    remaining = {}
    for i, (q, n) in enumerate(zip(q_lens, lens)):
        tiles = -(-q * H // ctq)
        for t in range(tiles):
            remaining[i, t] = n if not causal or t == tiles - 1 else \
                max(min(n - q + -(-(t + 1) * ctq // H), n), 0)
    x = -(-sum(remaining.values()) // (sms // cs))
    assert p.kv_len_limit == ([lim for b, lim in ((8, 32), (16, 64), (32, 128), (64, 192)) if x <= b] +
                              [-(-x // 256) * 256])[0]
    assert {(t.request, t.tile): t.remaining_len for t in p.tiles} == remaining
    works = set(zip(p.q_indptr.tolist(), p.q_start.tolist(), p.kv_start.tolist(), p.kv_end.tolist()))
    assert len(works) == p.num_works == sum(len(t.chunks) for t in p.tiles)
    rows_merged = []
    for t in p.tiles:
        ends = [0] + [hi for _, hi in t.chunks]
        assert [lo for lo, _ in t.chunks] == ends[:-1] and ends[-1] == t.remaining_len  # every key once, in order
        assert all(hi - lo <= p.kv_len_limit for lo, hi in t.chunks)
        assert t.split == (t.remaining_len > p.kv_len_limit) and len(t.chunks) == max(1, -(-t.remaining_len //
                                                                                        p.kv_len_limit))
        assert all((q_lens[t.request] and sum(q_lens[:t.request]), t.row_start, lo, hi) in works
                   or (sum(q_lens[:t.request]), t.row_start, lo, hi) in works for lo, hi in t.chunks)
        if t.split:
            base = sum(q_lens[:t.request]) * H + t.row_start
            rows_merged += list(range(base, base + t.row_stop - t.row_start))
    m = p.merge_packed_offset_start, p.merge_packed_offset_end
    merged = [r for s, e in zip(*m) for r in range(s, e)]
    assert sorted(merged) == sorted(rows_merged)  # every split row merged once
    parts = p.partial_indptr[p.partial_indptr >= 0]
    assert len(set(parts.tolist())) == len(parts)
    cost = np.zeros(sms // cs)
    for c in range(sms // cs):
        w = slice(p.work_indptr[c], p.work_indptr[c + 1])
        cost[c] = sum(2 * ctq + e - s for s, e in zip(p.kv_start[w], p.kv_end[w]))
    assert cost.max() - cost.min() <= 2 * ctq + p.kv_len_limit  # each chunk went to the least loaded cluster


@pytest.mark.parametrize("seed", range(12))
def test_plan_invariants(seed):
    """Every key of every query tile in exactly one chunk, chunks in KV order of at most kv_len_limit keys, a tile
    split iff it has more, every split row merged once, the clusters balanced within one chunk."""
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 30))
    H = int(rng.choice([8, 16, 32, 64, 128]))
    s_q = int(rng.choice([1, 1, 2, 4]))
    causal = s_q > 1 and bool(rng.integers(0, 2))
    lens = rng.integers(s_q if causal else 0, int(rng.choice([100, 3000, 40000])), b).tolist()
    sms = int(rng.choice([132, 78, 5]))
    p = flashinfer_mla_plan(lens, heads=H, q_lens=s_q, causal=causal, num_sms=sms)
    _check_plan(p, lens, [s_q] * b, H, causal, sms)


def test_plan_refusals():
    with pytest.raises(ValueError, match="^seqlens: .*drop key 64"):  # 48 heads: a tile of 128 rows ends mid-query
        flashinfer_mla_plan([65], heads=48, q_lens=3, causal=True)
    flashinfer_mla_plan([66], heads=48, q_lens=3, causal=True)
    with pytest.raises(ValueError, match="^seqlens, q_lens, heads: 17000 requests in 17000 query tiles"):
        flashinfer_mla_plan([1] * 17000, heads=128)
    with pytest.raises(ValueError, match="^seqlens, num_sms: the plan needs 16385 work items in chunks of 32"):
        flashinfer_mla_plan([32 * 16385], heads=16, num_sms=389936)
    for kwargs, name in (({"heads": 0}, "heads"), ({"heads": 16, "num_sms": 0}, "num_sms"),
                         ({"heads": 16, "q_lens": [1, 1]}, "q_lens"), ({"heads": 16, "page_size": 0}, "page_size")):
        with pytest.raises((ValueError, TypeError), match=name):
            flashinfer_mla_plan([10], **kwargs)


def _peak_bytes(fn) -> int:
    """The most memory `fn` holds at once (tracemalloc), whatever it raises."""
    tracemalloc.start()
    try:
        fn()
    except ValueError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


_BF16_Q, _BF16_KV = (round_to(np.zeros(s, np.float32), "bf16") for s in ((1, 1, 16, 576), (1, 8, 576)))


@pytest.mark.parametrize("call, match", [
    (lambda: flashinfer_mla_plan([256], heads=16, num_sms=10**7), "^num_sms: 10000000 SMs stage .* int workspace"),
    (lambda: flashinfer_mla_plan([256], heads=16, num_sms=389937), "^num_sms: 389937 SMs .*at most 389936 SMs"),
    (lambda: flashinfer_mla(_BF16_Q, _BF16_KV, num_sms=10**9), "^num_sms: "),
    (lambda: flashinfer_mla(_BF16_Q, _BF16_KV, plan_seqlens=[10**7], kv_len_limit=1),
     "^kv_len_limit: the plan needs 10000000 work items"),
    (lambda: flashinfer_mla_plan([1] * 20000, heads=16, q_lens=10**6), "^seqlens, q_lens, heads: 20000 requests"),
])
def test_a_plan_too_large_is_refused_before_it_is_built(call, match):
    """The SM count (the wrapper's 8 MiB int workspace), the query tiles and the work items are checked from the
    lengths before anything is sized by them or walked: each refusal holds a few MB at most."""
    with pytest.raises(ValueError, match=match):
        call()
    assert _peak_bytes(call) < 8 << 20


def test_padded_rows_move_the_cluster_size_only():
    """A batch padded with 10^12 empty requests is planned as fast as one padded with 8: the pads count in the
    cluster size's mean and nowhere else."""
    p = flashinfer_mla_plan([300], heads=128, q_lens=1, empty_requests=10**12)
    assert p.cluster_size == 1 and flashinfer_mla_plan([300], heads=128, q_lens=1).cluster_size == 2
    flashinfer_mla(_BF16_Q, _BF16_KV)  # the machine's tables loaded once, before the measure (run alone, too)
    assert _peak_bytes(lambda: flashinfer_mla(_BF16_Q, _BF16_KV, pad_rows=10**12)) < 8 << 20
    check = scheduler.check_num_sms
    assert check(389936, 1) == 389936 and check(132, 2) == 66


def test_the_heap_breaks_ties_as_libstdcxx():
    """Five clusters of equal cost: libstdc++'s pop_heap/push_heap hand them out in this order (a C++ run of
    heap.h's MinHeap with these costs)."""
    h = scheduler._MinHeap(5)
    got = []
    for add in (128, 128, 192, 128, 128, 128, 256, 128):
        c, cost = h.pop()
        got.append(c)
        h.insert((c, np.float32(cost + add)))
    assert got == [0, 2, 4, 1, 3, 0, 1, 3]


# --- each modelled choice is a switch that changes bits -----------------------------------------------------


def _o_scale_as_fa3(u, m_prev, m, ms):
    cur = np.where(np.isneginf(m), 0, m).astype(u.dt)
    return np.where(np.isneginf(m_prev), 0, u.mc.exp2(u.mc.f(u.mc.f(m_prev - cur) * u.c))).astype(u.dt)


def _lane_sums_as_fa3(mc, lanes, s, P):
    return row_sums.lane_sums(mc, lanes, s, P)


def _scores_nope_first(u, Q, Ks):
    mc = u.mc
    KT, Qm = mc.operand(np.ascontiguousarray(Ks.T)), mc.operand(Q)
    return mc.f(mc.matmul(Qm[:, 512:], KT[512:], mc.matmul(Qm[:, :512], KT[:512])))


CHOICES = {  # name: (module, attribute, replacement) or machine units
    "o-scale-as-fa3": (mla, "_o_scale", _o_scale_as_fa3),
    "fp32-partials": (mla, "_partial", lambda u, O: O),
    "lse-contracted": (mla, "_split_lse", lambda u, m, d: np.where(np.isneginf(m), -np.inf, u.mc.mul_add(
        m, u.c, u.mc.log2(d))).astype(u.dt)),
    "merge-other-product-fused": (mla, "_merge_o", lambda mc, o, f1, O, f2: mc.mul_add(O, f2[:, None],
                                                                                    mc.f(o * f1[:, None]))),
    "lane-sums-as-fa3": (mla, "_lane_sums", _lane_sums_as_fa3),
    "scale-log2-in-double": (mla, "_scale_log2", scalars.scale_log2),
    "nope-first": (mla, "_scores", _scores_nope_first),
    "ieee-exp2": {"exponential": ExpUnit("correctly-rounded")},
    "ieee-log2": {"logarithm": LogUnit(ln=None, lg2="correctly-rounded")},
    "no-fma": {"fma": FMAUnit(contract=False)},
}


def _switch_case():
    """8 heads, 600 and 250 keys on 4 SMs: request 0 in three chunks of at most 256 keys (merged), request 1 in one
    of four tiles; scale 0.07, whose FP32 product with log2 e is not its double one."""
    q, kv = make_inputs("normal:1", batch=2, heads=8, context=600, seed=11)
    return dict(q=q, kv=kv, seqlens=[600, 250], num_sms=4, scale=0.07)


@pytest.fixture(scope="module")
def baseline():
    return flashinfer_mla(**_switch_case())


@pytest.mark.parametrize("change", sorted(CHOICES))
def test_each_choice_is_a_switch_that_changes_bits(change, baseline, monkeypatch, fastest_engine):
    swap = CHOICES[change]
    units = swap if isinstance(swap, dict) else {}
    if not units:
        monkeypatch.setattr(*swap)
    res = flashinfer_mla(**_switch_case(), machine=get_machine("sm90-cuda", **units))
    same = (np.mean(res.out.view(np.uint16) == baseline.out.view(np.uint16)),
            np.mean(res.lse.view(np.uint32) == baseline.lse.view(np.uint32)))
    assert min(same) < 1, same


def test_the_reciprocal_is_a_switch():
    """``rcp.approx`` against IEEE division: the FP32 O a work item normalises differs (an ULP of FP32 crosses a
    BF16 rounding boundary in about one element of 2^16, so the outputs above rarely show it)."""
    q, kv = make_inputs("normal:1", batch=1, heads=64, context=128, seed=12)
    outs = []
    for mc in (get_machine("sm90-cuda"), get_machine("sm90-cuda", division=DivUnit("ieee"))):
        u = mla._Units(mc, "bf16", scalars.softmax_scale(None))
        Q, K = mc.cast(q[0, 0], "bf16"), mc.cast(kv[0], "bf16")
        outs.append(mla._chunk(u, Q, K, 128, 0, 128, 128, np.full(64, 127))[0])
    assert (outs[0] != outs[1]).any()


def test_the_fp8_scale_rounding_is_a_switch(monkeypatch):
    q, kv8, ckv, kpe = _fp8_cache()
    kw = dict(seqlens=[300, 170], ckv_scale=ckv, kpe_scale=kpe, num_sms=4)
    base = flashinfer_mla(q, kv8, **kw)
    monkeypatch.setattr(mla, "_dequant", lambda mc, kv, c, k, arr: mc.cast(np.concatenate(
        [mc.f(kv)[:, :512] * mc.f(c), mc.f(kv)[:, 512:] * mc.f(k)], axis=1), "bf16"))
    assert (flashinfer_mla(q, kv8, **kw).out.view(np.uint16) != base.out.view(np.uint16)).any()


# --- the sweep entry, bad input -----------------------------------------------------------------------------


def test_the_sweep_entry():
    q, kv = make_inputs("normal:1", batch=1, sq=2, heads=16, context=256, seed=2)
    res = flashinfer_mla_decode(q, kv, machine="ieee32")
    direct = flashinfer_mla(q, kv, causal=True, return_lse_base_on_e=True, machine="ieee32")
    np.testing.assert_array_equal(res.out.view(np.uint16), direct.out.view(np.uint16))
    np.testing.assert_array_equal(res.lse, direct.lse.reshape(1, 2, 16))
    ref = golden(q, kv, scale=_api(576**-0.5))  # causal, bottom-right
    np.testing.assert_allclose(res.lse, ref.lse, atol=1e-5)
    with pytest.raises(ValueError, match="block"):
        flashinfer_mla_decode(q, kv, block=128)


@pytest.mark.parametrize("kwargs, name", [
    ({"seqlens": [-1]}, "seqlens"), ({"scale": float("nan")}, "scale"), ({"causal": "yes"}, "causal"),
    ({"num_sms": 0}, "num_sms"), ({"page_size": 0}, "page_size"), ({"machine": "b200"}, "machine"),
    ({"machine": "sm90-triton"}, "machine"), ({"return_lse_base_on_e": 1}, "return_lse_base_on_e"),
    ({"ckv_scale": 0.5}, "ckv_scale"), ({"kpe_scale": 0.5}, "kpe_scale"),
])
def test_bad_input_names_the_argument(kwargs, name):
    q, kv = make_inputs("normal:1", heads=16, context=64)
    with pytest.raises((ValueError, TypeError), match=f"^{name}"):
        flashinfer_mla(q, kv, **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    ({}, "ckv_scale"), ({"ckv_scale": 0.5}, "kpe_scale"),
    ({"ckv_scale": 0.5, "kpe_scale": 0.5, "ckv_scale_arr": np.ones((1, 64, 4), np.float32)}, "ckv_scale"),
    ({"kpe_scale": 0.5, "ckv_scale_arr": np.ones((1, 64, 2), np.float32)}, "ckv_scale_arr"),
    ({"kpe_scale": 0.5, "ckv_scale_arr": np.ones((1, 64, 4))}, "ckv_scale_arr"),
    ({"ckv_scale": 0.0, "kpe_scale": 0.5}, "ckv_scale: must be a finite positive value"),
    ({"ckv_scale": 0.5, "kpe_scale": np.inf}, "kpe_scale: must be a finite positive value"),
    ({"ckv_scale": -1e-300, "kpe_scale": 0.5}, "ckv_scale: must be a finite positive value"),
])
def test_fp8_scales_are_checked(kwargs, name):
    q, kv = make_inputs("normal:1", heads=16, context=64)
    with pytest.raises(ValueError, match=f"^{name}"):
        flashinfer_mla(q, round_to(kv.astype(np.float64), "e4m3"), **kwargs)


def test_formats_and_shapes_the_kernel_does_not_take_are_refused():
    q, kv = make_inputs("normal:1", heads=16, context=64)
    with pytest.raises(TypeError, match="^q"):
        flashinfer_mla(round_to(q.astype(np.float64), "e4m3"), kv)
    with pytest.raises(TypeError, match="^kv"):
        flashinfer_mla(q, round_to(kv.astype(np.float64), "fp16"))
    with pytest.raises(TypeError, match="^kv"):  # an E4M3 cache takes a BF16 q only
        flashinfer_mla(round_to(q.astype(np.float64), "fp16"), round_to(kv.astype(np.float64), "e4m3"),
                       ckv_scale=1.0, kpe_scale=1.0)
    with pytest.raises(ValueError, match="^q"):
        flashinfer_mla(q[..., :192], kv)
    q2, kv2 = make_inputs("normal:1", sq=2, heads=16, context=64)
    with pytest.raises(ValueError, match="^seqlens"):  # a request longer than the cache
        flashinfer_mla(q2, kv2, seqlens=[65], causal=True)


@pytest.mark.parametrize("argv, flag", [
    (["invariance", "--kernel", "flashinfer-mla", "--length", "256", "--heads", "16", "--num-sms", "1000000000"],
     "--num-sms"),
    (["run", "--algorithm", "flashinfer-mla:num_sms=1000000000", "--context", "256", "--heads", "16"], "num_sms"),
    (["diff", "--kernel", "flashinfer-mla:num_sms=1000000000", "--kernel", "flashinfer-mla", "--length", "256",
      "--heads", "16"], "num_sms"),
    (["sweep", "--algorithms", "flashinfer-mla:num_sms=1000000000", "--contexts", "256", "--heads", "16"], "num_sms"),
])
def test_commands_refuse_an_sm_count_the_plan_cannot_stage(argv, flag, capsys, tmp_path):
    """Each command names the SM count (no out-of-memory, no hint at other flags) before any plan is built."""
    from amla_sim.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv + (["--out", str(tmp_path / "s")] if argv[0] == "sweep" else []))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag}: 1000000000 SMs stage" in err and "memory" not in err, err


@pytest.mark.parametrize("heads", [1, 129])
def test_the_numba_engine_takes_any_head_count_quietly(heads):
    """One and 129 heads (no multiple of a tile) broadcast the row statistics: the numba engine gives NumPy's bits
    and warns of nothing (numba reading a broadcast view's flags did)."""
    import warnings

    pytest.importorskip("numba")
    from amla_sim.engine import use_engine

    rng = np.random.default_rng(heads)
    q = round_to(rng.normal(size=(1, 1, heads, 576)).astype(np.float32), "bf16")
    kv = round_to(rng.normal(size=(1, 100, 576)).astype(np.float32), "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_engine("numba"):
            fast = flashinfer_mla(q, kv)
    with use_engine("numpy"):
        slow = flashinfer_mla(q, kv)
    np.testing.assert_array_equal(fast.out.view(np.uint16), slow.out.view(np.uint16))
    np.testing.assert_array_equal(fast.lse.view(np.uint32), slow.lse.view(np.uint32))

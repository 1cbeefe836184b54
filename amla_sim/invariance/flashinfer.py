"""FlashInfer's MLA decode on Hopper in the invariance study (``flashinfer-mla``), as SGLang's ``flashinfer`` MLA
backend calls it: BF16, pages of one token, causal for a multi-token step (s_q > 1), not for a decode.

FlashInfer's plan (``MLAPlan``, :mod:`~amla_sim.algorithms.deployed.flashinfer.scheduler`) cuts the KV of every
query tile of every request into chunks of one length, ``kv_len_limit``: 32, 64, 128, 192 or a multiple of 256,
from ``ceil(total / clusters)``, where total is the launch's KV (every request's length, or each query tile's causal
end when s_q > 1) and the clusters are the SMs in clusters of one CTA, or of two where s_q x heads is over 64. A
tile with more KV than that writes BF16 partials, merged in chunk order. Rows of different requests never meet and
a request's chunks follow from its own length and the chunk length: of its batchmates, a request's bits see only
the launch's total KV, through the chunk length (not how many they are, their order, or where the request sits).
The model runs the request alone with the launch's chunk length
(:func:`~amla_sim.algorithms.deployed.flashinfer.flashinfer_mla`'s ``kv_len_limit``).

Its bounds, checked before any plan, are those of FlashInfer's fa3 preflight (a plan it refuses runs FlashInfer's
fa2 kernel under ``backend="auto"``, which is not modelled): at most 16384 work items and no causal tile boundary
that drops a key; and an SM count whose plan the wrapper's int workspace holds. FlashInfer's MLA
plan takes no split size, so it has no batch-invariant mode; the study's what-if hands the model a fixed chunk
length instead.

The device check (:data:`FLASHINFER_CHECK`, :func:`flashinfer_launches`) is what ``scripts/capture_invariance.py
--kernels flashinfer-mla`` runs on a GPU; :func:`replay_flashinfer` replays its capture.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.fast_math import ln2
from ..algorithms.deployed.flashinfer.mla import FLASHINFER_VERSION, flashinfer_mla
from ..algorithms.deployed.flashinfer.scheduler import (CTA_TILE_Q, MAX_WORKS, FlashInferPlan, causal_kv_end,
                                                        check_causal_tile_bound, check_num_sms, cluster_size,
                                                        flashinfer_mla_plan, kv_len_limit)
from ..comparison import ComparisonReport, compare
from ..formats import get_format
from ..machines import get_machine
from .kernel import RCP_NORMALISE, DenseDecode, Plan, Request, query_rows
from .launches import Launch

__all__ = ["FlashInferMLA", "FLASHINFER_CHECK", "flashinfer_launches", "replay_flashinfer", "CAPTURE_PREFIX"]

_REFUSED = "the wrapper refuses the plan (backend='auto' then runs FlashInfer's fa2 kernel, not modelled)"


def _shape(launch: Launch, heads: int) -> tuple[int, int, int, int]:
    """(cluster size, clusters, cluster tile rows, query tiles a request) of `launch`: every request has s_q
    queries, so the batch's mean packed query length is s_q x heads."""
    cs = cluster_size([launch.s_q], heads)
    ctq = cs * CTA_TILE_Q
    return cs, launch.num_sms // cs, ctq, -(-launch.s_q * heads // ctq)


def _tile_ends(n: int, s_q: int, heads: int, ctq: int, tiles: int) -> list[int]:
    """The KV each query tile of a request of `n` keys covers (its causal end when s_q > 1), last tile first."""
    if s_q == 1:
        return [n] * tiles
    return [causal_kv_end(s_q, n, t, ctq, tiles, heads) for t in range(tiles - 1, -1, -1)]


def _cut(n: int, limit: int) -> Plan:
    """A tile's chunks: `limit` keys each from 0, the last shorter."""
    return [(a, min(a + limit, n)) for a in range(0, n, limit)] or [(0, 0)]


class FlashInferMLA(DenseDecode):
    """FlashInfer's MLA decode, SGLang's call: every chunk of every request as long as the launch's KV makes it."""

    name = "flashinfer-mla"
    summary = (f"FlashInfer {FLASHINFER_VERSION}'s MLA decode on Hopper (SGLang's flashinfer backend), SGLang's "
               "call")
    row_tile = CTA_TILE_Q
    stages = {"out": "bf16", "lse": "fp32"}  # the LSE natural, as the wrapper returns it with lse_mode "basee"
    what_if = ("none in FlashInfer (its MLA plan takes no split size): the model handed a fixed chunk length, "
               "kv_len_limit = split_tokens ('one': one chunk a request), whoever shares the launch")
    numerics = {
        "keys": ("bf16", "BF16 (SGLang's cache; the model also takes an E4M3 cache, dequantised to BF16)"),
        "schedule": ("flashinfer-mla-plan", "MLAPlan: each query tile's KV in chunks of kv_len_limit keys from 0, "
                                            "kv_len_limit (32, 64, 128, 192 or a multiple of 256) from ceil(the "
                                            "launch's total KV / clusters); tiles of 64 rows, 128 (a cluster of 2 "
                                            "CTAs) where s_q x heads is over 64"),
        "scores": ("wgmma rope + nope", "wgmma m64n64k16: Q_pe K_pe^T (k 512..575), then += Q_nope CKV^T (k "
                                        "0..511) in one accumulator, 64-key tiles from the chunk's start walked last "
                                        "to first"),
        "max": ("raw scores", "running max of the raw scores, scaled after (fl(M c), at least -FLT_MAX)"),
        "exp": ("ex2(fma(S, c, -fl(M c))), c fp32, rescale ex2(fma(M_prev, c, -fl(M c)))",
                "ex2.approx.ftz of fma(S, c, -fl(M c)), c = fl(fl32(scale) fl32(log2 e)) (an FP32 product); O and "
                "the row sums rescaled by ex2(fma(M_prev, c, -fl(M c))), 2 to the rounding error of fl(M c) where "
                "the max stays, not 1"),
        "P": ("bf16", "BF16 (__float22bfloat162_rn), one rounding for both warpgroups"),
        "row sum": ("4 lanes: pairs in order, fma(d, s, local)", "4 lanes a row: lane t adds its pairs (8k + 2t, "
                                                                "8k + 2t + 1) in k order, then d = fma(d, s, that) "
                                                                "from d = 1; the lanes met (d0 + d2) + (d1 + d3)"),
        "normalise": RCP_NORMALISE,
        "LSE": ("lg2 L + fl(M c), times fl32(ln 2)", "lg2.approx(L) + fl(M c), base 2, no fma; the natural log "
                                                    "fl(that fl32(ln 2)) (lse_mode 'basee'), as the study compares"),
        "combine": ("flashinfer-merge", "a tile's chunks in order, each a BF16 partial and an FP32 base-2 LSE: m' = "
                                        "max(m, lse_k), f1 = ex2(m - m'), f2 = ex2(lse_k - m'), d = fma(d, f1, f2), "
                                        "o = fma(f1, o, fl(f2 o_k)); out = o rcp(d), lse = m + lg2(d)"),
    }

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        cs, clusters, ctq, tiles = _shape(launch, heads)
        if clusters < 1:
            raise ValueError(f"num_sms: {launch.num_sms} SM holds no cluster of {cs} CTAs (FlashInfer pairs CTAs "
                             f"where s_q x heads, {launch.s_q * heads}, is over 64)")
        check_num_sms(launch.num_sms, cs)
        many = "batchmates, s_q, heads" if launch.batch > 1 else "s_q, heads"
        if tiles * launch.batch > MAX_WORKS:  # each query tile a work item at least
            raise ValueError(f"{many}: {launch.batch} request{'s' * (launch.batch > 1)} of {tiles} query "
                             f"tile{'s' * (tiles > 1)} of {ctq} rows, more work items than FlashInfer's fa3 MLA holds "
                             f"({MAX_WORKS}): {_REFUSED}")
        if launch.s_q > 1:
            try:
                check_causal_tile_bound([launch.s_q] * launch.batch, launch.lengths, heads, ctq)
            except ValueError as e:
                raise ValueError(f"heads, s_q: {str(e).removeprefix('seqlens: ')}") from None
        ends = [_tile_ends(n, launch.s_q, heads, ctq, tiles) for n in launch.lengths]
        limit = kv_len_limit(sum(map(sum, ends)), clusters)
        works = sum(max(-(-e // limit), 1) for tile in ends for e in tile)
        if works > MAX_WORKS:
            raise ValueError(f"{many.replace('heads', 'num_sms')}: the launch's plan needs {works} work items, more "
                             f"than FlashInfer's fa3 MLA holds ({MAX_WORKS}): {_REFUSED}")
        return -(-launch.length // limit), works

    def max_splits(self, launch: Launch, *, heads: int) -> int:
        """The most chunks the model runs one request in, whatever the chunk length: every query tile's merge
        CTAs (at most min(cluster size x chunks, tile rows)) within the SMs, its work items within 16384."""
        cs, _, ctq, tiles = _shape(launch, heads)
        most = MAX_WORKS // tiles
        if tiles * ctq > launch.num_sms:  # the merge CTAs can outnumber the SMs
            most = min(most, launch.num_sms // (tiles * cs))
        return max(most, 1)

    def _plan(self, heads: int, launch: Launch) -> FlashInferPlan:
        return flashinfer_mla_plan(list(launch.lengths), heads=heads, q_lens=launch.s_q, causal=launch.s_q > 1,
                                   num_sms=launch.num_sms)

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        # a request's last query tile (the first of its tiles in plan order) holds its row of interest; where the
        # row spans two tiles (ctq not a multiple of heads), both see every key, in the same chunks
        last: dict[int, Plan] = {}
        for t in self._plan(req.heads, launch).tiles:
            last.setdefault(t.request, [tuple(c) for c in t.chunks])
        return [last[i] for i in range(launch.batch)]

    def reason(self, req: Request, launch: Launch) -> str:
        cs, clusters, ctq, tiles = _shape(launch, req.heads)
        total = sum(sum(_tile_ends(n, launch.s_q, req.heads, ctq, tiles)) for n in launch.lengths)
        limit = kv_len_limit(total, clusters)
        k = -(-launch.length // limit)
        ends = f" (causal ends of {tiles} query tiles a request)" if launch.s_q > 1 else ""
        return (f"MLAPlan: {total} keys in {launch.batch} request{'s' * (launch.batch > 1)}{ends} over {clusters} "
                f"clusters of {cs} CTA{'s' * (cs > 1)} on {launch.num_sms} SMs, {-(-total // clusters)} a cluster: "
                f"kv_len_limit {limit}, the request's {launch.length} keys in {k} chunk{'s' * (k > 1)}")

    def _limit(self, req: Request, plan: Plan) -> int:
        """The chunk length that cuts the request as `plan` does."""
        want = [tuple(int(v) for v in r) for r in plan]
        limit = want[0][1] - want[0][0] if want else 0
        if limit < 1 or _cut(req.length, limit) != want:
            raise ValueError(f"plan: FlashInfer cuts a request's {req.length} keys into chunks of one length from 0 "
                             f"(the last shorter); {plan!r:.80} is not such a cut")
        return limit

    def raw(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        """The request's row of interest under `plan` as the wrapper returns it by default: out (heads, 512) BF16
        and the LSE in base 2 (heads,) FP32 (what a device capture holds)."""
        res = flashinfer_mla(query_rows(req, launch.s_q)[None], req.arrays["kv"][None], seqlens=[req.length],
                             causal=launch.s_q > 1, num_sms=launch.num_sms, kv_len_limit=self._limit(req, plan))
        return {"out": res.out[0, -1], "lse": res.lse[-1]}

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        got = self.raw(req, launch, plan)
        return {"out": got["out"], "lse": natural_lse(got["lse"])}

    def check_split_tokens(self, split_tokens: int | None) -> None:
        if split_tokens is not None:
            check_int(split_tokens, "split_tokens", lo=1)

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        self.check_split_tokens(split_tokens)
        return [_cut(n, n if split_tokens is None else split_tokens) for n in launch.lengths]


def natural_lse(lse2: np.ndarray) -> np.ndarray:
    """A base-2 LSE as ``lse_mode="basee"`` (``return_lse_base_on_e``) returns it: ``fl(lse * fl32(ln 2))``, the
    model's own product (:func:`~amla_sim.algorithms.deployed.flashinfer.flashinfer_mla`)."""
    mc = get_machine("sm90-cuda")
    return np.asarray(mc.f(np.asarray(lse2, np.float32) * ln2(mc)), np.float32)


# --- the device check -------------------------------------------------------------------------------------------

#: The request of the device check: 4,096 tokens and 128 heads (DeepSeek's, one GPU's), FlashMLA's test
#: distribution.
FLASHINFER_CHECK: dict[str, Any] = {"length": 4096, "heads": 128, "dist": "flashmla", "seed": 8}
#: What the capture's arrays are named after: ``flashinfer_l{i}_out`` and so on.
CAPTURE_PREFIX = "flashinfer"


def flashinfer_launches(seed_offset: int = 0, num_sms: int = 132) -> list[Launch]:
    """The launches of FlashInfer's device check (the first the request alone), on `num_sms` SMs: batchmates of
    drawn lengths (1, 3, 7 and 15; the request first, then last of 16), batchmates that leave the chunk length
    alone (one short, seven of one token), a batch long enough to leave the request in one chunk, and a causal
    step of two queries (MTP)."""
    c = FLASHINFER_CHECK
    n = c["length"]
    check_int(seed_offset, "seed_offset", lo=0)
    check_int(num_sms, "num_sms", lo=1)
    mates = tuple(int(v) for v in np.random.default_rng([c["seed"] + seed_offset, 43]).integers(64, 2 * n + 1, 15))
    at = {"num_sms": num_sms}

    def drawn(k: int) -> str:
        return ", ".join(f"{v:,}" for v in mates[:k])

    return [
        Launch("alone", (n,), **at),
        Launch("with 1 batchmate of 100 tokens", (n, 100), **at),
        Launch("with 7 batchmates of 1 token", (n,) + (1,) * 7, **at),
        Launch(f"with 1 batchmate, {drawn(1)} long", (n,) + mates[:1], **at),
        Launch(f"with 3 batchmates, {drawn(3)} long", (n,) + mates[:3], **at),
        Launch(f"with 7 batchmates, {drawn(7)} long", (n,) + mates[:7], **at),
        Launch(f"with 15 batchmates, {drawn(4)}, ... long", (n,) + mates, **at),
        Launch("last of 16, the same batchmates", mates + (n,), position=15, **at),
        Launch("with 15 batchmates of 20,000 tokens", (n,) + (20000,) * 15, **at),
        Launch("alone with s_q = 2", (n,), s_q=2, **at),
    ]


def replay_flashinfer(path: str | Path) -> list[tuple[str, ComparisonReport]]:
    """The device check of FlashInfer's MLA replayed on the CPU from a capture of ``scripts/capture_invariance.py
    --kernels flashinfer-mla``: per launch, the device's bits of the request's row of interest (out, and the LSE
    in base 2 as the wrapper returns it) against the model's, predicted from the launch's lengths alone (the request
    run by itself with the chunk length its launch gives it). The launches are rebuilt from the capture's meta (its
    seed offset and SM count) and checked against the labels and lengths it recorded; every array is checked (name,
    shape, format) before the model runs, and an error names the file and the launch."""
    from ..crosscheck.files import CaptureError, read_capture

    if not isinstance(path, (str, Path)):
        raise TypeError(f"replay: expected a capture file's path, got {path!r:.60}")
    meta, arrays = read_capture(path, what="replay")
    try:
        launches = flashinfer_launches(int(meta.get("seed_offset", 0)), int(meta["num_sms"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CaptureError(f"replay: {path}: its meta gives no usable seed_offset and num_sms ({e})") from None
    held = meta.get("launches", [])
    if [(r.get("label"), r.get("lengths"), r.get("s_q")) for r in held] != \
            [(L.label, list(L.lengths), L.s_q) for L in launches]:
        raise CaptureError(f"replay: {path}: its launches are not flashinfer_launches()'s (another version of the "
                           "device check)")
    c = FLASHINFER_CHECK
    k = FlashInferMLA()
    device = [_launch_bits(arrays, path, i, L, c["heads"]) for i, L in enumerate(launches)]
    req = k.request(dist=c["dist"], seed=c["seed"] + int(meta.get("seed_offset", 0)), length=c["length"],
                    heads=c["heads"], s_q=max(L.s_q for L in launches))
    runs: dict[tuple, dict[str, np.ndarray]] = {}
    out = []
    for i, (L, dev) in enumerate(zip(launches, device)):
        plan = k.plans(req, L)[L.position]
        key = (tuple(plan), L.s_q, L.num_sms)
        if key not in runs:
            runs[key] = k.raw(req, L, plan)
        got = runs[key]
        rep = compare(dev, got, formats={s: v.dtype for s, v in got.items()},
                      meta={"kernel": k.name, "launch": L.label, "splits": len(plan)})
        out.append((L.label, rep))
    return out


def _launch_bits(arrays: dict[str, np.ndarray], path: str | Path, i: int, launch: Launch,
                 heads: int) -> dict[str, np.ndarray]:
    """Launch `i`'s row of interest in the capture, checked: out (heads, 512) BF16 and the base-2 LSE (heads,)
    FP32, each as raw bits or the format itself."""
    from ..crosscheck.files import CaptureError

    got = {}
    for stage, fmt, want in (("out", "bf16", (heads, 512)), ("lse", "fp32", (heads,))):
        key = f"{CAPTURE_PREFIX}_l{i}_{stage}"
        where = f"replay: {path}: {key} (launch {i}, {launch.label!r})"
        if key not in arrays:
            raise CaptureError(f"replay: {path} holds no {key} (launch {i}, {launch.label!r})")
        a = arrays[key]
        if a.dtype.kind == "V":
            a = a.view(f"u{a.dtype.itemsize}")
        f = get_format(fmt)
        if not (a.dtype == f.dtype or (a.dtype.kind in "iu" and a.dtype.itemsize == f.dtype.itemsize)):
            raise CaptureError(f"{where}: expected {f.name} or its {8 * f.dtype.itemsize}-bit words, got {a.dtype}")
        if a.shape != want:
            raise CaptureError(f"{where}: expected shape {want}, got {a.shape}")
        got[stage] = a
    return got

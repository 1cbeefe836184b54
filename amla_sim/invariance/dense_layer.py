"""Does a dense MLA model's prefill give a token its decode's bits? DeepSeek-V3/R1 and Kimi-K2 at one attention
layer, as vLLM 0.33 and SGLang 0.5.23 run it on Hopper in their default and deterministic modes.

A request's prompt is prefilled in the chunks the engine's scheduler cuts it into, each routed to the MHA or the
absorbed form (:mod:`~amla_sim.invariance.routing`); each generated token is decoded in the absorbed form, in a
launch of ``decode_batch`` tokens. :func:`dense_prefill_vs_decode` runs the layer's models
(:mod:`~amla_sim.algorithms.deployed.mla_layer`) both ways from the same inputs and says per token whether the
layer's output has the same bits, before ``o_proj`` and after it, the first step where the two part (the form,
W_UK's product, the attention kernel and its splits, W_UV's product, the kernel ``o_proj`` runs), how far, and what it
could not model.

``o_proj`` (an FP8 block linear, :mod:`~amla_sim.algorithms.deployed.fp8_linear`) computes each row on its own
through the kernel its launch takes: where the two sides' rows before it are equal and take the same kernel, so are
their outputs; where they take different kernels (vLLM's default mode: FlashInfer's GEMM for a step of fewer than 32
rows, DeepGEMM from 32), both rows are projected and compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.fp8_linear import FP8_LINEAR_KERNELS
from ..algorithms.deployed.mla_layer import (
    LAYER_MODES,
    LayerInputs,
    LayerMode,
    LayerStep,
    absorbed_chunk,
    mha_chunk,
    o_proj,
)
from ..testing import row_ulp_distance, ulp_distance
from .routing import Chunk, Prompt, route

__all__ = ["DenseVerdict", "DenseReport", "OProjVerdict", "dense_prefill_vs_decode", "layer_work", "o_proj_verdict"]


@dataclass(frozen=True)
class OProjVerdict:
    """One token's ``o_proj``: the kernel path of each side's launch (prefill, decode), and its output elements
    that differ (None: not projected, `note` says why) of `total`, the largest distance in ULPs."""

    kernels: tuple[str, str]
    differ: int | None = None
    total: int = 0
    max_ulp: int = 0
    note: str = ""
    max_row_ulp: float = 0.0

    def describe(self) -> str:
        kp, kd = (FP8_LINEAR_KERNELS[k] for k in self.kernels)
        how = f"prefill: {kp}" + (f"; decode: {kd}" if kd != kp else ", the decode's too")
        if self.differ is None:
            return f"o_proj not compared ({self.note}) [{how}]"
        if self.differ:
            return (f"after o_proj {self.differ} of {self.total} elements differ (max {self.max_ulp} ULP, "
                    f"{self.max_row_ulp:.3g} ULP of the row's largest |value|) [{how}]")
        return f"identical after o_proj [{how}]"


@dataclass(frozen=True)
class DenseVerdict:
    """One token: its layer output's elements (before ``o_proj``) that differ between prefill and decode, the
    largest distance in ULPs, where the two part, ``o_proj``'s verdict, and what of either side is not modelled
    (then the verdict is a model's, not a prediction of the device)."""

    token: int
    out_differ: int
    out_total: int
    max_ulp: int
    parts: str
    prefill: str  # how the prefill computed it
    unmodelled: tuple[str, ...] = ()
    max_row_ulp: float = 0.0
    o_proj: OProjVerdict | None = None

    @property
    def identical(self) -> bool:
        """The same bits before ``o_proj``, and after it where it was projected."""
        return self.out_differ == 0 and not (self.o_proj and self.o_proj.differ)

    def describe(self) -> str:
        if self.out_differ:
            head = (f"{self.out_differ} of {self.out_total} output elements differ (max {self.max_ulp} ULP, "
                    f"{self.max_row_ulp:.3g} ULP of the row's largest |value|): {self.parts}")
        elif self.o_proj and self.o_proj.differ:
            head = f"bits identical before o_proj; {self.parts}"
        else:
            head = "bits identical"
        o = f"; {self.o_proj.describe()}" if self.o_proj else ""
        tail = "".join(f"; not device-checked: {u}" for u in self.unmodelled)
        return f"{head} [prefill: {self.prefill}]{o}{tail}"


@dataclass
class DenseReport:
    """Every compared token's verdict for one mode, the prefill's chunks, and the two sides' outputs of those
    tokens ((n, h, 128) BF16) and stages for a device check to compare with."""

    mode: LayerMode
    chunks: list[Chunk]
    tokens: list[DenseVerdict]
    prefill: dict[str, np.ndarray] = field(repr=False)
    decode: dict[str, np.ndarray] = field(repr=False)

    @property
    def modelled(self) -> bool:
        return not any(v.unmodelled for v in self.tokens)

    def format(self) -> str:
        same = sum(v.identical for v in self.tokens)
        lines = [f"{self.mode.name} ({self.mode.what}): {same} of {len(self.tokens)} tokens bit-identical between "
                 f"prefill and decode at the layer's output" + ("" if self.modelled else
                                                               " (some pieces not device-checked: see below)")]
        lines += [f"  prefill chunk: tokens {c.context}..{c.context + c.tokens - 1}, {c.path} ({c.why})"
                  for c in self.chunks]
        if any(v.o_proj and len(set(v.o_proj.kernels)) > 1 for v in self.tokens):
            lines.append("  the layer's inputs are taken as equal; the projections that make q and the latents run "
                         "the two kernels o_proj runs, so in this mode they differ too")
        lines += [f"  token {v.token}: {v.describe()}" for v in self.tokens]
        return "\n".join(lines)


_ABSORBED_COST = 3  # a (key, head) product of the absorbed form (576 / 512 wide) against the MHA form's (192 / 128)


def layer_work(mode: str | LayerMode, length: int, *, heads: int, tokens: list[int], budget: int = 8192,
               decode_batch: int = 1) -> int:
    """What :func:`dense_prefill_vs_decode` costs, in (key, head) products of the MHA form: the prefill chunks that
    hold `tokens` (causal over their context) and each token's decode launch."""
    md = _mode(mode)
    work = 0
    for c in route(md.engine, [Prompt(length)], budget=budget, deterministic=md.deterministic):
        if any(c.context <= t < c.context + c.tokens for t in tokens):
            pairs = c.tokens * c.context + c.tokens * (c.tokens + 1) // 2
            work += pairs * heads * (1 if c.path == "mha" else _ABSORBED_COST)
    return work + sum(t + 1 for t in tokens) * heads * decode_batch * _ABSORBED_COST


def _mode(mode: str | LayerMode) -> LayerMode:
    md = LAYER_MODES.get(mode) if isinstance(mode, str) else mode
    if not isinstance(md, LayerMode):
        raise ValueError(f"mode: expected one of {tuple(LAYER_MODES)}, got {mode!r}")
    return md


def _prefill(x: LayerInputs, mode: LayerMode, chunks: list[Chunk], todo: list[int]) -> dict[int, tuple]:
    """Each token of `todo`: (its chunk's step, the row of it in that step, the chunk)."""
    got = {}
    for c in chunks:
        mine = [t for t in todo if c.context <= t < c.context + c.tokens]
        if not mine:
            continue
        if c.path == "mha":
            step = mha_chunk(x, c.context, c.tokens, mode)
        else:
            step = absorbed_chunk(x, np.arange(c.context, c.context + c.tokens), mode, causal_step=True)
        for t in mine:
            got[t] = (step, t - c.context, c)
    return got


def _parts(pre: LayerStep, i: int, dec: LayerStep, mode: LayerMode) -> str:
    """The first step where token's prefill (row i of `pre`) and decode (row 0 of `dec`) part."""
    if pre.form != dec.form:
        return "the form (prefill: kv_b_proj and FA3's 192/128 kernel; decode: W_UK, FA3's 576/512 kernel, W_UV)"

    def same(name: str) -> bool:
        a, b = pre.stages[name][i], dec.stages[name][0]
        return a.tobytes() == b.tobytes()

    if not same("w_uk"):
        return f"W_UK's product ({mode.bmm} bmm): the token's q W_UK differs"
    if not (same("attn") and same("lse")):
        sp, sd = int(pre.splits[i]), int(dec.splits[0])
        if sp != sd:
            return (f"the attention kernel's splits: FA3 cuts the token's keys into {sp} in the prefill, {sd} in the "
                    "decode")
        return "the attention kernel: the same splits, another launch shape (the prefill's causal step of the chunk)"
    return f"W_UV's product ({mode.bmm} bmm)"


def o_proj_verdict(x: LayerInputs, mode: str | LayerMode, prefill_tokens: int, decode_tokens: int, po: np.ndarray,
                   do: np.ndarray) -> OProjVerdict:
    """o_proj of one token's two rows before it (h, 128) BF16: each side's step (the prefill's chunk of
    `prefill_tokens`, the decode's launch of `decode_tokens`) picks the kernel; equal rows through one kernel give
    equal outputs (each row is its own chain), equal rows through two kernels are projected (with `x`'s weight)."""
    md = _mode(mode)
    kernels = (md.linear_kernel(prefill_tokens), md.linear_kernel(decode_tokens))
    if po.tobytes() != do.tobytes():
        return OProjVerdict(kernels, note="its inputs already differ")
    if kernels[0] == kernels[1]:
        return OProjVerdict(kernels, 0, 0 if x.w_o is None else x.w_o.shape[0])
    if x.w_o is None:
        return OProjVerdict(kernels, note="these inputs hold no o_proj weight")
    a, b = (o_proj(po[None], x, k)[0] for k in kernels)
    return OProjVerdict(kernels, int((a.view(np.uint16) != b.view(np.uint16)).sum()), a.size,
                        int(ulp_distance(a, b).max(initial=0)), "", float(np.nanmax(row_ulp_distance(a, b),
                                                                                       initial=0.0)))


def dense_prefill_vs_decode(x: LayerInputs, mode: str | LayerMode, *, tokens: list[int] | None = None,
                            budget: int = 8192, decode_batch: int = 1) -> DenseReport:
    """The request of `x` prefilled as `mode`'s engine schedules it alone (``budget``: vLLM's
    ``max_num_batched_tokens``, SGLang's ``--chunked-prefill-size``), against the decode of each of `tokens`
    (default the last 4) in a launch of `decode_batch` tokens (the token and copies of it, standing for batchmates
    as long)."""
    md = _mode(mode)
    T = x.tokens
    check_int(decode_batch, "decode_batch", lo=1, hi=1024)
    todo = list(range(max(0, T - 4), T)) if tokens is None else [check_int(t, "tokens", lo=0, hi=T - 1)
                                                                  for t in tokens]
    if len(set(todo)) != len(todo) or not todo:
        raise ValueError(f"tokens: each position once, at least one, got {tokens}")
    chunks = route(md.engine, [Prompt(T)], budget=check_int(budget, "budget", lo=1),
                   deterministic=md.deterministic)
    pre = _prefill(x, md, chunks, todo)
    verdicts, sides = [], {"prefill": {"out": [], "splits": []}, "decode": {"out": [], "splits": []}}
    for t in todo:
        step, i, c = pre[t]
        dec = absorbed_chunk(x, [t] * decode_batch, md, causal_step=False)
        po, do = step.out[i], dec.out[0]
        differ = int((po.view(np.uint16) != do.view(np.uint16)).sum())
        ov = o_proj_verdict(x, md, c.tokens, decode_batch, po, do)
        parts = _parts(step, i, dec, md) if differ else (
            f"o_proj's kernel: a step of {c.tokens} tokens against one of {decode_batch}" if ov.differ else "")
        verdicts.append(DenseVerdict(t, differ, po.size, int(ulp_distance(po, do).max(initial=0)), parts,
                                     f"{c.path}, chunk {c.context}..{c.context + c.tokens - 1}",
                                     tuple(dict.fromkeys(step.unmodelled + dec.unmodelled)),
                                     float(np.nanmax(row_ulp_distance(po, do), initial=0.0)), ov))
        for side, st, r in (("prefill", step, i), ("decode", dec, 0)):
            sides[side]["out"].append(st.out[r])
            sides[side]["splits"].append(st.splits[r])
    return DenseReport(md, chunks, verdicts, *({k: np.array(v) for k, v in sides[s].items()}
                                               for s in ("prefill", "decode")))

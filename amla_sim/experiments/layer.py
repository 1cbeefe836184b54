"""The dense MLA layer's attention as a sweep measures it: each engine's prefill and decode of the same tokens against
the layer's FP64 attention (``sweep --reference layer``).

A sample's q (b, s_q, G, 576) and kv (b, S, 576), drawn as every sweep draws them, are b requests of S tokens, the
last s_q of them measured: a token's q_nope is the first 128 columns of its q and q_pe the last 64 (the tokens
before the last s_q get no query: their rows of the prefill are not measured, and the kernels' rows are
independent), c_kv the first 512 columns of kv and k_pe the last 64. kv_b_proj's weight is drawn from the
inputs' bits (:func:`layer_weights`): N(0, 0.05^2) in BF16, quantized to E4M3 in 128 x 128 blocks with
power-of-two scales, a checkpoint both engines hold as it is (vLLM requantizes block scales to powers of two at
load; SGLang keeps them). The softmax scale is DeepSeek-V3's.

The reference (:func:`layer_reference`) is each head's attention in FP64 over those exact inputs and weights: k_nope
= c_kv W_k^T, v = c_kv W_v^T, scores ``scale (q_nope k_nope + q_pe k_pe)`` of token t over tokens 0..t, and the
softmax-weighted v: (b, s_q, G, 128). The algorithms (:data:`LAYER_ALGORITHMS`) are the paths an engine sends the
measured tokens down (:mod:`amla_sim.algorithms.deployed.mla_layer`): the MHA-form prefill (the s_q tokens a chunk
after S - s_q tokens of context: kv_b_proj's FP8 GEMM, FA3's varlen calls and the engine's merges), the absorbed
prefill (the chunk as one causal step of FA3's MLA kernel between the W_UK and W_UV products) and the decode (each
token its own request of the absorbed form). Each takes ``deterministic`` (vLLM's ``VLLM_BATCH_INVARIANT``,
SGLang's ``--enable-deterministic-inference``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from ..algorithms._common import AttentionResult
from ..algorithms.deployed.mla_layer import (KV_LORA, LAYER_MODES, QK_NOPE, QK_ROPE, V_HEAD, LayerInputs,
                                             absorbed_chunk, mha_chunk)
from ..crosscheck.deepgemm import quantize_weight_blocks
from ..crosscheck.layer import DEEPSEEK_V3_SCALE
from ..formats import get_format, round_to

__all__ = ["LAYER_ALGORITHMS", "layer_weights", "layer_inputs", "layer_reference", "layer_bytes", "LAYER_MACHINE",
           "D_K"]

#: the layer's algorithms run each kernel on the machine its model names; a layer sweep's one machine
LAYER_MACHINE = "sm90-cuda"
#: a layer sample's q and kv width: [q_nope or c_kv, ..., q_pe or k_pe]
D_K = KV_LORA + QK_ROPE
_WEIGHT_SIGMA = 0.05


def layer_weights(kv: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj's weight (heads 256, 512) E4M3 and its block scales (2 heads, 4) FP32, powers of two, drawn from a
    seed that is the CRC-32 of the sample's kv bits (every algorithm and the reference draw the same)."""
    seed = zlib.crc32(np.ascontiguousarray(kv).view(np.uint8).tobytes())
    rng = np.random.default_rng([seed, 52, 4])
    return quantize_weight_blocks(round_to(rng.normal(0, _WEIGHT_SIGMA, (heads * 256, KV_LORA)), "bf16"), "ue8m0")


def layer_inputs(q: np.ndarray, kv: np.ndarray, i: int,
                 weights: tuple[np.ndarray, np.ndarray] | None = None) -> LayerInputs:
    """Request `i` of a sample as a layer's inputs (the module docstring): the tokens before the last s_q with zero
    queries; `weights`: :func:`layer_weights` of the sample, where the caller has them."""
    _check(q, kv)
    _, s_q, G, _ = q.shape
    S = kv.shape[1]
    qn = np.zeros((S, G, QK_NOPE), q.dtype)
    qp = np.zeros((S, G, QK_ROPE), q.dtype)
    qn[S - s_q:], qp[S - s_q:] = q[i, ..., :QK_NOPE], q[i, ..., KV_LORA:]
    w, s = layer_weights(kv, G) if weights is None else weights
    return LayerInputs(qn, qp, np.ascontiguousarray(kv[i, :, :KV_LORA]), np.ascontiguousarray(kv[i, :, KV_LORA:]),
                       w, s, DEEPSEEK_V3_SCALE)


def layer_reference(q: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """The layer's attention in FP64 (the module docstring): (b, s_q, G, 128)."""
    _check(q, kv)
    b, s_q, G, _ = q.shape
    S = kv.shape[1]
    w, s = layer_weights(kv, G)
    W = (w.astype(np.float64).reshape(-1, 128, KV_LORA // 128, 128) * s[:, None, :, None]).reshape(G, 256, KV_LORA)
    out = np.empty((b, s_q, G, V_HEAD))
    visible = np.arange(S)[None, :] <= (S - s_q + np.arange(s_q))[:, None]  # (s_q, S)
    for i in range(b):
        c, k_pe = kv[i, :, :KV_LORA].astype(np.float64), kv[i, :, KV_LORA:].astype(np.float64)
        k_nope = np.einsum("sc,hdc->hsd", c, W[:, :QK_NOPE])  # (G, S, 128)
        v = np.einsum("sc,hdc->hsd", c, W[:, QK_NOPE:])
        qn, qp = q[i, ..., :QK_NOPE].astype(np.float64), q[i, ..., KV_LORA:].astype(np.float64)
        scores = DEEPSEEK_V3_SCALE * (np.einsum("thd,hsd->hts", qn, k_nope) + np.einsum("thd,sd->hts", qp, k_pe))
        scores = np.where(visible[None], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[i] = np.einsum("hts,hsd->thd", p / p.sum(axis=-1, keepdims=True), v)
    return out


def layer_bytes(heads: int, sq: int, context: int) -> int:
    """What a layer sample holds beyond a decode's: per head and token the reference's k_nope and v (FP64), the
    prefill's up-projected k and v and their FP32 products, and the reference's scores."""
    return heads * context * (2 * QK_NOPE * 8 + 256 * (4 + 2) * 2) + 3 * heads * sq * context * 8


def _check(q: np.ndarray, kv: np.ndarray) -> None:
    if q.ndim != 4 or kv.ndim != 3 or q.shape[-1] != D_K or kv.shape[-1] != D_K or q.shape[0] != kv.shape[0]:
        raise ValueError(f"q, kv: a layer sample is (b, s_q, G, {D_K}) and (b, S, {D_K}), got {q.shape} and "
                         f"{kv.shape}")
    if q.shape[1] > kv.shape[1]:
        raise ValueError(f"contexts: a layer sample measures the last s_q of its S tokens: S ({kv.shape[1]}) under "
                         f"s_q ({q.shape[1]})")
    for name, a in (("q", q), ("kv", kv)):
        if get_format(a.dtype).name != "bf16":
            raise ValueError(f"input_format: the layer's inputs are BF16, got {name} in {a.dtype}")


def _path(engine: str, form: str) -> Callable[..., AttentionResult]:
    def run(q: np.ndarray, kv: np.ndarray, *, deterministic: bool = False) -> AttentionResult:
        if engine == "sglang" and form == "mha" and deterministic:
            raise ValueError("deterministic: SGLang's deterministic mode sends every extend to the absorbed form "
                             "(sglang-absorbed-prefill), never the MHA form")
        mode = LAYER_MODES[f"{engine}{'-batch-invariant' if engine == 'vllm' else '-deterministic'}"
                           if deterministic else engine]
        _check(q, kv)
        b, s_q, G, _ = q.shape
        S = kv.shape[1]
        out = np.empty((b, s_q, G, V_HEAD), np.float64)
        weights, tokens = layer_weights(kv, G), np.arange(S - s_q, S)
        for i in range(b):
            x = layer_inputs(q, kv, i, weights)
            if form == "mha":
                step = mha_chunk(x, S - s_q, s_q, mode)
            else:
                step = absorbed_chunk(x, tokens, mode, causal_step=form == "absorbed")
            out[i] = step.out.astype(np.float64)
        return AttentionResult(out, None, {}, {})

    run.__name__ = f"{engine}_{form}"
    run.__doc__ = (f"{engine}'s {dict(mha='MHA-form prefill', absorbed='absorbed prefill', decode='decode')[form]} of "
                   "a layer sample's last s_q tokens (:mod:`amla_sim.experiments.layer`).")
    return run


#: the layer's paths by name, as a layer sweep names them
LAYER_ALGORITHMS: dict[str, Callable[..., AttentionResult]] = {
    f"{engine}-{name}": _path(engine, form) for engine in ("vllm", "sglang")
    for name, form in (("prefill", "mha"), ("absorbed-prefill", "absorbed"), ("decode", "decode"))}

"""A dense MLA layer's attention (DeepSeek-V3/R1, Kimi-K2) as vLLM 0.33 and SGLang 0.5.23 run it on Hopper with a
BF16 cache and an FP8 checkpoint: from the layer's attention inputs to the per-head output ``o_proj`` reads, bit for
bit, in either of the two forms the engines route a chunk of tokens to.

- **MHA** (a prefill chunk the engine routes so, :mod:`~amla_sim.invariance.routing`): the latent rows up-projected
  by ``kv_b_proj`` (the per-token-group FP8 quantizer and DeepGEMM's block GEMM,
  :mod:`~amla_sim.algorithms.deployed.deepgemm`) to per-head ``k_nope`` and ``v``; ``q = [q_nope, q_pe]`` and ``k =
  [k_nope, k_pe]`` 192 wide; then the engine's chain of FA3 calls and merges (vLLM:
  :func:`~amla_sim.algorithms.deployed.vllm.mla_prefill.vllm_mla_prefill`; SGLang:
  :func:`~amla_sim.algorithms.deployed.sglang.mha_prefill.sglang_mla_prefill`). Its output is the layer's.
- **absorbed** (every decode, and the prefill chunks routed so): ``q_nope W_UK`` and ``attn W_UV`` as batched
  products over the heads (:mod:`~amla_sim.algorithms.deployed.projections`; cuBLAS in the normal modes, each
  engine's Triton ``bmm_batch_invariant`` in the deterministic ones), around FA3's MLA kernel over the latent cache
  (``[c_kv, k_pe]`` 576 wide; vLLM: :func:`~amla_sim.algorithms.deployed.fa3.mla.fa3_mla`, SGLang:
  :func:`~amla_sim.algorithms.deployed.fa3.sgl.sgl_fa3_mla`).

W_UK and W_UV are ``kv_b_proj``'s weight dequantized to BF16 once at load, ``bf16(fl32(w) s)`` (vLLM
``split_kv_b_proj``, ``mla_attention.py:408-423``: with DeepGEMM in use, the identity through the FP8 GEMM, which
gives these bits for power-of-two activation scales; SGLang ``block_quant_dequant``, ``deepseek_weight_loader.py:
703``). The weights are taken as the engine holds them after loading (vLLM requantizes an FP8 checkpoint's block
scales to powers of two; pass those).

The engines' settings that change bits are a :class:`LayerMode`: :data:`LAYER_MODES` holds each engine's default and
deterministic mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ...formats import get_format
from ...machines import get_machine
from .deepgemm import FP8_GROUP
from .fa3.mla import fa3_mla
from .fa3.sgl import sgl_fa3_mla
from .fp8_linear import fp8_block_linear, fp8_linear_kernel, vllm_graph_tokens
from .projections import CUBLAS_CHECKED, w_uk, w_uv
from .sglang.mha_prefill import sglang_mla_prefill
from .vllm.mla_prefill import vllm_mla_prefill

__all__ = [
    "KV_LORA",
    "LAYER_MODES",
    "QK_NOPE",
    "QK_ROPE",
    "V_HEAD",
    "LayerInputs",
    "LayerMode",
    "LayerStep",
    "absorbed_chunk",
    "absorbed_weights",
    "dequant_kv_b",
    "kv_b_proj",
    "mha_chunk",
    "o_proj",
]

QK_NOPE, QK_ROPE, V_HEAD, KV_LORA = 128, 64, 128, 512


@dataclass(frozen=True)
class LayerMode:
    """An engine's settings as far as they change an MLA layer's bits."""

    name: str
    engine: str  # "vllm" or "sglang"
    deterministic: bool
    bmm: str  # "cublas" or "triton"
    what: str = ""
    page_size: int = 16  # the cache's page (vLLM's block size; SGLang's --page-size)
    cuda_graph_max: int = 512  # vLLM: decode launches of at most this many tokens replay a full CUDA graph
    cuda_graph_splits: int = 32  # vLLM: flash_attn_max_num_splits_for_cuda_graph, FA3's bound under a graph
    max_context_len: int = 163840  # SGLang: its page table's width under CUDA graphs (DeepSeek-V3's context)

    def fa3_num_splits(self, decode_tokens: int) -> int:
        """What the engine passes FA3's MLA kernel for a launch of `decode_tokens` query tokens (vLLM
        ``flashattn_mla.py:225-238``; SGLang passes 1 when deterministic, else leaves FA3's heuristic)."""
        if self.deterministic:
            return 1
        if self.engine == "vllm" and decode_tokens <= self.cuda_graph_max:
            return self.cuda_graph_splits
        return 0

    def linear_kernel(self, tokens: int, *, graph: bool = True) -> str:
        """The kernel path of an FP8 block linear over a step of `tokens` tokens (:mod:`.fp8_linear`); graph: the
        projection runs in the step's CUDA graph (``o_proj``: vLLM pads the step to its capture size), not eagerly
        inside the attention op (``kv_b_proj``)."""
        rows = vllm_graph_tokens(tokens, self.cuda_graph_max) if graph and self.engine == "vllm" else tokens
        return fp8_linear_kernel(self.engine, self.deterministic, rows)


LAYER_MODES: dict[str, LayerMode] = {mode.name: mode for mode in (
    LayerMode("vllm", "vllm", False, "cublas",
              "vLLM 0.33 default: FLASH_ATTN_MLA, cuBLAS bmm, DeepGEMM with UE8M0 scales, FA3's split heuristic"),
    LayerMode("vllm-batch-invariant", "vllm", True, "triton",
              "VLLM_BATCH_INVARIANT=1: Triton bmm_batch_invariant, FA3 num_splits 1"),
    LayerMode("sglang", "sglang", False, "cublas", "SGLang 0.5.23 default (fa3 backend): cuBLAS bmm, DeepGEMM "
              "with FP32 scales, FA3's split heuristic in decode", page_size=1),
    LayerMode("sglang-deterministic", "sglang", True, "triton",
              "--enable-deterministic-inference: Triton bmm_batch_invariant, FA3 num_splits 1, every extend absorbed",
              page_size=1),
)}


def _bf16(x: npt.ArrayLike, name: str, shape: tuple) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "fV" or get_format(a.dtype).name != "bf16" or a.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(a.shape, shape)):
        want = ", ".join("?" if s is None else str(s) for s in shape)
        raise ValueError(f"{name}: expected BF16 ({want}), got {a.dtype} {a.shape}")
    return a


@dataclass(frozen=True)
class LayerInputs:
    """One request's inputs to an MLA layer's attention, T tokens and h heads: q_nope (T, h, 128) and q_pe (T, h,
    64), the latent rows c_kv (T, 512) (after the RMSNorm) and k_pe (T, 64) (RoPE applied), all BF16; kv_b_proj's
    weight (h 256, 512) E4M3 (head i's k_nope rows, then its v rows) and its 128 x 128 block scales (2h, 4) FP32;
    the softmax scale; optionally ``o_proj``'s weight (hidden, h 128) E4M3 and its block scales (ceil(hidden / 128),
    h) FP32."""

    q_nope: np.ndarray
    q_pe: np.ndarray
    c_kv: np.ndarray
    k_pe: np.ndarray
    kv_b: np.ndarray
    kv_b_scale: np.ndarray
    scale: float
    w_o: np.ndarray | None = None
    w_o_scale: np.ndarray | None = None
    weights: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        qn = _bf16(self.q_nope, "q_nope", (None, None, QK_NOPE))
        T, h = qn.shape[:2]
        _bf16(self.q_pe, "q_pe", (T, h, QK_ROPE))
        _bf16(self.c_kv, "c_kv", (T, KV_LORA))
        _bf16(self.k_pe, "k_pe", (T, QK_ROPE))
        w = np.asarray(self.kv_b)
        if w.dtype.kind not in "fV" or get_format(w.dtype).name != "e4m3" or w.shape != (h * 256, KV_LORA):
            raise ValueError(f"kv_b: expected E4M3 ({h * 256}, {KV_LORA}) for {h} heads, got {w.dtype} {w.shape}")
        s = np.asarray(self.kv_b_scale)
        if s.shape != (2 * h, KV_LORA // FP8_GROUP) or s.dtype != np.float32:
            raise ValueError(f"kv_b_scale: expected float32 ({2 * h}, {KV_LORA // FP8_GROUP}), got {s.dtype} {s.shape}")
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale: expected a positive finite softmax scale, got {self.scale}")
        if (self.w_o is None) != (self.w_o_scale is None):
            raise ValueError("w_o, w_o_scale: give both or neither")
        if self.w_o is not None:
            wo, so = np.asarray(self.w_o), np.asarray(self.w_o_scale)
            if wo.dtype.kind not in "fV" or get_format(wo.dtype).name != "e4m3" or wo.ndim != 2 or (
                    wo.shape[1] != h * V_HEAD or wo.shape[0] % 64):
                raise ValueError(f"w_o: expected E4M3 (hidden, {h * V_HEAD}), hidden a multiple of 64, got {wo.dtype} "
                                 f"{wo.shape}")
            if so.dtype != np.float32 or so.shape != (-(-wo.shape[0] // FP8_GROUP), h):
                raise ValueError(f"w_o_scale: expected float32 ({-(-wo.shape[0] // FP8_GROUP)}, {h}), got {so.dtype} "
                                 f"{so.shape}")
        object.__setattr__(self, "weights", absorbed_weights(w, s))

    @property
    def tokens(self) -> int:
        return self.q_nope.shape[0]

    @property
    def heads(self) -> int:
        return self.q_nope.shape[1]


def dequant_kv_b(kv_b: np.ndarray, kv_b_scale: np.ndarray) -> np.ndarray:
    """kv_b_proj's weight in BF16, ``bf16(fl32(w) s)`` with each 128 x 128 block's scale: (h 256, 512)."""
    s = np.repeat(np.repeat(np.asarray(kv_b_scale, np.float32), FP8_GROUP, 0), FP8_GROUP, 1)
    return get_machine("ieee32").cast((np.asarray(kv_b).astype(np.float32) * s).astype(np.float32), "bf16")


def absorbed_weights(kv_b: np.ndarray, kv_b_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W_UK (h, 128, 512) and W_UV (h, 512, 128), BF16, as both engines hold them."""
    w = dequant_kv_b(kv_b, kv_b_scale)
    kv = w.reshape(-1, QK_NOPE + V_HEAD, KV_LORA)
    return np.ascontiguousarray(kv[:, :QK_NOPE]), np.ascontiguousarray(kv[:, QK_NOPE:].transpose(0, 2, 1))


def kv_b_proj(c_kv: np.ndarray, kv_b: np.ndarray, kv_b_scale: np.ndarray, *, kernel: str = "deepgemm-ue8m0") -> tuple[
        np.ndarray, np.ndarray]:
    """kv_b_proj of latent rows (n, 512) in one launch through `kernel` (:mod:`.fp8_linear`: vLLM's DeepGEMM path by
    default); returns k_nope (n, h, 128) and v (n, h, 128), BF16."""
    kv = fp8_block_linear(c_kv, kv_b, kv_b_scale, kernel=kernel).reshape(c_kv.shape[0], -1, QK_NOPE + V_HEAD)
    return kv[..., :QK_NOPE], kv[..., QK_NOPE:]


def o_proj(attn: np.ndarray, x: LayerInputs, kernel: str) -> np.ndarray:
    """``o_proj`` of layer outputs (n, h, 128) BF16 through `kernel`: (n, hidden) BF16 (this tensor-parallel rank's
    part of the sum, before the all-reduce)."""
    if x.w_o is None:
        raise ValueError("x: these inputs hold no o_proj weight (w_o)")
    return fp8_block_linear(np.ascontiguousarray(attn).reshape(attn.shape[0], -1), x.w_o, x.w_o_scale, kernel=kernel)


@dataclass
class LayerStep:
    """One launch's view of some tokens of a request: their layer output (n, h, 128) BF16 and the stages before it
    (absorbed: ``w_uk`` and ``attn`` (n, h, 512), ``lse`` (n, h); MHA: ``attn`` (n, h, 128)), each token's split
    count in FA3's MLA kernel (0 in the MHA form, whose chain of calls it does not report), the form, and what of
    it is not device-checked (``unmodelled``: a piece not modelled, or taken from another build)."""

    form: str
    out: np.ndarray
    stages: dict[str, np.ndarray]
    splits: np.ndarray
    unmodelled: list[str] = field(default_factory=list)


def mha_chunk(x: LayerInputs, start: int, n: int, mode: LayerMode, *, workspace: int = 64 * 1024) -> LayerStep:
    """Tokens [start, start + n) of the request prefilled in the MHA form, its tokens before `start` the context
    (vLLM: a context chunk a `workspace` of rows, merged; SGLang: one shot)."""
    h = x.heads
    # kv_b_proj in the attention op, eagerly. vLLM: the new tokens in one launch, each context chunk in one of its
    # own; SGLang: the prefix and the new tokens in one
    if mode.engine == "vllm":
        calls = [(start, start + n)] + [(lo, min(lo + workspace, start)) for lo in range(0, start, workspace)]
    else:
        calls = [(0, start + n)]
    parts = {lo: kv_b_proj(x.c_kv[lo:hi], x.kv_b, x.kv_b_scale, kernel=mode.linear_kernel(hi - lo, graph=False))
             for lo, hi in calls}
    k_nope, v = (np.concatenate([parts[lo][j] for lo in sorted(parts)]) for j in (0, 1))
    k = np.concatenate([k_nope, np.broadcast_to(x.k_pe[:start + n, None], (start + n, h, QK_ROPE))], axis=-1)
    q = np.concatenate([x.q_nope[start:start + n], x.q_pe[start:start + n]], axis=-1)
    new = slice(start, start + n)
    unmodelled = []
    if mode.engine == "vllm":
        res = vllm_mla_prefill(q, k[new], v[new], k[:start], v[:start], [n], [start], workspace=workspace,
                               scale=x.scale, num_splits=1 if mode.deterministic else 0)
    else:
        res = sglang_mla_prefill(q, k[new], v[new], k[:start], v[:start], [n], [start], scale=x.scale)
        unmodelled.append("kv_b_proj: SGLang's DeepGEMM fork (sgl-deep-gemm 0.2.3.post2) as vLLM's DeepGEMM, the "
                          "same block-128 branch in its source, not run")
    return LayerStep("mha", res.out, {"attn": res.out}, np.zeros(n, np.int64), unmodelled)


def absorbed_chunk(x: LayerInputs, tokens: npt.ArrayLike, mode: LayerMode, *, causal_step: bool) -> LayerStep:
    """Tokens of the request through the absorbed form. causal_step: one request whose query step is the run of
    `tokens` (a prefill chunk: s_q = len(tokens), causal, each token over the cache up to itself); else each token
    a request of its own in one launch (a decode batch; the same token repeated stands for batchmates as long)."""
    t = np.asarray(tokens, np.int64)
    h, n = x.heads, len(t)
    W_UK, W_UV = x.weights
    mc = "sm90-triton"  # the bmm model: one wgmma chain over K (both engines' Triton bmm; cuBLAS where checked)
    unmodelled = []
    if mode.bmm == "cublas" and (n, h) not in CUBLAS_CHECKED:
        unmodelled.append(f"cuBLAS bmm of {n} tokens x {h} heads: not captured at this shape (cuBLAS picks a kernel by "
                          f"shape; the fused chain was its bits on the {len(CUBLAS_CHECKED)} shapes captured)")
    ql = w_uk(x.q_nope[t], W_UK, machine=mc)
    q = np.concatenate([ql, x.q_pe[t]], axis=-1)
    kv = np.concatenate([x.c_kv, x.k_pe], axis=-1)
    splits = mode.fa3_num_splits(n)
    if causal_step:
        if np.any(t != np.arange(t[0], t[0] + n)):
            raise ValueError("tokens: a prefill chunk is a run of consecutive tokens")
        lens, qq, kk = [int(t[-1]) + 1], q[None], kv[None, :t[-1] + 1]
    else:
        lens, qq = [int(i) + 1 for i in t], q[:, None]
        kk = np.stack([np.pad(kv[:i + 1], ((0, int(t.max()) - i), (0, 0))) for i in t.tolist()])
    if mode.engine == "vllm":
        res = fa3_mla(qq, kk, seqlens=lens, scale=x.scale, page_size=mode.page_size, num_splits=splits,
                      trace=True)
    else:
        # the page table: max_context_len wide under a decode's CUDA graph, the longest request in an eager extend
        width = max(lens) if causal_step else max(mode.max_context_len, max(lens))
        res = sgl_fa3_mla(qq, kk, seqlens=lens, table_pages=-(-width // mode.page_size), page_size=mode.page_size,
                          scale=x.scale, num_splits=splits, trace=True)
    attn = res.out.reshape(n, h, KV_LORA)
    lse = np.ascontiguousarray(res.lse.T)  # (n, h)
    counts = np.asarray(res.trace["schedule"][0].splits, np.int64)
    out = w_uv(attn, W_UV, machine=mc)
    per_token = np.repeat(counts, n) if causal_step else counts
    return LayerStep("absorbed", out, {"w_uk": ql, "attn": attn, "lse": lse}, per_token, unmodelled)

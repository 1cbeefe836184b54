"""The LSE merges that fold a chunked prefill's partial attention states: vLLM's ``merge_attn_states`` and SGLang's
``merge_state_v2``, each as its engine builds and calls it.

Upstream: vLLM 0.33.0 ``csrc/attention/merge_attn_states.cu`` (``merge_attn_states_kernel``, in ``_C_stable_libtorch``,
compiled without ``--use_fast_math``) and sgl-kernel ``csrc/attention/merge_attn_states.cu`` at 6614f98 (its sm90
``common_ops``, compiled with ``-use_fast_math``). Per (token, head), in FP32::

    p, s = (-inf if isinf(x) else x for x in (p_lse, s_lse))      # +inf (FA2's empty row) read as -inf
    m = fmaxf(p, s); p_se = expf(p - m); s_se = expf(s - m); out_se = p_se + s_se
    o = fma(p_out, p_se / out_se, s_out * (s_se / out_se))          # rounded to the output's format
    lse = logf(out_se) + m

vLLM's build takes libdevice's ``expf``, IEEE division and libdevice's ``logf`` then the add (the machine
``sm90-cuda-precise``); SGLang's ``expf`` is ``ex2.approx.ftz(x log2 e)``, ``/`` a multiply by ``rcp.approx`` and
``logf(x) + m`` one FMA of ``lg2.approx(x)`` and ln 2 (``sm90-cuda``). Where both LSEs are infinite, vLLM copies
the prefix's output and writes LSE -inf (``merge_attn_states.cu``: "we simply emit prefix_output"); SGLang computes
``-inf - (-inf)``, NaN throughout. vLLM's rows from ``prefill_tokens_with_context`` on copy the suffix.

Each engine falls back to a Triton kernel for the outputs its CUDA kernel does not take (other dtypes, a head size
not a multiple of 8): vLLM's ``triton_merge_attn_states.py`` and SGLang's ``merge_state_triton``
(``kernels/ops/attention/merge_state.py``), the same arithmetic as Triton lowers it (``tl.exp`` as ``ex2.approx`` of
``x log2 e``, ``/`` as ``div.full``, ``tl.log`` as libdevice's ``logf``, then the add: ``sm90-triton``). Where both
LSEs are infinite, vLLM's writes out 0 and LSE -inf (not the prefix's output), SGLang's NaN.

The engines chain the merges in opposite orders (:func:`vllm_context_then_new`, :func:`sglang_new_then_chunks`), each
merge rounding the output to BF16 again, so a prefill of three or more partials gets other bits in each engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..._validate import check_int, quiet_fp
from ...formats import get_format
from ...machines import Machine, get_machine

__all__ = ["vllm_merge_attn_states", "sglang_merge_state_v2", "vllm_merge_attn_states_triton",
           "sglang_merge_state_triton", "vllm_context_then_new", "sglang_new_then_chunks"]

_FORMATS = ("bf16", "fp16", "fp32")


def _check(p_out: npt.ArrayLike, p_lse: npt.ArrayLike, s_out: npt.ArrayLike, s_lse: npt.ArrayLike,
           lse_shape: str, pack: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Outputs (T, h, d) of one format (BF16, FP16, FP32), d a multiple of `pack` (the CUDA kernels' 128-bit packs:
    8; the Triton kernels any: 1); LSEs FP32 of `lse_shape` ``"hT"`` (vLLM's) or ``"Th"`` (SGLang's). Errors name
    the argument."""
    po, so = np.asarray(p_out), np.asarray(s_out)
    for name, a in (("prefix_output", po), ("suffix_output", so)):
        try:
            fmt = get_format(a.dtype).name
        except (TypeError, ValueError):  # not a float format
            fmt = None
        if fmt not in _FORMATS or a.ndim != 3 or a.shape[-1] % pack or 0 in a.shape:
            multiple = f", d a multiple of {pack}" if pack > 1 else ""
            raise ValueError(f"{name}: expected BF16, FP16 or FP32 (T, h, d){multiple}, got {a.dtype} {a.shape}")
    if po.dtype != so.dtype or po.shape != so.shape:
        raise ValueError(f"suffix_output: expected prefix_output's {po.dtype} {po.shape}, got {so.dtype} {so.shape}")
    T, h = po.shape[:2]
    want = (h, T) if lse_shape == "hT" else (T, h)
    lses = []
    for name, a in (("prefix_lse", p_lse), ("suffix_lse", s_lse)):
        arr = np.asarray(a)
        if arr.dtype != np.float32 or arr.shape != want:
            raise ValueError(f"{name}: expected float32 {want}, got {arr.dtype} {arr.shape}")
        lses.append(arr if lse_shape == "Th" else arr.T)
    return po, lses[0], so, lses[1]


def _merge(mc: Machine, po: np.ndarray, pl: np.ndarray, so: np.ndarray, sl: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's arithmetic on (T, h, d) outputs and (T, h) LSEs: the merged output (FP32, before its rounding),
    the merged LSE and where both LSEs were infinite."""
    ninf = np.float32(-np.inf)
    p = np.where(np.isinf(pl), ninf, pl).astype(np.float32)
    s = np.where(np.isinf(sl), ninf, sl).astype(np.float32)
    m = np.fmax(p, s)  # fmaxf: NaN only if both are
    p_se, s_se = mc.exp(mc.f(p - m)), mc.exp(mc.f(s - m))
    out_se = mc.f(p_se + s_se)
    p_scale, s_scale = mc.div(p_se, out_se), mc.div(s_se, out_se)
    o = mc.mul_add(mc.f(po.astype(np.float32)), p_scale[..., None],
                   mc.f(mc.f(so.astype(np.float32)) * s_scale[..., None]))
    lse = mc.log_plus(out_se, m)
    return o, lse, np.isinf(m)


@quiet_fp
def vllm_merge_attn_states(prefix_output: npt.ArrayLike, prefix_lse: npt.ArrayLike, suffix_output: npt.ArrayLike,
                           suffix_lse: npt.ArrayLike, *, prefill_tokens_with_context: int | None = None,
                           machine: str | Machine = "sm90-cuda-precise") -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``merge_attn_states`` (``vllm._custom_ops``, the CUDA kernel vLLM picks for FP32/FP16/BF16 outputs of a
    head size divisible by 8): outputs (T, h, d), LSEs (h, T) FP32 natural log. Returns the merged output in the
    inputs' format and the merged LSE (h, T). prefill_tokens_with_context: rows from it on copy the suffix (None:
    every row merges). A row whose LSEs are both infinite gets the prefix's output and LSE -inf."""
    return _vllm_merge(prefix_output, prefix_lse, suffix_output, suffix_lse, prefill_tokens_with_context, machine,
                       pack=8, empty="prefix")  # merge_attn_states.cu: "we simply emit prefix_output"


def _vllm_merge(prefix_output, prefix_lse, suffix_output, suffix_lse, prefill_tokens_with_context, machine, *,
                pack: int, empty: str) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's merge, CUDA or Triton: rows whose LSEs are both infinite get the prefix's output (`empty` "prefix") or
    0 ("zero"), and LSE -inf; rows from `prefill_tokens_with_context` on copy the suffix."""
    po, pl, so, sl = _check(prefix_output, prefix_lse, suffix_output, suffix_lse, "hT", pack=pack)
    T = po.shape[0]
    n = T if prefill_tokens_with_context is None else check_int(prefill_tokens_with_context,
                                                                  "prefill_tokens_with_context", lo=0, hi=T)
    mc = get_machine(machine)
    o, lse, both_inf = _merge(mc, po, pl, so, sl)
    fmt = get_format(po.dtype).name
    if empty == "prefix":
        out = np.where(both_inf[..., None], po, mc.cast(o, fmt).astype(po.dtype))
    else:
        out = mc.cast(np.where(both_inf[..., None], 0, o), fmt).astype(po.dtype)
    lse = np.where(both_inf, np.float32(-np.inf), lse).astype(np.float32)
    out[n:], lse[n:] = so[n:], sl[n:]  # token_idx >= prefix_num_tokens: the suffix, copied
    return out, np.ascontiguousarray(lse.T)


@quiet_fp
def sglang_merge_state_v2(v_a: npt.ArrayLike, s_a: npt.ArrayLike, v_b: npt.ArrayLike, s_b: npt.ArrayLike, *,
                          machine: str | Machine = "sm90-cuda") -> tuple[np.ndarray, np.ndarray]:
    """SGLang's ``merge_state_v2`` (sgl-kernel, what ``merge_state`` runs for FP32/FP16/BF16 of a head size divisible
    by 8): a = the "prefix" operand, b the "suffix"; outputs (T, h, d), LSEs (T, h) FP32. Returns the merged output
    in the inputs' format and the merged LSE (T, h); where both LSEs are infinite, NaN."""
    po, pl, so, sl = _check(v_a, s_a, v_b, s_b, "Th")
    mc = get_machine(machine)
    o, lse, _ = _merge(mc, po, pl, so, sl)
    return mc.cast(o, get_format(po.dtype).name).astype(po.dtype), lse.astype(np.float32)


@quiet_fp
def vllm_merge_attn_states_triton(prefix_output: npt.ArrayLike, prefix_lse: npt.ArrayLike,
                                  suffix_output: npt.ArrayLike, suffix_lse: npt.ArrayLike, *,
                                  prefill_tokens_with_context: int | None = None,
                                  machine: str | Machine = "sm90-triton") -> tuple[np.ndarray, np.ndarray]:
    """vLLM's Triton fallback (``v1/attention/ops/triton_merge_attn_states.py``, ``merge_attn_states_kernel``): as
    :func:`vllm_merge_attn_states`, any head size, but a row whose LSEs are both infinite gets out 0 and LSE -inf
    (``tl.where(max_lse == -inf, ...)``). The FP8 output (``output_scale``) is not modelled."""
    return _vllm_merge(prefix_output, prefix_lse, suffix_output, suffix_lse, prefill_tokens_with_context, machine,
                       pack=1, empty="zero")


@quiet_fp
def sglang_merge_state_triton(v_a: npt.ArrayLike, s_a: npt.ArrayLike, v_b: npt.ArrayLike, s_b: npt.ArrayLike, *,
                              machine: str | Machine = "sm90-triton") -> tuple[np.ndarray, np.ndarray]:
    """SGLang's Triton fallback (``merge_state_triton``): as :func:`sglang_merge_state_v2`, any head size, NaN where
    both LSEs are infinite."""
    po, pl, so, sl = _check(v_a, s_a, v_b, s_b, "Th", pack=1)
    mc = get_machine(machine)
    o, lse, _ = _merge(mc, po, pl, so, sl)
    return mc.cast(o, get_format(po.dtype).name).astype(po.dtype), lse.astype(np.float32)


def vllm_context_then_new(outputs: Sequence[npt.ArrayLike], lses: Sequence[npt.ArrayLike], *,
                          machine: str | Machine = "sm90-cuda-precise") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM 0.33's chunked-context prefill (``mla_attention.py``): the context chunks' partials ``outputs[:-1]`` folded
    in order, each later chunk the suffix of the running partial (``accumulate_mla_context_chunk``), then the new
    tokens' partial ``outputs[-1]`` as the suffix of the context (``forward_mha``). LSEs (h, T). Returns the final
    output, the context's output and its LSE."""
    if len(outputs) != len(lses) or len(outputs) < 2:
        raise ValueError(f"outputs, lses: one LSE an output, two or more partials, got {len(outputs)} and {len(lses)}")
    acc, acc_lse = np.asarray(outputs[0]), np.asarray(lses[0])
    for o, l in zip(outputs[1:-1], lses[1:-1]):
        acc, acc_lse = vllm_merge_attn_states(acc, acc_lse, o, l, machine=machine)
    out, _ = vllm_merge_attn_states(acc, acc_lse, outputs[-1], lses[-1], machine=machine)
    return out, acc, acc_lse


def sglang_new_then_chunks(new_output: npt.ArrayLike, new_lse: npt.ArrayLike, outputs: Sequence[npt.ArrayLike],
                           lses: Sequence[npt.ArrayLike], *, machine: str | Machine = "sm90-cuda"
                           ) -> tuple[np.ndarray, np.ndarray]:
    """SGLang 0.5.23's chunked-prefix prefill (``forward_mha.py`` ``_chunked_prefix_attn_mha``): the accumulator starts
    as the new tokens' partial and each prefix chunk is merged into it as the *prefix* operand (the accumulator the
    suffix), the reverse of vLLM's order. LSEs (T, h). Returns the final output and LSE."""
    if len(outputs) != len(lses):
        raise ValueError(f"outputs, lses: one LSE an output, got {len(outputs)} and {len(lses)}")
    acc, acc_lse = np.asarray(new_output), np.asarray(new_lse)
    for o, l in zip(outputs, lses):
        acc, acc_lse = sglang_merge_state_v2(o, l, acc, acc_lse, machine=machine)
    return acc, acc_lse

"""The absorbed MLA projections around the attention kernel, as the engines' deterministic modes compute them:
``q_nope W_UK`` before the absorbed kernel (q (T, h, 128) -> (T, h, 512)) and ``attn W_UV`` after it ((T, h, 512)
-> (T, h, 128)), each a batched product over the heads.

In batch-invariant mode both engines replace ``aten::bmm`` with a Triton kernel of their own: vLLM 0.33's
``bmm_batch_invariant`` (``model_executor/determinism/batch_invariant.py:363-493, 831-918``, a program per (head,
128 x 128 tile)) and SGLang 0.5.23's (``srt/batch_invariant_ops/batch_invariant_ops.py:636-849``, persistent over the
same tiles). Both walk K in ``tl.dot``s of 64 into one FP32 accumulator, ``acc = tl.dot(a, b, acc)``, and round the
tile to BF16 once: on sm90 the dots are wgmma chains that carry the accumulator, so a row's output is one fused
chain over K in order, whatever the tile, the grid or the token count (``sm90-triton``'s matrix unit).

cuBLAS's ``torch.bmm`` (each engine's normal mode) is not one kernel: its heuristics pick by shape. On the shapes of
:data:`CUBLAS_CHECKED` (an H200, CUDA 13.0's cuBLAS through torch 2.11) it gave these bits too; on others it is not
modelled.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ...formats import get_format
from ...machines import Machine, get_machine

__all__ = ["bmm_batch_invariant", "w_uk", "w_uv", "BMM_BLOCK_K", "CUBLAS_CHECKED"]

#: the K extent of one ``tl.dot`` in both engines' BF16 configuration (BLOCK_M 128, BLOCK_N 128, BLOCK_K 64)
BMM_BLOCK_K = 64
#: (tokens, heads) of the W_UK and W_UV products whose cuBLAS bits were the model's through both engines' calls
#: (``scripts/capture_bmm.py``, ``scripts/capture_layer.py``): every one captured
CUBLAS_CHECKED = frozenset([(1, 16), (5, 16), (64, 16), (300, 16), (1024, 16), (4, 128)] + [
    (m, h) for h in (16, 32, 64, 128) for m in (1, 2, 3, 4, 8, 16, 32, 64, 76, 128, 150, 256, 300, 512)])


def bmm_batch_invariant(a: npt.ArrayLike, b: npt.ArrayLike, *, machine: str | Machine = "sm90-triton") -> np.ndarray:
    """``bmm_batch_invariant(a, b)``: a (B, M, K) and b (B, K, N), BF16; returns (B, M, N) BF16."""
    a, b = np.asarray(a), np.asarray(b)
    for name, x in (("a", a), ("b", b)):
        fmt = get_format(x.dtype).name if x.dtype.kind in "fV" else None
        if x.ndim != 3 or fmt != "bf16":
            raise ValueError(f"{name}: expected a BF16 (batch, rows, columns) array, got {x.dtype} {x.shape}")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"b: expected ({a.shape[0]}, {a.shape[2]}, N) for a of {a.shape}, got {b.shape}")
    mc = get_machine(machine)
    return mc.cast(mc.matmul(mc.operand(a), mc.operand(b), dot_k=BMM_BLOCK_K), "bf16")


def w_uk(q_nope: npt.ArrayLike, W_UK: npt.ArrayLike, *, machine: str | Machine = "sm90-triton") -> np.ndarray:
    """The query's absorption: q_nope (T, h, 128) by W_UK (h, 128, 512) -> (T, h, 512) BF16 (vLLM
    ``mla_attention.py:1100-1105``, SGLang ``forward_mla.py:586``)."""
    return _per_head(q_nope, W_UK, ("q_nope", "W_UK"), machine)


def w_uv(attn: npt.ArrayLike, W_UV: npt.ArrayLike, *, machine: str | Machine = "sm90-triton") -> np.ndarray:
    """The output's up-projection: attn (T, h, 512) by W_UV (h, 512, 128) -> (T, h, 128) BF16 (vLLM
    ``_v_up_proj``, ``mla_attention.py:1403-1435``; SGLang ``forward_mla.py:916-932``)."""
    return _per_head(attn, W_UV, ("attn", "W_UV"), machine)


def _per_head(x: npt.ArrayLike, w: npt.ArrayLike, names: tuple[str, str], machine: str | Machine) -> np.ndarray:
    """x (T, h, K) by w (h, K, N) as the engines call the bmm (heads the batch), (T, h, N); errors name the
    caller's arguments."""
    xa, wa = np.asarray(x), np.asarray(w)
    if xa.ndim != 3 or wa.ndim != 3 or wa.shape[:2] != (xa.shape[1], xa.shape[2]):
        raise ValueError(f"{names[0]}, {names[1]}: expected (T, h, K) and (h, K, N), got {xa.shape} and {wa.shape}")
    try:
        out = bmm_batch_invariant(xa.transpose(1, 0, 2), wa, machine=machine)
    except ValueError as e:
        raise ValueError(str(e).replace("a:", f"{names[0]}:", 1).replace("b:", f"{names[1]}:", 1)) from None
    return np.ascontiguousarray(out.transpose(1, 0, 2))

"""Host side of the Triton kernels: NumPy in, NumPy out."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace

import numpy as np

from . import require_gpu, to_torch

ALGOS = {"base": 0, "amla": 1, "snapmla": 2, "etap": 3}
EXP_MODES = {"hw": 0, "poly": 1}
DIV_MODES = {"hw": 0, "ieee": 1}
BLOCK_M = BLOCK_N = 64
D_K, D_V = 576, 512  # DeepSeek-V3 MLA: the kernels are compiled for these (V = the first D_V of K)


_STAGE_SHAPES = {"S": "block", "P": "block", "m": "row", "l": "row", "n": "row", "N": "row", "O": "dv"}


def _debug_buffers(stages: str, b: int, nblk: int, R: int, debug: bool, torch, device: str) -> dict:
    """Per-block stage buffers for a DEBUG launch (1-element dummies otherwise); N is int32, the rest FP32."""
    bufs = {}
    for k in stages:
        dt = torch.int32 if k == "N" else torch.float32
        if not debug:
            bufs[k] = torch.zeros(1, device=device, dtype=dt)
            continue
        tail = {"block": (BLOCK_N,), "row": (), "dv": (D_V,)}[_STAGE_SHAPES[k]]
        bufs[k] = torch.zeros((b, nblk, R, *tail), device=device, dtype=dt)
    return bufs


def _collect(out, dbg: dict, debug: bool, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The BF16 output as ml_dtypes, and with `debug` every stage with its block axis first."""
    import ml_dtypes
    import torch

    torch.cuda.synchronize()
    res = {"out": out.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16).reshape(shape)}
    if debug:
        for k, v in dbg.items():
            res[k] = np.moveaxis(v.cpu().numpy(), 1, 0)  # (n_blocks, b, R, ...)
    return res


def _to_torch(x: np.ndarray, torch, device: str):
    import ml_dtypes

    if x.dtype != np.dtype(ml_dtypes.bfloat16):
        raise TypeError(f"q and kv: the kernels take bfloat16 inputs, got {x.dtype}")
    return to_torch(x, device)


def run_kernel(
    algorithm: str,
    q: np.ndarray,
    kv: np.ndarray,
    *,
    scale: float | None = None,
    exp_mode: str = "poly",
    div_mode: str = "ieee",
    debug: bool = False,
    device: str = "cuda",
    quantized: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Run the Triton kernel of `algorithm` (base | amla | snapmla | etap) on q: (b, s_q, G, 576), kv: (b, S, 576)
    BF16.

    exp_mode: ``hw`` (tl.exp) or ``poly`` (the exact software exp); div_mode: ``hw`` ('/') or ``ieee``.
    quantized: for snapmla, the FP8 cache and query and their scales (the cache write is not a kernel):
    ``amla_sim.crosscheck.own.device_run`` makes them with the simulator's quantizer.
    Returns ``out`` (b, s_q, G, 512) BF16 and, with `debug`, the per-block stages S, P, m, l, n, N, O with a
    leading block axis: arrays of shape (n_blocks, b, R, ...).
    """
    require_gpu()
    import torch

    from .kernels import mla_decode_kernel

    for arg, val, allowed in (("algorithm", algorithm, ALGOS), ("exp_mode", exp_mode, EXP_MODES),
                              ("div_mode", div_mode, DIV_MODES)):
        if val not in allowed:
            raise ValueError(f"{arg}: expected one of {sorted(allowed)}, got {val!r}")
    b, s_q, G, D = q.shape
    S = kv.shape[1]
    if D != D_K or kv.shape != (b, S, D_K):
        raise ValueError(f"q and kv: expected (b, s_q, G, {D_K}) and (b, S, {D_K}), got {q.shape} and {kv.shape}")
    if algorithm == "snapmla":
        if quantized is None:
            raise ValueError("quantized: the snapmla kernel takes the quantized cache and query "
                             "(amla_sim.crosscheck.own.device_run makes them)")
        return _run_snapmla(q, quantized, exp_mode=exp_mode, div_mode=div_mode, debug=debug, device=device)
    R, DV = s_q * G, D_V
    nblk = -(-S // BLOCK_N)
    scale = 1.0 / math.sqrt(D_K) if scale is None else float(scale)
    qt = _to_torch(q.reshape(b, R, D), torch, device)
    kvt = _to_torch(kv, torch, device)
    out = torch.empty((b, R, DV), device=device, dtype=torch.bfloat16)
    grid = (triton_cdiv(R, BLOCK_M), b, 2)
    modes = dict(EXP_MODE=EXP_MODES[exp_mode], DIV_MODE=DIV_MODES[div_mode], DEBUG=debug, num_warps=4, num_stages=1,
                 enable_fp_fusion=False)
    if algorithm == "etap":
        from .kernels import etap_decode_kernel

        dbg = _debug_buffers("SPmO", b, nblk, R, debug, torch, device)
        etap_decode_kernel[grid](qt, kvt, out, dbg["S"], dbg["P"], dbg["m"], dbg["O"], R, S, G, s_q, nblk, scale,
                                 D=D_K, DV=DV, DVH=DV // 2, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **modes)
        return _collect(out, dbg, debug, (b, s_q, G, DV))
    obuf = torch.zeros((b, R, DV), device=device, dtype=torch.float32)
    dbg = _debug_buffers("SPmlnNO", b, nblk, R, debug, torch, device)
    mla_decode_kernel[grid](
        qt, kvt, out, obuf, obuf.view(torch.int32),
        dbg["S"], dbg["P"], dbg["m"], dbg["l"], dbg["n"], dbg["N"], dbg["O"],
        R, S, G, s_q, nblk, scale,
        D=D_K, DV=DV, DVH=DV // 2, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, ALGO=ALGOS[algorithm], **modes,
    )
    return _collect(out, dbg, debug, (b, s_q, G, DV))


def _run_snapmla(q, quantized, *, exp_mode, div_mode, debug, device) -> dict[str, np.ndarray]:
    """SnapMLA's kernel on inputs quantized by the caller."""
    import torch

    from .kernels import snapmla_decode_kernel

    b, s_q, G, _ = q.shape
    qz = SimpleNamespace(**quantized)
    R, DV, S, S_pad = s_q * G, D_V, int(qz.context), qz.c8.shape[1]
    nblk = S_pad // BLOCK_N

    args = [to_torch(x, device) for x in (qz.q8, qz.qr, np.float32(qz.row_scale), qz.c8, qz.kr, np.float32(qz.s_k))]
    out = torch.empty((b, R, DV), device=device, dtype=torch.bfloat16)
    dbg = _debug_buffers("SPmlO", b, nblk, R, debug, torch, device)
    snapmla_decode_kernel[(triton_cdiv(R, BLOCK_M), b, 2)](
        *args, out, dbg["S"], dbg["P"], dbg["m"], dbg["l"], dbg["O"], R, S, S_pad, G, s_q, nblk,
        DV=DV, DR=64, DVH=DV // 2, TILE=128, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        EXP_MODE=EXP_MODES[exp_mode], DIV_MODE=DIV_MODES[div_mode], DEBUG=debug,
        num_warps=4, num_stages=1, enable_fp_fusion=False,
    )
    return _collect(out, dbg, debug, (b, s_q, G, DV))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

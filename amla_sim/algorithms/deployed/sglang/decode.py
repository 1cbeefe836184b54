"""SGLang's Triton MLA decode (``decode_attention_fwd``, the grouped stage 1 + stage 2 path DeepSeek models take),
written against a machine.

Upstream: sgl-project/sglang 0.5.23 (the wheel), ``sglang/kernels/ops/attention/decode_attention.py``.

The split/merge decode of :mod:`amla_sim.algorithms.deployed.splitkv` with SGLang's parameters: the request's L
tokens are cut into splits of ``cdiv(cdiv(L, num_kv_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV`` tokens (per request,
the count from :mod:`amla_sim.algorithms.deployed.sglang.scheduler`), one query a request, and stage 2's output
``bf16(acc / l * v_scale)``. With one query head (a KV head's group of one) SGLang takes its MHA kernel,
``decode_attention_fwd_normal`` (:mod:`amla_sim.algorithms.deployed.splitkv_mha`: BF16 products summed in FP32;
its own 64-key blocks and 4 warps, whatever `block_n`, `block_h` and `num_warps` say), and the same stage 2.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....machines import Machine, get_machine
from ....resources import check_fits
from ..._common import check_kernel_inputs
from ..scalars import api_float, softmax_scale
from ..splitkv import SplitKVResult, split_ranges, stage1, stage2
from ..splitkv_mha import stage1_mha

__all__ = ["splitkv_decode", "SGLANG_VERSION"]

SGLANG_VERSION = "0.5.23"


def _check(q, kv, seqlens, num_kv_splits, max_kv_splits, block_n, block_h, min_block_kv, page_size, logit_cap,
           num_warps, num_stages):
    qa, kva, lens = check_kernel_inputs(q, kv, seqlens, one_query=True, empty=True)  # no key: 0 / 0, as the kernel
    b = qa.shape[0]
    splits = np.broadcast_to(np.asarray(num_kv_splits), (b,)) if np.ndim(num_kv_splits) == 0 else \
        np.asarray(num_kv_splits)
    if isinstance(num_kv_splits, bool) or splits.shape != (b,) or splits.dtype.kind not in "iu" or splits.min() < 1:
        raise ValueError(f"num_kv_splits: expected a positive int or {b} of them, got {num_kv_splits!r}")
    # stage 1's grid is (b, heads / block_h, max_kv_splits): CUDA's z extent is at most 65535
    max_splits = int(splits.max()) if max_kv_splits is None else check_int(max_kv_splits, "max_kv_splits", lo=1)
    if max_splits > _MAX_GRID_Z:
        raise ValueError(f"max_kv_splits: at most {_MAX_GRID_Z} (stage 1's grid holds it in CUDA's z extent), "
                         f"got {max_splits}")
    if splits.max() > max_splits:
        raise ValueError(f"max_kv_splits: {max_splits} is below num_kv_splits ({int(splits.max())})")
    check_int(block_n, "block_n", lo=8)
    if block_n % 8:
        raise ValueError(f"block_n: a multiple of 8 (mma.sync's n), got {block_n}")
    if check_int(block_h, "block_h", lo=1) != 16:
        raise ValueError(f"block_h: only SGLang's 16 is modelled (others change the tensor-core instruction), got "
                         f"{block_h}")
    check_int(min_block_kv, "min_block_kv", lo=1)
    check_int(page_size, "page_size", lo=1)
    check_int(num_stages, "num_stages", lo=1)
    check_int(num_warps, "num_warps", lo=1)
    if isinstance(logit_cap, (bool, np.bool_)) or not isinstance(logit_cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"logit_cap: expected a number, got {logit_cap!r}")
    if not logit_cap <= 0:  # the kernel caps only where logit_cap > 0 (decode_attention.py:710)
        raise ValueError(f"logit_cap: a cap (logit_cap > 0) is not modelled; 0 or below is no cap, DeepSeek's "
                         f"setting, got {logit_cap!r}")
    check_fits(_BYTES_PER_SPLIT * b * qa.shape[2] * max_splits, what=f"splitkv_decode with max_kv_splits={max_splits}",
               lower="max_kv_splits")
    return qa, kva, lens, splits.astype(np.int64), max_splits


_MAX_GRID_Z = 65535
_BYTES_PER_SPLIT = 3 * 8 * (512 + 1)  # per row and split: mid and lse in float64, and the copies made of them


@quiet_fp
def splitkv_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike | None = None,
    num_kv_splits: int | npt.ArrayLike = 8,
    max_kv_splits: int | None = None,
    scale: float | None = None,
    v_scale: float = 1.0,
    block_n: int = 32,
    block_h: int = 16,
    min_block_kv: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    page_size: int = 1,
    logit_cap: float = 0.0,
    machine: str | Machine = "sm90-triton",
    trace: bool = False,
) -> SplitKVResult:
    """SGLang's grouped MLA decode on `machine` (see the module docstring).

    q: (b, 1, heads, 576) BF16; kv: (b, S_max, 576) BF16, rows past ``seqlens[i]`` ignored, V its first 512
    columns. num_kv_splits: per request (or one for all), what SGLang's scheduler passes; max_kv_splits: the
    launch's maximum (default: the largest of them). num_stages and page_size change no bits (software
    pipelining; addressing) and are checked only.
    """
    mc = get_machine(machine)
    mc.require(kernel="sglang-triton", natural_log=True, suggest="sm90-triton")
    qa, kva, lens, splits, max_splits = _check(q, kv, seqlens, num_kv_splits, max_kv_splits, block_n, block_h,
                                               min_block_kv, page_size, logit_cap, num_warps, num_stages)
    sm, vs = softmax_scale(scale), api_float(v_scale, "v_scale")
    ranges = split_ranges(lens, splits, max_splits, min_block_kv)
    Q = mc.cast(qa, "bf16")[:, 0]  # (b, H, 576)
    K = mc.cast(kva, "bf16")
    tr: dict[str, list[np.ndarray]] = {}
    if Q.shape[1] == 1:  # kv_group_num 1: decode_attention_fwd_normal, the MHA kernel (decode_attention.py:1269)
        mid, lse = stage1_mha(mc, Q, K, ranges, mc.f(sm), bf16_sum=False)
    else:
        mid, lse = stage1(mc, Q, K, ranges, mc.f(sm), block_n, num_warps, tr if trace else None)
    out, _ = stage2(mc, mid, lse, ranges, mc.f(vs))
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    return SplitKVResult(mc.cast(out, "bf16")[:, None], lse, mid, ranges, tr, hazards)



"""FlashInfer's MLA on Hopper (flashinfer-python 0.7.2, the version SGLang 0.5.23 pins): the package imported from a
folder (an unpacked wheel, whose MLA module FlashInfer compiles on first use with its own JIT flags), called as
SGLang's ``flashinfer`` MLA backend calls it (``BatchMLAPagedAttentionWrapper(workspace, backend="auto")``,
``plan`` with page size 1 and the legacy positional arguments, ``run(q_nope, q_pe, ckv, kpe)`` on views of one
576-wide cache), and with FlashInfer's own FP8 cache (``scale_mode="kv-per-tensor"``) and pages of 64."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .. import require_gpu
from ._common import bits16, shuffled_pages

__all__ = ["load_flashinfer", "run_flashinfer_mla"]

_WORKSPACE = 512 << 20  # SGLang's float workspace for the MLA wrappers (flashinfer_mla_backend.py)


def load_flashinfer(folder: str | Path, version: str):
    """``flashinfer`` imported from `folder` (it holds the package, e.g. an unpacked flashinfer-python wheel with
    apache-tvm-ffi beside it), after checking that it is `version` (the one the model follows)."""
    require_gpu()
    root = Path(folder)
    if not (root / "flashinfer" / "mla" / "__init__.py").is_file():
        raise FileNotFoundError(f"flashinfer-mla: {folder} holds no flashinfer package (flashinfer/mla/__init__.py)")
    sys.path.insert(0, str(root))
    import flashinfer

    if flashinfer.__version__ != version:
        raise RuntimeError(f"flashinfer-mla: {folder} holds flashinfer {flashinfer.__version__}, the model follows "
                           f"{version}")
    return flashinfer


def run_flashinfer_mla(fi, q: np.ndarray, kv: np.ndarray, recipe: dict) -> dict[str, np.ndarray]:
    """One case on the GPU: q (b, s_q, h, 576) BF16 bits, kv (b, S_max, 576) BF16 bits or, for an E4M3 cache,
    E4M3 codes (uint8); request i's rows in shuffled pages of ``page_size``. The first ``keep`` requests' out
    ((keep s_q, h, 512) BF16 bits), every row's base-2 LSE ((b s_q, h) FP32 bits) and the plan's 18 values
    (``MLAPlanInfo``, int64) are returned."""
    import torch

    b, sq, H, _ = q.shape
    lens, page, e4m3 = [int(n) for n in recipe["seqlens"]], recipe["page_size"], recipe["kv_format"] == "e4m3"
    qt = bits16(torch, q.reshape(b * sq, H, q.shape[-1]))
    if e4m3:
        reqs = [torch.from_numpy(np.ascontiguousarray(kv[i, :n])).cuda().view(torch.float8_e4m3fn)
                for i, n in enumerate(lens)]
        cache, table = shuffled_pages(torch, [r.view(torch.uint8) for r in reqs], page, recipe["seed"], torch.uint8)
        cache = cache.view(torch.float8_e4m3fn)
    else:
        reqs = [bits16(torch, kv[i, :n]) for i, n in enumerate(lens)]
        cache, table = shuffled_pages(torch, reqs, page, recipe["seed"], torch.bfloat16)
    pages = [-(-n // page) for n in lens]
    kv_indices = torch.cat([table[i, :p] for i, p in enumerate(pages)]).int()
    kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
    qo_indptr = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    wrapper = fi.mla.BatchMLAPagedAttentionWrapper(torch.empty(_WORKSPACE, dtype=torch.int8, device="cuda"),
                                                   backend="auto")
    kv_dtype = torch.float8_e4m3fn if e4m3 else torch.bfloat16
    extra = {"scale_mode": "kv-per-tensor"} if e4m3 else {}
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, H, 512, 64, page, bool(recipe["causal"]),
                 float(recipe["scale"]), torch.bfloat16, kv_dtype, **extra)
    backend = wrapper._planned_backend_name
    if backend != "fa3":
        raise RuntimeError(f"flashinfer-mla: the auto policy planned {backend!r}, not fa3 (sm90a's)")
    plan = np.asarray(list(wrapper._planned_backend._plan_info), np.int64)
    work = _staged_work(wrapper._planned_backend._pin_memory_int_workspace_buffer, plan,
                        torch.cuda.get_device_properties(0).multi_processor_count)
    scales = {"ckv_scale": float(recipe["ckv_scale"]), "kpe_scale": float(recipe["kpe_scale"])} if e4m3 else {}
    out = torch.empty((b * sq, H, 512), dtype=torch.bfloat16, device="cuda")
    out, lse = wrapper.run(qt[..., :512], qt[..., 512:], cache[..., :512], cache[..., 512:], out=out,
                           return_lse=True, **scales)
    torch.cuda.synchronize()
    keep = recipe["keep"] * sq
    return {"out": out[:keep].contiguous().view(torch.int16).cpu().numpy().view(np.uint16),
            "lse": lse.contiguous().cpu().numpy().view(np.uint32), "plan": plan, "work": work}


def _staged_work(pinned, plan: np.ndarray, num_sms: int) -> np.ndarray:
    """The plan's work lists as ``plan`` wrote them to the pinned int workspace, concatenated in
    :data:`~amla_sim.algorithms.deployed.flashinfer.scheduler.STAGED_ARRAYS` order (int32): the work lists as long as the plan's works, the merge arrays one entry an SM,
    ``work_indptr`` one entry a cluster and one."""
    import torch

    ints = pinned.view(-1).view(torch.int32).numpy()
    offsets, clusters = [int(o) // 4 for o in plan[2:16]], int(plan[1])
    indptr = ints[offsets[13]:offsets[13] + clusters + 1]
    works = int(indptr[-1])
    lengths = [works] * 3 + [num_sms] * 5 + [works] * 5 + [clusters + 1]
    return np.concatenate([ints[o:o + n] for o, n in zip(offsets, lengths)]).astype(np.int32)

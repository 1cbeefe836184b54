"""FlashInfer's MLA on Hopper (flashinfer-python 0.7.2, the version SGLang 0.5.23 pins), from a flashinfer-ai/flashinfer
checkout: its sm90 MLA module compiled by this project's build code with FlashInfer's JIT flags
(:mod:`.flashinfer_build`), the checkout's own Python wrapper calling it as SGLang's ``flashinfer`` MLA backend does
(``BatchMLAPagedAttentionWrapper(workspace, backend="auto")``, ``plan`` with page size 1 and the legacy positional
arguments, ``run(q_nope, q_pe, ckv, kpe)`` on views of one 576-wide cache), with FlashInfer's own FP8 cache
(``scale_mode="kv-per-tensor"``) and pages of 64, and as vLLM's ``FLASHINFER_MLA_SPARSE_SM90`` backend does."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

from .. import require_gpu
from ._build import checkout_files
from ._common import bits16, shuffled_pages
from .flashinfer_build import FLASHINFER_CHECKOUT, NEEDS, SOURCES, build_mla_module, checkout_version

__all__ = ["load_flashinfer", "run_flashinfer_mla", "run_flashinfer_mla_sparse"]

_WORKSPACE = 512 << 20  # SGLang's float workspace for the MLA wrappers (flashinfer_mla_backend.py)


def load_flashinfer(checkout: str | Path, version: str):
    """``flashinfer`` imported from `checkout` (after checking that it is `version`, the one the model follows), its
    MLA wrapper's module loader pointed at this project's build of the checkout's sources: the fa3 module is
    compiled on first use of a format pair and head layout (the compile named on stderr, with its time); a plan that
    FlashInfer's auto policy hands to another backend (fa2) is refused, as the model follows fa3 alone."""
    require_gpu()
    root = checkout_files(checkout, "flashinfer-mla", NEEDS, FLASHINFER_CHECKOUT).resolve()
    found = checkout_version(root)  # a git checkout's package says 0.0.0+unknown until pip builds it
    if found != version:
        raise RuntimeError(f"flashinfer-mla: {checkout} holds flashinfer {found}, the model follows {version}")
    sys.path.insert(0, str(root))
    import flashinfer
    import torch
    import tvm_ffi
    from flashinfer.jit.attention.modules import _BatchMLAModuleProxy
    from flashinfer.mla._batch_mla._backends import fa2_backend, fa3_backend

    if Path(flashinfer.__file__).resolve().parent != root / "flashinfer":
        raise RuntimeError(f"flashinfer-mla: flashinfer was already imported from {flashinfer.__file__}, not "
                           f"{checkout}")
    names = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "e4m3"}

    @functools.lru_cache(maxsize=None)
    def fa3_module(backend, dtype_q, dtype_kv, dtype_o, dtype_idx, head_dim_ckv, head_dim_kpe, use_profiler):
        # the arguments of _fa_common.get_batch_mla_module, which fa3_backend.py:92-101 calls
        if (backend, dtype_o, dtype_idx, use_profiler) != ("fa3", dtype_q, torch.int32, False) or dtype_q not in names \
                or dtype_kv not in names:
            raise RuntimeError(f"flashinfer-mla: this build makes the fa3 module with q = out in BF16/FP16, int32 "
                               f"indices and no profiler, not {backend}, {dtype_q}, {dtype_o}, {dtype_idx}")
        layout = {"q": names[dtype_q], "kv": names[dtype_kv], "head_dim_ckv": head_dim_ckv,
                  "head_dim_kpe": head_dim_kpe}
        library, seconds = build_mla_module(root, **layout)
        if seconds:
            print(f"flashinfer-mla: compiled csrc/{{{','.join(s[:-3] for s in SOURCES)}}}.cu of {root} "
                  f"({', '.join(f'{k} {v}' for k, v in layout.items())}) in {seconds:.0f} s", file=sys.stderr)
        return _BatchMLAModuleProxy(tvm_ffi.load_module(str(library)))

    def fa2_module(*args):
        raise RuntimeError("flashinfer-mla: FlashInfer's auto policy fell back to its fa2 kernel, which the model "
                           "does not follow (sm90a runs fa3 on every call the model takes)")

    fa3_backend.get_batch_mla_module = fa3_module
    fa2_backend.get_batch_mla_module = fa2_module
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


_SPARSE_WORKSPACE = 128 << 20  # vLLM's FLASHINFER_MLA_SPARSE_SM90 float workspace (flashinfer_mla_sparse_sm90.py)


def run_flashinfer_mla_sparse(fi, q: np.ndarray, rows: np.ndarray, indices: np.ndarray,
                              recipe: dict) -> dict[str, np.ndarray]:
    """vLLM 0.33's ``FLASHINFER_MLA_SPARSE_SM90`` call (``flashinfer_mla_sparse_sm90.py``): q (T, h, 512) BF16
    bits, the latent cache rows (N, 512) as BF16 bits or E4M3 codes, indices (T, topk) cache rows with -1 anywhere
    (the indexer's order). The wrapper as vLLM makes it (``use_cuda_graph=True``, ``backend="fa3"``, buffers for
    ``max_num_batched_tokens`` rows, :259-289); each token a row of one query whose ``kv_indices`` are its valid
    slots packed to the front in order (:90-109); the plan padded with empty rows (:343-376), from each row's
    valid count plus ``upper_bound`` (capped at topk) with the work items' kv_end then clamped on the device to
    the valid count (``_clamp_work_kv_end`` :112-143; ``upper_bound`` 0: the exact plan); ``run(q_nope, q_pe
    (width 0), ckv, kpe (width 0))`` with ``ckv_scale=k_scale, kpe_scale=1.0`` for E4M3 (:593-646), no LSE.
    Returns the first ``keep`` tokens' out, every token's base-2 LSE from a second run with ``return_lse=True``
    (its out checked identical: ``lse_run_same_out``), the plan's 18 values and its staged work lists."""
    import torch

    T, H, _ = q.shape
    topk, e4m3, rows_planned = indices.shape[1], recipe["kv_format"] == "e4m3", int(recipe["max_num_batched_tokens"])
    qt = bits16(torch, q)
    if e4m3:
        flat = torch.from_numpy(np.ascontiguousarray(rows)).cuda().view(torch.float8_e4m3fn)
    else:
        flat = bits16(torch, rows)
    flat = flat.view(rows.shape[0], 1, 512)
    ckv, kpe = flat[..., :512], flat[..., 512:]
    valid = indices >= 0
    counts = valid.sum(axis=1).astype(np.int32)
    packed = [row[ok] for row, ok in zip(indices, valid)]  # valid slots to the front, in order
    planned = np.minimum(counts + int(recipe["upper_bound"]), topk).astype(np.int32) if recipe["upper_bound"] \
        else counts
    z = lambda n, v=0: torch.full((n,), v, dtype=torch.int32, device="cuda")  # noqa: E731
    reserved = z(rows_planned * topk)
    wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(_SPARSE_WORKSPACE, dtype=torch.uint8, device="cuda"), qo_indptr=z(rows_planned + 1),
        kv_indptr=z(rows_planned + 1), kv_indices=reserved, kv_len_arr=z(rows_planned, topk), use_cuda_graph=True,
        backend="fa3")
    lens = np.zeros(rows_planned, np.int32)
    lens[:T] = planned
    kv_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    idx = np.zeros(int(kv_indptr[-1]), np.int32)
    for r in range(T):  # a row's planned slots past its valid ones repeat its first slot (0 if it has none)
        first = int(packed[r][0]) if len(packed[r]) else 0
        idx[kv_indptr[r]:kv_indptr[r + 1]] = first
        idx[kv_indptr[r]:kv_indptr[r] + counts[r]] = packed[r]
    total = max(int(kv_indptr[-1]), 1)
    reserved[:idx.size] = torch.from_numpy(idx).cuda()
    qo = torch.clamp(torch.arange(rows_planned + 1, dtype=torch.int32), max=T)
    wrapper.plan(qo, torch.from_numpy(kv_indptr), reserved[:total], torch.from_numpy(lens), H, 512, 0, 1, False,
                 float(recipe["scale"]), q_data_type=torch.bfloat16,
                 kv_data_type=torch.float8_e4m3fn if e4m3 else torch.bfloat16)
    plan = np.asarray(list(wrapper._plan_info), np.int64)
    work = _staged_work(wrapper._planned_backend._pin_memory_int_workspace_buffer, plan,
                        torch.cuda.get_device_properties(0).multi_processor_count)
    if recipe["upper_bound"]:  # _clamp_work_kv_end: kv_end = max(min(kv_end, valid[q]), kv_start), on the device
        ws = wrapper._planned_backend._int_workspace_buffer.view(torch.int32)
        nw = int(ws[int(plan[15]) // 4 + int(plan[1])])
        qi = ws[int(plan[2]) // 4:][:nw].long()
        ks, ke = ws[int(plan[13]) // 4:][:nw], ws[int(plan[14]) // 4:][:nw]
        valid_dev = torch.from_numpy(np.concatenate([counts, np.zeros(rows_planned - T, np.int32)])).cuda()
        ke.copy_(torch.maximum(torch.minimum(ke, valid_dev[qi]), ks))
    scales = {"ckv_scale": float(recipe["k_scale"]), "kpe_scale": 1.0} if e4m3 else {}
    q_nope, q_pe = qt, qt.new_empty(T, H, 0)
    out = wrapper.run(q_nope, q_pe, ckv, kpe, **scales)
    out = out[0] if isinstance(out, tuple) else out
    out2, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, **scales)
    torch.cuda.synchronize()
    same = bool(torch.equal(out.view(torch.int16), out2.view(torch.int16)))
    keep = recipe["keep"]
    return {"out": out[:keep].contiguous().view(torch.int16).cpu().numpy().view(np.uint16),
            "lse": lse[:T].contiguous().cpu().numpy().view(np.uint32), "plan": plan, "work": work,
            "lse_run_same_out": np.array([same])}

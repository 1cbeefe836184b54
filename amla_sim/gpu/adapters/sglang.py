"""SGLang's Triton MLA decode: the installed ``sglang`` package's ``sglang.kernels.ops.attention.decode_attention``,
or that file from the wheel (``pip download --no-deps sglang==0.5.23``) loaded with its sibling imports stubbed: on
CUDA the kernel module needs only ``is_hip``, the SM count and ``unpack_aux_tensors`` from them.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np

from .. import require_gpu
from ._common import bits16

__all__ = ["load_sglang", "run_sglang"]


def load_sglang(path: str | Path | None = None):
    """The kernel module: from the installed sglang when `path` is None, else from that file."""
    require_gpu()
    import torch

    if path is None:
        try:
            from sglang.kernels.ops.attention import decode_attention
        except ImportError as e:
            raise FileNotFoundError(f"sglang: not installed ({e}); pass the kernel file from the wheel "
                                    "(pip download --no-deps sglang==0.5.23)") from None
        return decode_attention
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sglang: {path} is not a file")

    def module(name: str, **attrs) -> None:
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = []
            m.__dict__.update(attrs)
            sys.modules[name] = m

    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention", "sglang.srt"):
        module(name)

    def unpack_aux_tensors(score_mod, aux_tensors):  # what the wheel's score_mod.py returns without a score_mod
        if score_mod is not None:
            raise ValueError("score_mod: not supported by this adapter")
        return None, 0, 0, 0

    module("sglang.kernels.ops.attention.score_mod", unpack_aux_tensors=unpack_aux_tensors)
    module("sglang.srt.environ", envs=None)
    module("sglang.srt.utils", is_hip=lambda: False, is_gfx95_supported=lambda: False,
           is_gfx1250_supported=lambda: False,
           get_device_core_count=lambda i=0: torch.cuda.get_device_properties(i).multi_processor_count)
    spec = importlib.util.spec_from_file_location("sglang.kernels.ops.attention.decode_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_sglang(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, num_kv_splits, max_kv_splits: int,
               scale: float, v_scale: float = 1.0) -> dict[str, np.ndarray]:
    """``decode_attention_fwd`` on (b, H, 576) BF16 queries and a (b, S_max, 576) cache of which request i uses
    its first seqlens[i] rows: the output (uint16 bits), stage 1's partial outputs and LSEs (uint32 bits)."""
    import torch

    b, H, _ = q_bits.shape
    rows = np.concatenate([kv_bits[i, :n] for i, n in enumerate(seqlens)])
    kbuf = bits16(torch, rows).view(-1, 1, rows.shape[-1])
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32, device="cuda")
    indices = torch.arange(int(sum(seqlens)), dtype=torch.int32, device="cuda")
    o = torch.full((b, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    mid = torch.full((b, H, max_kv_splits, 512), float("nan"), dtype=torch.float32, device="cuda")
    lse = torch.full((b, H, max_kv_splits), float("nan"), dtype=torch.float32, device="cuda")
    splits = torch.tensor(np.broadcast_to(num_kv_splits, (b,)), dtype=torch.int32, device="cuda")
    mod.decode_attention_fwd(bits16(torch, q_bits), kbuf, kbuf[..., :512], o, indptr, indices, mid, lse, splits,
                             max_kv_splits, scale, 1.0, v_scale, has_mla=True)
    torch.cuda.synchronize()
    return {"o": o.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "mid": mid.cpu().numpy().view(np.uint32)}

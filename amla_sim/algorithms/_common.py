"""What every attention algorithm shares: input checks, the MLA decode problem, blocks, masks, results."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from .._validate import check_int
from ..formats import as_native, get_format, is_float_dtype
from ..machines import Machine, get_machine
from ..schedules import Schedule, get_schedule

D_K, D_V, D_ROPE = 576, 512, 64
#: The default softmax scale, 576^-0.5, as FlashMLA's tests use.
DEFAULT_SCALE = 1.0 / math.sqrt(D_K)  # 576^-0.5, as FlashMLA's tests use
#: The scale DeepSeek-V3 runs with: 192^-0.5 mscale^2 (YaRN).
DEEPSEEK_V3_SCALE = 0.1352  # 192^-0.5 * mscale^2 (YaRN), what the model runs with


@dataclass
class AttentionResult:
    """An algorithm's output and what it saw on the way.

    out: (b, s_q, G, d_v) in BF16 (float64 on the golden machine). lse: (b, s_q, G), natural log, FP32/FP64.
    trace: per named stage (``S``, ``m``, ``l``, ``P``, ``n``, ``c``, ``N``, ``O``, ...), one array per block in
    processing order, when asked for. hazards: counters of numerical hazards (not errors).
    """

    out: np.ndarray
    lse: np.ndarray
    trace: dict[str, list[np.ndarray]] = field(default_factory=dict)
    hazards: Counter = field(default_factory=Counter)


@dataclass
class Problem:
    """One MLA decode step, flattened: rows r = (query position, head) of every batch."""

    machine: Machine
    schedule: Schedule
    Q: np.ndarray  # (b, R, d_k) in its storage format
    K: np.ndarray  # (b, S, d_k)
    V: np.ndarray  # (b, S, d_v)
    valid: np.ndarray  # (R, S) bool: which keys each row may see (causal within the MTP step)
    scale: float
    block: int
    shape: tuple[int, int, int]  # (b, s_q, G)
    trace: dict[str, list[np.ndarray]] | None
    out_format: str = "bf16"

    @property
    def d_v(self) -> int:
        return self.V.shape[-1]

    @cached_property
    def Qm(self) -> np.ndarray:
        """Q as the matrix unit takes it (:meth:`Machine.operand`), converted once, not once per block."""
        return self.machine.operand(self.Q)

    @cached_property
    def Km(self) -> np.ndarray:
        """K as the matrix unit takes it."""
        return self.machine.operand(self.K)

    @property
    def Vm(self) -> np.ndarray:
        """V as the matrix unit takes it."""
        return self.Km[..., : self.d_v]

    @property
    def n_blocks(self) -> int:
        return -(-self.K.shape[1] // self.block)

    def blocks(self, order: str = "forward") -> list[slice]:
        sl = [slice(j * self.block, min((j + 1) * self.block, self.K.shape[1])) for j in range(self.n_blocks)]
        return sl[::-1] if order == "backward" else sl

    def record(self, **stages: np.ndarray) -> None:
        """Append each named stage's value of this block to the trace (when tracing)."""
        if self.trace is not None:
            for name, value in stages.items():
                self.trace.setdefault(name, []).append(np.array(value, copy=True))

    def matmul(self, a: np.ndarray, b: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
        """``acc + a @ b`` on the machine's matrix unit, cut into ``tl.dot`` calls as the schedule says."""
        return self.machine.matmul(a, b, acc, dot_k=self.schedule.dot_k)

    def rowsum(self, x: np.ndarray) -> np.ndarray:
        """The row sum of a block's P, in the schedule's layout."""
        return self.machine.rowsum(x, layout=self.schedule.reduce_layout)

    def scores(self, blk: slice) -> np.ndarray:
        """S = (Q K_blk^T) * scale on the machine, masked keys at -inf (Alg. 1 lines 4-5)."""
        return self._scores[..., blk]

    @cached_property
    def _scores(self) -> np.ndarray:
        """The scores of every key: they do not depend on the softmax state, so every block's product is made at
        once where that gives the same bits (:meth:`Machine.matmul_blocks`)."""
        mc = self.machine
        kt = np.swapaxes(self.Km, -1, -2)
        S = mc.f(mc.matmul_blocks(self.Qm, kt, block=self.block, dot_k=self.schedule.dot_k)) * mc.f(self.scale)
        if not self.valid.all():
            S = np.where(self.valid[None], S, -np.inf)
        return S.astype(mc.dtype, copy=False)

    def finish(self, O: np.ndarray, l: np.ndarray, m: np.ndarray, hazards: Counter) -> AttentionResult:
        """Output in its storage format (golden: float64), shaped (b, s_q, G, d_v), and lse = m + log(l)."""
        mc = self.machine
        b, s_q, G = self.shape
        out = mc.cast(O, self.out_format).reshape(b, s_q, G, self.d_v)
        with np.errstate(divide="ignore", invalid="ignore"):
            lse = (mc.f(m) + np.log(mc.f(l))).astype(mc.dtype).reshape(b, s_q, G)
        nan = int(np.isnan(np.asarray(out, dtype=np.float64)).sum())
        if nan:
            hazards["nan_outputs"] += nan
        return AttentionResult(out, lse, self.trace or {}, hazards)


def _check_float(x: npt.ArrayLike, argname: str) -> np.ndarray:
    arr = as_native(x)
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{argname}: expected a float array (bf16, fp16, fp32, fp64), got dtype {arr.dtype}")
    return arr


def check_scale(scale: float | None) -> float:
    """The softmax scale (None: 576^-0.5) as a float, or an error naming it."""
    scale = DEFAULT_SCALE if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale) \
            or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)


def check_kernel_inputs(q: npt.ArrayLike, kv: npt.ArrayLike, seqlens: npt.ArrayLike | None, *,
                        one_query: bool = False, formats: tuple[str, ...] = ("bf16",),
                        kv_formats: tuple[str, ...] | None = None,
                        empty: bool = False, widths: tuple[int, ...] = (D_K,)
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a deployed kernel takes: q (b, s_q, h_q, 576) (s_q = 1 when `one_query`) and kv (b, S_max, 576), both
    in one of `formats` (BF16 unless the kernel takes others; the same for both, unless `kv_formats` says which
    the cache may be), and per-request lengths in 1..S_max (0..S_max where the kernel takes an `empty` request;
    None: S_max); errors name the argument. widths: the head widths the kernel takes (q's and kv's the same)."""
    qa = _check_storage(q, "q", formats)
    if kv_formats is None:
        kva = _check_storage(kv, "kv", (get_format(qa.dtype).name,), mixed=len(formats) > 1)
    else:
        kva = _check_storage(kv, "kv", kv_formats)
    if qa.ndim != 4 or qa.shape[-1] not in widths or min(qa.shape) < 1 or (one_query and qa.shape[1] != 1):
        w = " or ".join(map(str, widths))
        want = f"(b, 1, heads, {w}) (one query a request)" if one_query else f"(b, s_q, h_q, {w})"
        raise ValueError(f"q: expected shape {want}, got {qa.shape}")
    b, d = qa.shape[0], qa.shape[-1]
    if kva.ndim != 3 or kva.shape[0] != b or kva.shape[2] != d or kva.shape[1] < 1:
        raise ValueError(f"kv: expected shape ({b}, S_max, {d}), got {kva.shape}")
    lens = np.full(b, kva.shape[1]) if seqlens is None else np.asarray(seqlens)
    lo = 0 if empty else 1
    if lens.shape != (b,) or lens.dtype.kind not in "iu" or lens.min() < lo or lens.max() > kva.shape[1]:
        raise ValueError(f"seqlens: expected {b} ints in {lo}..{kva.shape[1]}, got {seqlens!r}")
    return qa, kva, lens.astype(np.int64)


def _check_storage(x: npt.ArrayLike, argname: str, formats: tuple[str, ...], mixed: bool = False) -> np.ndarray:
    """The deployed kernels take their storage formats only: anything else is an error naming the argument, not a
    silent cast. mixed: kv must match a q of one of several formats."""
    arr = _check_float(x, argname)
    name = get_format(arr.dtype).name
    if name not in formats:
        what = " or ".join(f.upper() for f in formats)
        raise TypeError(f"{argname}: the kernel takes {what}{' (the format of q)' if mixed else ''}, got {arr.dtype}; "
                        f"round it first (amla_sim.formats.round_to({argname}, {formats[0]!r}))")
    return arr


def make_problem(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine,
    schedule: str | Schedule = "reference",
    d_v: int = D_V,
    scale: float | None = None,
    block: int = 64,
    trace: bool = False,
    input_format: str = "bf16",
    out_format: str = "bf16",
) -> Problem:
    """Check the inputs and set up the flattened problem.

    q: (b, s_q, G, d_k) query heads after absorption; kv: (b, S, d_k) the latent cache, V = kv[..., :d_v].
    Inputs are rounded to `input_format` (BF16) by the machine's casts (the golden machine's keep them as given);
    the output is stored in `out_format`. The last block is padded when the schedule says so.
    """
    mc = get_machine(machine)
    sched = get_schedule(schedule)
    qa, kva = _check_float(q, "q"), _check_float(kv, "kv")
    if qa.ndim != 4:
        raise ValueError(f"q: expected shape (b, s_q, G, d_k), got {qa.shape}")
    if kva.ndim != 3:
        raise ValueError(f"kv: expected shape (b, S, d_k), got {kva.shape}")
    b, s_q, G, d_k = qa.shape
    if kva.shape[0] != b or kva.shape[2] != d_k:
        raise ValueError(f"q and kv: batch and d_k must agree, got q {qa.shape} and kv {kva.shape}")
    S = kva.shape[1]
    if b == 0 or G == 0 or d_k == 0:
        raise ValueError(f"q: batch, heads and d_k must be >= 1, got shape {qa.shape}")
    if S == 0:
        raise ValueError("kv: empty context (S = 0)")
    if not 1 <= s_q <= S:
        raise ValueError(f"q: s_q must be in 1..S (S = {S}), got {s_q}")
    check_int(d_v, "d_v", lo=1, hi=d_k)
    scale = check_scale(scale)
    check_block(block, sched)
    Q = mc.cast(qa, input_format).reshape(b, s_q * G, d_k)
    K = mc.cast(kva, input_format)
    t = np.repeat(np.arange(s_q), G)  # query position of each row
    valid = np.arange(S)[None, :] <= (S - s_q + t)[:, None]
    pad = -S % int(block) if sched.pad_blocks else 0
    if pad:  # a kernel's last block is full size: zero keys, masked out
        K = np.concatenate([K, np.zeros((b, pad, d_k), K.dtype)], axis=1)
        valid = np.concatenate([valid, np.zeros((valid.shape[0], pad), bool)], axis=1)
    return Problem(mc, sched, Q, K, K[..., :d_v], valid, float(scale), int(block), (b, s_q, G), {} if trace else None,
                   out_format)


def check_block(block: int, schedule: Schedule) -> int:
    """`block` as an int, or an error naming it: positive, and a multiple of the schedule's row-sum tile."""
    check_int(block, "block", lo=1)
    if block % schedule.reduce_span:
        span = schedule.reduce_span
        raise ValueError(f"block: schedule {schedule.name} sums P in a layout of {span} columns "
                         f"{schedule.reduce_layout}, so block must be a multiple of {span}; got {block}")
    return int(block)


def check_kernel_layout(schedule: str | Schedule, block: int, kernel_block: int = 64) -> None:
    """A deployed kernel lays its work out itself: as a sweep algorithm its `schedule` is checked, not used, and
    `block` must be the kernel's own."""
    get_schedule(schedule)
    if check_int(block, "block", lo=1) != kernel_block:
        raise ValueError(f"block: the kernel's block is {kernel_block} tokens, got {block}")


def online_softmax_step(
    mc: Machine, m: np.ndarray, S: np.ndarray, exp: Callable[[np.ndarray], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block of the online softmax: the new running max m_new = max(m, rowmax S), the rescale factor
    exp(m - m_new) of what was accumulated (0 on the first block) and P = exp(S - m_new), on the machine.
    exp: the machine's exp (default) or exp2 when S is in log2 units (SnapMLA)."""
    exp = mc.exp if exp is None else exp
    m_new = np.maximum(m, mc.rowmax(S))
    return m_new, exp(m - safe_max(m_new)), exp(S - safe_max(m_new)[..., None])


def safe_max(m: np.ndarray) -> np.ndarray:
    """m with -inf (a row that has seen no key yet) replaced by 0, so that exp(S - m) stays 0, not NaN."""
    return np.where(np.isneginf(m), 0, m).astype(m.dtype)


def causal_lists(b: int, s_q: int, S: int, width: int) -> np.ndarray:
    """(b s_q, width) int32 top-k lists of a sparse kernel run as a dense decode: query s of request i lists
    request i's rows ``0 .. S - s_q + s`` of the flat cache (``i S + t``), -1 after them."""
    t = np.arange(width)
    ends = S - s_q + np.arange(s_q)  # the last row each query sees
    idx = np.where(t[None, None, :] <= ends[None, :, None], np.arange(b)[:, None, None] * S + t, -1)
    return idx.reshape(b * s_q, width).astype(np.int32)


"""Which kernel computes a request's prefill: how vLLM 0.33 and SGLang 0.5.23 route a dense MLA model's prefill
(DeepSeek-V3/R1, Kimi-K2) on Hopper, step by step through their chunked-prefill schedulers.

The prefill of a prompt runs in one or more steps, each over a chunk of its tokens (the scheduler's token budget is
shared by the batch), and each chunk takes one of two forms of attention:

- **MHA** (the latent cache up-projected to per-head K and V): FA3's varlen forward, 192 / 128
  (:func:`~amla_sim.algorithms.deployed.fa3.prefill.fa3_prefill`), causal over the chunk's new tokens, and its
  earlier tokens (the context) as further non-causal calls merged in, or in SGLang's one-shot form as keys of the
  same call;
- **absorbed** (W_UK and W_UV folded into q and the output): FA3's MLA decode kernel with ``q_v`` over the latent
  cache (:func:`~amla_sim.algorithms.deployed.fa3.mla.fa3_mla`), the query step the chunk's tokens.

vLLM (``v1/attention/backends/mla/flashattn_mla.py:129``, ``reorder_batch_threshold = 512``; ``split_decodes_and_
prefills`` in ``v1/attention/backends/utils.py:837-907``) decides per request: a chunk of at most 512 new tokens is a
"decode" (absorbed), a longer one a prefill (MHA). Its scheduler (``v1/core/sched/scheduler.py``) gives the running
requests their tokens first, then the waiting ones in arrival order, each ``min(remaining, budget left)``: a batchmate
ahead can leave a request a short first chunk and so move it to the absorbed kernel.

SGLang (``srt/layers/attention/attention_backend_handler.py``, ``_handle_attention_backend``) decides per extend
batch: with ``--enable-deterministic-inference`` always absorbed; otherwise MHA when the batch's summed prefix lengths
are 0 or at least 8192 (``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD``), one call over prefix and new tokens while the
batch's total length is at most 128K (``MHA_ONE_SHOT``, ``get_max_chunk_capacity``), else prefix chunks merged by
``merge_state_v2`` (``MHA_CHUNKED_KV``); absorbed below the threshold. Its scheduler (``PrefillAdder``) fills an extend
batch of at most ``chunked_prefill_size`` new tokens in arrival order, the last request cut to what is left and
continued first in the next extend batch; decodes run in batches of their own.

Each step also names the kernel of its FP8 block linears (the q and kv projections and ``o_proj``,
:mod:`~amla_sim.algorithms.deployed.fp8_linear`): in vLLM's default mode FlashInfer's GEMM for a step whose CUDA
graph has fewer than 32 rows (a step of at most 512 tokens is padded to the graph's capture size), DeepGEMM
otherwise, so a batchmate can move a request's projections from one kernel to the other.

Modelled: the token budget and arrival order (no preemption, no ``max_num_seqs`` limit, no speculative decoding, no
encoder inputs), vLLM's default CUDA graph sizes; a prefix-cache hit as given by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .._validate import check_int
from ..algorithms.deployed.fp8_linear import FP8_LINEAR_KERNELS, fp8_linear_kernel, vllm_graph_tokens

__all__ = ["Prompt", "Chunk", "SERVING_ENGINES", "route", "route_vllm", "route_sglang", "parse_requests", "alone",
           "batchmates_change",
           "VLLM_DECODE_THRESHOLD", "SGLANG_PREFIX_THRESHOLD", "SGLANG_ONE_SHOT_CAPACITY"]

#: vLLM's FLASH_ATTN_MLA ``reorder_batch_threshold``: a chunk of at most this many new tokens runs the decode kernel
VLLM_DECODE_THRESHOLD = 512
#: SGLang's ``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD``: summed prefix lengths from which an extend batch runs MHA
SGLANG_PREFIX_THRESHOLD = 8192
#: SGLang's ``get_max_chunk_capacity``: the batch's total length up to which MHA is one call (prefix chunks above)
SGLANG_ONE_SHOT_CAPACITY = 128 * 1024
SERVING_ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Prompt:
    """A request's prompt: `cached` tokens already in the KV cache (a prefix-cache hit), `new` still to prefill."""

    new: int
    cached: int = 0


@dataclass(frozen=True)
class Chunk:
    """One step of one request's prefill: `tokens` new tokens after `context` earlier ones, the attention `path`
    ("mha" or "absorbed"), the kernel calls it makes and why that path."""

    step: int
    request: int
    context: int
    tokens: int
    path: str
    kernels: str
    why: str
    linear: str = ""  # the step's FP8 block linears (the q and kv projections, o_proj): the kernel its rows take
    linear_kernel: str = ""  # that kernel's key in FP8_LINEAR_KERNELS


def parse_requests(text: str) -> list[Prompt]:
    """``"1000,4000+600"``: a request per comma, ``N`` new tokens or ``C+N`` (C cached, N new)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        cached, _, new = part.rpartition("+")
        try:
            out.append(Prompt(new=int(new), cached=int(cached) if cached else 0))
        except ValueError:
            raise ValueError(f"requests: expected N or C+N per request (comma separated), got {part!r}") from None
    return _check(out)


#: the most requests a batch and the most scheduler steps a route walks (the engines' own limits are lower: vLLM's
#: max_num_seqs defaults to 256 to 1024)
MAX_REQUESTS = 4096
MAX_STEPS = 10_000


def _check(requests: list[Prompt]) -> list[Prompt]:
    if not requests:
        raise ValueError("requests: at least one request")
    if len(requests) > MAX_REQUESTS:
        raise ValueError(f"requests: {len(requests)} requests, more than a route walks ({MAX_REQUESTS})")
    for r in requests:
        check_int(r.new, "requests (new tokens)", lo=1)
        check_int(r.cached, "requests (cached tokens)", lo=0)
    return list(requests)


def _schedule(requests: list[Prompt], budget: int, *, mixed: bool) -> list[tuple[list[tuple[int, int, int]], int]]:
    """Each step's prefill chunks (request, context, tokens) and its decode tokens, until every prompt is
    prefilled. `mixed`: decodes share the step's budget (vLLM: running requests first, one token each once
    prefilled); SGLang runs them apart."""
    if -(-sum(r.new for r in requests) // budget) > MAX_STEPS:
        raise ValueError(f"requests, budget: {sum(r.new for r in requests)} new tokens at {budget} a step take more "
                         f"than {MAX_STEPS} steps; ask for a larger budget or fewer tokens")
    done = [0] * len(requests)
    order: list[int] = []  # vLLM's running queue: scheduling order
    steps = []
    while any(d < r.new for d, r in zip(done, requests)):
        left, chunks, decodes = budget, [], 0
        running = set(order)
        queue = order + [i for i in range(len(requests)) if i not in running] if mixed else list(range(len(requests)))
        if not mixed:  # SGLang: the request being chunked continues first, then the waiting ones
            queue = sorted(queue, key=lambda i: (not 0 < done[i] < requests[i].new, i))
        for i in queue:
            if left == 0:
                break
            remaining = requests[i].new - done[i]
            if remaining == 0:
                if mixed:  # a decode step of a prefilled request
                    left, decodes = left - 1, decodes + 1
                continue
            take = min(remaining, left)
            chunks.append((i, requests[i].cached + done[i], take))
            done[i] += take
            left -= take
            if mixed and i not in running:
                order.append(i)
        if not chunks:  # every token of the step went to the prefilled requests' decodes
            raise ValueError(f"budget: the decodes of {len(order)} prefilled requests take all {budget} tokens of a "
                             f"step, so a prefill never starts (the route does not model requests finishing)")
        if len(steps) == MAX_STEPS:
            raise ValueError(f"budget: the batch takes more than {MAX_STEPS} steps at {budget} tokens a step")
        steps.append((chunks, decodes))
    return steps


def _linear(engine: str, deterministic: bool, rows: int) -> dict[str, str]:
    """The kernel of a step's FP8 block linears over `rows` tokens (a :class:`Chunk`'s ``linear`` and
    ``linear_kernel``), said with the rows its launch has."""
    launch = vllm_graph_tokens(rows) if engine == "vllm" else rows
    pad = f" ({launch} in its CUDA graph)" if launch != rows else ""
    key = fp8_linear_kernel(engine, deterministic, launch)
    return {"linear": f"{FP8_LINEAR_KERNELS[key]}: a step of {rows} tokens{pad}", "linear_kernel": key}


def route_vllm(requests: list[Prompt], *, budget: int = 8192, deterministic: bool = False,
               fp8_prefill: bool = False) -> list[Chunk]:
    """vLLM 0.33's route of each prefill chunk (FLASH_ATTN_MLA on sm90). budget: ``max_num_batched_tokens``.
    deterministic: ``VLLM_BATCH_INVARIANT`` (the same routes, every FA3 call with ``num_splits`` 1). fp8_prefill:
    ``use_prefill_query_quantization`` with an FP8 cache (the MHA calls in E4M3)."""
    requests = _check(requests)
    check_int(budget, "budget", lo=1)
    splits = "num_splits 1" if deterministic else "splits: from the batch"
    mha_fmt = "E4M3" if fp8_prefill else "BF16"
    out = []
    for step, (chunks, decodes) in enumerate(_schedule(requests, budget, mixed=True)):
        linear = _linear("vllm", deterministic, sum(n for *_, n in chunks) + decodes)
        for i, ctx, n in chunks:
            if n <= VLLM_DECODE_THRESHOLD:
                out.append(Chunk(step, i, ctx, n, "absorbed",
                                 f"fa3-mla: s_q {n} causal over {ctx + n} latent keys ({splits})",
                                 f"{n} new tokens <= {VLLM_DECODE_THRESHOLD} (reorder_batch_threshold)", **linear))
                continue
            calls = f"fa3-prefill {mha_fmt}: {n} new tokens causal"
            if ctx:
                calls += f" + {ctx} of context (workspace chunks) + merge_attn_states"
            calls += f" ({splits})"
            out.append(Chunk(step, i, ctx, n, "mha", calls, f"{n} new tokens > {VLLM_DECODE_THRESHOLD}", **linear))
    return out


def route_sglang(requests: list[Prompt], *, budget: int = 8192, deterministic: bool = False,
                 fp8_cache: bool = False) -> list[Chunk]:
    """SGLang 0.5.23's route of each extend batch (``fa3`` backend on sm90). budget: ``--chunked-prefill-size``.
    deterministic: ``--enable-deterministic-inference`` (absorbed always). fp8_cache: ``--kv-cache-dtype fp8_e4m3``
    (MHA in E4M3; the absorbed kernel reads the cache dequantized to BF16)."""
    requests = _check(requests)
    check_int(budget, "budget", lo=1)
    fmt = "E4M3" if fp8_cache else "BF16"
    out = []
    for step, (chunks, _) in enumerate(_schedule(requests, budget, mixed=False)):
        linear = _linear("sglang", deterministic, sum(n for *_, n in chunks))
        prefix = sum(ctx for _, ctx, _ in chunks)
        total = sum(ctx + n for _, ctx, n in chunks)
        for i, ctx, n in chunks:
            if deterministic:
                path, why = "absorbed", "deterministic inference: always the absorbed kernel"
            elif prefix == 0 or prefix >= SGLANG_PREFIX_THRESHOLD:
                path = "mha"
                why = (f"the batch's prefixes sum to {prefix}"
                       + (" (none)" if prefix == 0 else f" >= {SGLANG_PREFIX_THRESHOLD}"))
            else:
                path = "absorbed"
                why = f"the batch's prefixes sum to {prefix}, in (0, {SGLANG_PREFIX_THRESHOLD})"
            if path == "absorbed":
                kernels = f"sgl-fa3-mla: s_q {n} causal over {ctx + n} latent keys (num_splits 1)"
            elif total <= SGLANG_ONE_SHOT_CAPACITY:
                kernels = f"fa3-prefill {fmt} (SGLang's build): one call, {n} queries causal over {ctx + n} keys"
                why += f"; the batch's {total} tokens <= {SGLANG_ONE_SHOT_CAPACITY}: one shot"
            else:
                kernels = (f"fa3-prefill {fmt} (SGLang's build): {n} new tokens causal + {ctx} of prefix "
                           "(chunks) + merge_state_v2")
                why += f"; the batch's {total} tokens > {SGLANG_ONE_SHOT_CAPACITY}: prefix chunks"
            out.append(Chunk(step, i, ctx, n, path, kernels, why, **linear))
    return out


def route(engine: str, requests: list[Prompt], **settings: object) -> list[Chunk]:
    """:func:`route_vllm` or :func:`route_sglang` by `engine`."""
    if engine not in SERVING_ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(SERVING_ENGINES)}, got {engine!r}")
    return (route_vllm if engine == "vllm" else route_sglang)(requests, **settings)


def alone(engine: str, requests: list[Prompt], i: int, **settings: object) -> list[Chunk]:
    """Prompt `i`'s route with no batchmate (its chunks renumbered as request `i`)."""
    return [replace(c, request=i) for c in route(engine, [requests[i]], **settings)]


def _kernel_runs(chunks: list[Chunk]) -> list[tuple[int, str]]:
    """The projections' kernel along a request's tokens: (first token, kernel) where it changes."""
    runs: list[tuple[int, str]] = []
    for c in sorted(chunks, key=lambda c: c.context):
        if not runs or runs[-1][1] != c.linear_kernel:
            runs.append((c.context, c.linear_kernel))
    return runs


def batchmates_change(engine: str, requests: list[Prompt], **settings: object) -> dict[int, str]:
    """Per request, how its batchmates change its prefill's route (empty where they do not): the chunks it is
    cut into, or the path a chunk takes."""
    together = route(engine, requests, **settings)
    out = {}
    for i in range(len(requests)):
        mine = [(c.context, c.tokens, c.path) for c in together if c.request == i]
        solo_chunks = alone(engine, requests, i, **settings)
        solo = [(c.context, c.tokens, c.path) for c in solo_chunks]
        said = []
        if mine != solo:
            what = "its chunks" if [m[:2] for m in mine] != [s[:2] for s in solo] else "a chunk's path"
            paths = {p for *_, p in mine} ^ {p for *_, p in solo}
            said.append(what + (" and the kernel" if paths or what == "a chunk's path" else ""))
        if _kernel_runs([c for c in together if c.request == i]) != _kernel_runs(solo_chunks):
            said.append("the projections' kernel")
        if said:
            out[i] = " and ".join(said)
    return out

"""The attention algorithms, each written once against a machine: the papers' (golden, naive, Base, AMLA, seesaw,
ETAP, SnapMLA) in this package, the kernels people deploy in :mod:`.deployed` (one package per upstream project),
their entry points re-exported here.

Every algorithm takes ``q: (b, s_q, G, d_k)`` and ``kv: (b, S, d_k)`` (V = the first d_v columns of kv) and
returns an :class:`AttentionResult`. :func:`make_problem` (the checked inputs on a machine and schedule, with its
block loop, scores, row sums and matrix products) and :func:`online_softmax_step` are what they are written with,
and what an algorithm of one's own uses (:mod:`amla_sim.plugins`).
"""

from ._common import (DEEPSEEK_V3_SCALE, DEFAULT_SCALE, AttentionResult, Problem, make_problem, online_softmax_step,
                      safe_max)
from .amla import amla
from .base import base
from .etap import etap
from .deployed.fa3.mla import fa3_mla, fa3_mla_decode
from .deployed.fa3.sparse import fa3_mla_sparse, fa3_mla_sparse_decode
from .deployed.flashinfer import flashinfer_mla, flashinfer_mla_decode
from .deployed.flashmla.sparse_prefill import flashmla_sparse_prefill, flashmla_sparse_prefill_decode
from .deployed.flashmla.dense import flashmla, flashmla_decode
from .deployed.flashmla.dense_fp8 import flashmla_dense_fp8, flashmla_dense_fp8_decode
from .deployed.flashmla.etap import flashmla_etap, flashmla_etap_decode
from .deployed.flashmla.fp8_cache import dequantize_kv_cache, quantize_kv_cache
from .deployed.flashmla.sparse_fp8 import flashmla_sparse_fp8, flashmla_sparse_fp8_decode
from .deployed.sglang.decode import splitkv_decode
from .deployed.vllm.fp8 import quantize_cache_fp8, quantize_query_fp8
from .deployed.vllm.triton_mla import vllm_triton_mla, vllm_triton_mla_decode
from .golden import golden
from .naive import naive
from .seesaw import seesaw
from .snapmla import snapmla

#: The built-in algorithms by name, as ``run``, ``sweep`` and ``reproduce`` name them (plugins: :mod:`amla_sim.plugins`).
ALGORITHMS = {"base": base, "amla": amla, "naive": naive, "seesaw": seesaw, "etap": etap, "snapmla": snapmla,
              "flashmla-etap": flashmla_etap_decode, "flashmla": flashmla_decode,
              "flashmla-sparse-fp8": flashmla_sparse_fp8_decode, "fa3-mla": fa3_mla_decode,
              "flashmla-dense-fp8": flashmla_dense_fp8_decode, "vllm-triton-mla": vllm_triton_mla_decode,
              "fa3-mla-sparse": fa3_mla_sparse_decode, "flashmla-sparse-prefill": flashmla_sparse_prefill_decode,
              "flashinfer-mla": flashinfer_mla_decode}

__all__ = ["AttentionResult", "ALGORITHMS", "flashmla", "flashmla_etap", "flashmla_sparse_fp8", "fa3_mla",
           "fa3_mla_sparse", "flashmla_sparse_prefill", "flashinfer_mla",
           "flashmla_dense_fp8", "vllm_triton_mla", "quantize_query_fp8", "quantize_cache_fp8", "quantize_kv_cache",
           "dequantize_kv_cache", "splitkv_decode", "DEFAULT_SCALE", "DEEPSEEK_V3_SCALE", "golden", "base", "amla",
           "naive", "seesaw", "etap", "snapmla",
           # what an algorithm of one's own is written with (amla_sim.plugins; the tutorial's split_fp16)
           "Problem", "make_problem", "online_softmax_step", "safe_max"]

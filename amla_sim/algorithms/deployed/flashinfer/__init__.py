"""FlashInfer's MLA decode for Hopper (flashinfer-python 0.7.2, ``BatchMLAPagedAttentionWrapper``, backend
``fa3``): the kernel and its merge (:mod:`.mla`), the plan (:mod:`.scheduler`), and vLLM's sparse SM90 call of
it without RoPE (:mod:`.sparse`)."""

from .mla import FLASHINFER_VERSION, flashinfer_mla, flashinfer_mla_decode
from .scheduler import FlashInferPlan, flashinfer_mla_plan
from .sparse import flashinfer_mla_sparse

__all__ = ["flashinfer_mla", "flashinfer_mla_decode", "flashinfer_mla_plan", "flashinfer_mla_sparse", "FlashInferPlan",
           "FLASHINFER_VERSION"]

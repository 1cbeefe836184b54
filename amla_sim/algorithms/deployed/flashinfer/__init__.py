"""FlashInfer's MLA decode for Hopper (flashinfer-python 0.7.2, ``BatchMLAPagedAttentionWrapper``, backend
``fa3``): the kernel and its merge (:mod:`.mla`), the plan (:mod:`.scheduler`)."""

from .mla import FLASHINFER_VERSION, flashinfer_mla, flashinfer_mla_decode
from .scheduler import FlashInferPlan, flashinfer_mla_plan

__all__ = ["flashinfer_mla", "flashinfer_mla_decode", "flashinfer_mla_plan", "FlashInferPlan", "FLASHINFER_VERSION"]

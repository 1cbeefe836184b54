"""FlashAttention-3's MLA decode (vllm-project/flash-attention, ``hopper/``): the kernel (:mod:`.mla`), its
split choice (:mod:`.scheduler`), the sparse call of DeepSeek V3.2 (:mod:`.sparse`), SGLang's own build
(:mod:`.sgl`) and the standard forward the MLA prefill calls (:mod:`.prefill`)."""

from .mla import FA3_COMMIT, fa3_mla, fa3_mla_decode
from .prefill import fa3_prefill
from .scheduler import fa3_schedule
from .sgl import SGL_FA3_COMMIT, sgl_fa3_mla
from .sparse import fa3_mla_sparse

__all__ = ["fa3_mla", "fa3_prefill", "fa3_mla_decode", "fa3_mla_sparse", "fa3_schedule", "FA3_COMMIT", "sgl_fa3_mla",
           "SGL_FA3_COMMIT"]

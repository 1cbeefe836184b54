"""FlashAttention-3's MLA decode (vllm-project/flash-attention, ``hopper/``): the kernel (:mod:`.mla`) and its
split choice (:mod:`.scheduler`)."""

from .mla import FA3_COMMIT, fa3_mla, fa3_mla_decode
from .scheduler import fa3_schedule

__all__ = ["fa3_mla", "fa3_mla_decode", "fa3_schedule", "FA3_COMMIT"]

"""deepseek-ai/FlashMLA's sm90 decodes, its sm90 sparse prefill, and the kernels derived from it.

- :mod:`~amla_sim.algorithms.deployed.flashmla.scheduler`: the split scheduler, both generations
  (``get_decoding_sched_meta``, ``get_mla_metadata``);
- :mod:`.combine`: the combine kernel's sum over the splits' LSEs;
- :mod:`.dense`: the dense BF16 decode (FlashMLA 9241ae3);
- :mod:`.fp8_cache` and :mod:`.sparse_fp8`: the FP8 KV cache (DeepSeek V3.2's and MODEL1's) and the sparse FP8
  decode (FlashMLA 9241ae3);
- :mod:`.sparse_prefill`: the sparse prefill ``flash_mla_sparse_fwd`` (FlashMLA 9241ae3; DeepSeek V3.2 over a
  BF16 cache: vLLM's ``FLASHMLA_SPARSE`` and SGLang's DSA prefill);
- :mod:`.etap`: FlashMLA-ETAP, the ETAP paper's kernel (pengcuo/FlashMLA-ETAP 39e6160, a fork of FlashMLA);
- :mod:`.dense_fp8`: vLLM's dense FP8 decode (vllm-project/FlashMLA 46d64a8, the first generation with E4M3
  operands).
"""

__all__ = ["FLASHMLA_COMMIT"]

#: The deepseek-ai/FlashMLA commit whose kernels the models follow.
FLASHMLA_COMMIT = "9241ae3"

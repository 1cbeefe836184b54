"""vLLM's own MLA decode pieces: the FP8 quantization of the query and the KV cache
(:mod:`amla_sim.algorithms.deployed.vllm.fp8`) and the Triton MLA decode, the TRITON_MLA backend
(:mod:`amla_sim.algorithms.deployed.vllm.triton_mla`). vLLM's dense FP8 FlashMLA decode is FlashMLA's own kernel
and lives with FlashMLA's (:mod:`amla_sim.algorithms.deployed.flashmla.dense_fp8`)."""

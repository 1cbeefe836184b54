"""vLLM's own MLA decode pieces: the FP8 quantization of the query and the KV cache (:mod:`.fp8`) and the Triton MLA
decode (:mod:`.triton_mla`, the TRITON_MLA backend). vLLM's dense FP8 FlashMLA decode is FlashMLA's own kernel and
lives with FlashMLA's (:mod:`amla_sim.algorithms.deployed.flashmla.dense_fp8`)."""

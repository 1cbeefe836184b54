"""Models of the MLA decode kernels people deploy, one package per upstream project.

- :mod:`~amla_sim.algorithms.deployed.flashmla`: deepseek-ai/FlashMLA's sm90 decodes and the kernels derived
  from it (the split scheduler in both generations, the combine, the FP8 cache, the dense, sparse FP8 and ETAP
  decodes, vLLM's dense FP8 decode);
- :mod:`~amla_sim.algorithms.deployed.splitkv`: the split/merge Triton decode's two stages, the family that
  SGLang's (:mod:`~amla_sim.algorithms.deployed.sglang`) and vLLM's (:mod:`~amla_sim.algorithms.deployed.vllm`, with
  vLLM's FP8 quantization) models share;
- :mod:`~amla_sim.algorithms.deployed.fa3`: FlashAttention-3's MLA decode (vLLM's fork and SGLang's build), its
  split choice, the sparse call of DeepSeek V3.2;
- :mod:`~amla_sim.algorithms.deployed.flashinfer`: FlashInfer's Hopper MLA (SGLang's ``flashinfer`` backend), its
  plan and merge;
- :mod:`~amla_sim.algorithms.deployed.fast_math`: what the FlashAttention-derived CUDA decodes compute alike under
  ``--use_fast_math`` (the scale in log2 units, ``__logf``).

Each model runs on a machine like the papers' algorithms and follows its kernel's main loop, with the upstream
file it reads named at the top of its module. The entry points are re-exported by :mod:`amla_sim.algorithms`.
"""

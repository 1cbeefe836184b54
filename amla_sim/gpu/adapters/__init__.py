"""Adapters that run the MLA decode kernels people deploy, compiled from their upstream checkouts or imported from
their packages (never vendored),
one module per upstream project:

- :mod:`~amla_sim.gpu.adapters.flashmla`: FlashMLA's dense and sparse FP8 decodes, FlashMLA-ETAP;
- :mod:`~amla_sim.gpu.adapters.sglang`: SGLang's Triton decode;
- :mod:`~amla_sim.gpu.adapters.fa3`: FlashAttention-3's MLA decode;
- :mod:`~amla_sim.gpu.adapters.flashinfer`: FlashInfer's MLA (SGLang's ``flashinfer`` backend, vLLM's sparse SM90
  backend), its sm90 module compiled from a checkout by :mod:`~amla_sim.gpu.adapters.flashinfer_build`;
- :mod:`~amla_sim.gpu.adapters.vllm`: vLLM's FP8 decodes (the dense FP8 FlashMLA decode, compiled from a FlashMLA
  checkout, and the Triton decode), and vLLM's quantization on the GPU.

Inputs and outputs are NumPy arrays of raw bits, so that the crosscheck layer never needs torch.
"""

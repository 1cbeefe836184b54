"""Adapters that run the MLA decode kernels people deploy, from their own packages or builds (never vendored),
one module per upstream project:

- :mod:`~amla_sim.gpu.adapters.flashmla`: FlashMLA's dense and sparse FP8 decodes, FlashMLA-ETAP;
- :mod:`~amla_sim.gpu.adapters.sglang`: SGLang's Triton decode.

Inputs and outputs are NumPy arrays of raw bits, so that the crosscheck layer never needs torch.
"""

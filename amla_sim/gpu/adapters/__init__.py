"""Adapters that run the MLA decode kernels people deploy, from their own packages or builds (never vendored),
one module per upstream project: :mod:`.flashmla` (FlashMLA's dense and sparse FP8 decodes, FlashMLA-ETAP) and
:mod:`.sglang` (SGLang's Triton decode).

Inputs and outputs are NumPy arrays of raw bits, so that the crosscheck layer never needs torch.
"""

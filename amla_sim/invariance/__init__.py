"""Does a request's output change with its batchmates, and why; where two kernels part ways.

- :func:`invariance`: a request alone and in other launches (batchmates, SMs, query rows, split counts)
  through a kernel's model; per launch the changed bits and the split plan that caused them (:mod:`.study`);
- :func:`kernel_diff`: two kernels on the same inputs, and the first modelled step where they differ
  (:mod:`.diff`);
- :mod:`.launches` says what a launch is; :mod:`.kernel` what a modelled kernel is, and each family's module which
  kernels it adds (:mod:`.flashmla`, :mod:`.fa3`, :mod:`.v32`, :mod:`.sglang`, :mod:`.vllm`, :mod:`.flashinfer`;
  :mod:`.splitkv` holds what the Triton decodes share), found by :mod:`.registry`; :mod:`.preflight` checks a run's bounds and memory before
  it starts; :mod:`.checks` replays the device check, :mod:`.races` says which rows FlashMLA-ETAP's races reach.
"""

from .diff import DiffReport, kernel_diff
from .kernel import BatchKernel, Request, describe_plan
from .launches import Launch, variations
from .registry import BATCH_KERNELS, get_batch_kernel
from .study import InvarianceReport, LaunchResult, WhatIf, invariance, project

__all__ = ["invariance", "InvarianceReport", "LaunchResult", "WhatIf", "Launch", "variations", "BATCH_KERNELS",
           "BatchKernel", "Request", "get_batch_kernel", "describe_plan", "project", "kernel_diff", "DiffReport"]

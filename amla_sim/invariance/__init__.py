"""Does a request's output change with its batchmates, and why; where two kernels part ways.

- :func:`invariance`: a request alone and in other launches (batchmates, SMs, query rows, split counts)
  through a kernel's model; per launch the changed bits and the split plan that caused them (:mod:`.study`);
- :func:`kernel_diff`: two kernels on the same inputs, and the first modelled step where they differ
  (:mod:`.diff`);
- :mod:`.launches` says what a launch is, :mod:`.kernels` which kernels' schedulers are modelled.
"""

from .diff import DiffReport, kernel_diff
from .kernels import BATCH_KERNELS, BatchKernel, describe_plan, get_batch_kernel
from .launches import Launch, variations
from .study import InvarianceReport, LaunchResult, WhatIf, invariance, project

__all__ = ["invariance", "InvarianceReport", "LaunchResult", "WhatIf", "Launch", "variations", "BATCH_KERNELS",
           "BatchKernel", "get_batch_kernel", "describe_plan", "project", "kernel_diff", "DiffReport"]

#!/bin/bash
# A carryable FlashInfer 0.7.2.post1 (the version vLLM 0.33.0 pins) for its sm90 FP8 block-scale GEMM,
# `flashinfer.gemm.fp8_blockscale_gemm_sm90`, which vLLM runs for every FP8 block linear of fewer than 32 tokens
# (kv_b_proj, o_proj, ...): the wheel's Python package and the sources its JIT module `fp8_blockscale_gemm_90` reads
# (data/csrc's top-level files, data/csrc/nv_internal with TensorRT-LLM's kernels and the DeepGEMM headers it compiles
# with NVRTC at run time, deepgemm_jit_setup.cu), and the headers it includes (cutlass, cccl, spdlog, data/include).
# Run here (it uses the package index):  bash scripts/make_fi_gemm_bundle.sh DEST
# DEST/fi072post1_gemm.tar.xz goes to the GPU machine as a carried path, with an apache-tvm-ffi wheel.
set -eu
DEST=${1:?usage: make_fi_gemm_bundle.sh DEST}; mkdir -p "$DEST"; W=$(mktemp -d)
python3 -m pip download -q --no-deps flashinfer-python==0.7.2.post1 -d "$W"
mkdir "$W/u" && (cd "$W/u" && python3 -m zipfile -e ../flashinfer_python-0.7.2.post1-py3-none-any.whl .)
D="$W/u/flashinfer/data"
(cd "$D/csrc" && find . -mindepth 1 -maxdepth 1 -type d ! -name nv_internal ! -name fused_moe -exec rm -rf {} +)
(cd "$D/csrc/fused_moe" && find . -type f ! -name deepgemm_jit_setup.cu -delete)
(cd "$D/cutlass" && rm -rf examples python test media docs)
(cd "$W/u" && rm -rf flashinfer/experimental/*/csrc flashinfer/data/aot && find flashinfer -name __pycache__ -prune -exec rm -rf {} +)
tar -C "$W/u" -cf - flashinfer flashinfer_python-0.7.2.post1.dist-info | xz -T2 -6 > "$DEST/fi072post1_gemm.tar.xz"
rm -rf "$W"; ls -la "$DEST"

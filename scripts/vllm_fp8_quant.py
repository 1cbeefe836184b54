"""vLLM's FP8 quantization of the query and the cache on a GPU, for every BF16 value, under a few scales: the bytes
that tests/test_vllm_fp8.py holds amla_sim.algorithms.deployed.vllm.fp8 to.

    python scripts/vllm_fp8_quant.py OUT.npz     # on a CUDA machine with torch

The query as QuantFP8.forward_native computes it (x.float() * scale.reciprocal(), clamped to +-448, cast), the
cache as concat_and_cache_mla's scaled_vec_conversion (x.float() / scale, cast with saturation: the clamp, then
torch's round-to-nearest-even cast). The inputs are all 65,536 BF16 bit patterns, so nothing is stored but the
results.
"""

import sys

import numpy as np

from amla_sim._files import atomic_savez

SCALES = (1.0, 0.5, 2.0, 0.02, 0.0125, 1 / 448, 0.023, 3.7)


def main(out: str) -> None:
    import torch

    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda().float()
    res = {}
    for i, s in enumerate(SCALES):
        st = torch.tensor([s], dtype=torch.float32, device="cuda")
        q = (x * st.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        c = (x / st).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        res[f"q{i}"] = q.view(torch.uint8).cpu().numpy()
        res[f"c{i}"] = c.view(torch.uint8).cpu().numpy()
    atomic_savez(out, scales=np.array(SCALES, np.float64), device=np.array(torch.cuda.get_device_name()), **res)
    print(f"wrote {out}: {len(SCALES)} scales x 65536 BF16 values")


if __name__ == "__main__":
    main(sys.argv[1])

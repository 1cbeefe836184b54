"""Run kernel.py on this machine's GPU over CASES and write capture.npz: per case the device's stages (each
split's m, l and O as FP32, the output as BF16 bits) and the recipe that rebuilds the inputs on any CPU.

    python examples/split_fp16/capture.py [--out examples/split_fp16/capture.npz]

The steps, for a kernel of your own (README.md in this folder says why each matters):
1. inputs from a recipe (a distribution, a shape, a seed), never stored: the replay draws them again;
2. the kernel called as it is deployed (its launch settings are part of what decides the bits);
3. every stage the model traces, as the kernel leaves it in memory (here each split's m, l and O);
4. two more runs that must give the same bits (a kernel that is not deterministic cannot be replayed);
5. raw bits for 16-bit formats (uint16), FP32 as it is, one array per case and stage: ``c{case}_{stage}``;
6. a JSON ``meta`` with the recipe of every case, the CRC of its inputs, the device and the versions.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from amla_sim.crosscheck.files import input_crc
from amla_sim.experiments.inputs import make_inputs
from kernel import split_fp16_decode

# (batch, s_q, heads, context, dist, seed): one block (the second split empty), odd contexts, MTP, outliers
CASES = [(1, 1, 128, 4096, "normal:1", 1), (2, 1, 64, 1000, "flashmla", 2), (1, 2, 64, 3001, "normal:1", 3),
         (3, 1, 16, 64, "uniform:3", 4), (1, 1, 64, 8192, "rope-outliers", 5)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).with_name("capture.npz")))
    args = ap.parse_args()
    cases, arrays = [], {}
    for i, (b, sq, G, L, dist, seed) in enumerate(CASES):
        q, kv = make_inputs(dist, batch=b, sq=sq, heads=G, context=L, seed=seed)  # 1. BF16 arrays from a recipe
        qt, kvt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda() for x in (q, kv))
        dev = split_fp16_decode(qt, kvt)  # 2. and 3.: out, and each split's m, l and O
        runs = [split_fp16_decode(qt, kvt)["out"] for _ in range(2)]  # 4.
        assert all(torch.equal(r.view(torch.int16), dev["out"].view(torch.int16)) for r in runs), "not deterministic"
        for k, v in dev.items():  # 5.
            arrays[f"c{i}_{k}"] = (v.view(torch.int16).cpu().numpy().view(np.uint16) if k == "out"
                                   else v.cpu().numpy())
        cases.append({"batch": b, "sq": sq, "heads": G, "context": L, "dist": dist, "seed": seed,  # 6.
                      "crc": input_crc(q.view(np.uint16), kv.view(np.uint16))})
    meta = {"kernel": "examples/split_fp16/kernel.py", "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__, "cases": cases}
    np.savez_compressed(args.out, meta=np.array(json.dumps(meta)), **arrays)
    print(f"{args.out}: {len(cases)} cases on {meta['device']}")


if __name__ == "__main__":
    main()

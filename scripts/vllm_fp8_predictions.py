"""vLLM's FP8 MLA decodes (flashmla-dense-fp8, vllm-triton-mla): the models' predictions for a device run, written
before it, and the run's record.

    python scripts/vllm_fp8_predictions.py predict OUT.json --kernel flashmla-dense-fp8 --seeds 1000,2000
    python scripts/vllm_fp8_predictions.py record OUT.json --predicted P.json --captures CAPTURE.npz [...]

``predict`` runs no GPU: per seed and case of the kernel's case table (seeds shifted by the seed), the CRC-32 of
the bits the model predicts for out and lse in the capture's layouts (and the dense decode's split counts).
``record``: captures written by ``amla-sim crosscheck --kernel K --seed N --save CAPTURE`` against those
predictions (per case, the device's CRCs and whether they equal the predicted ones), for runs whose bits are not
committed.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import numpy as np

from amla_sim._files import atomic_write
from amla_sim.crosscheck.deployed import KERNELS
from amla_sim.crosscheck.files import input_crc
from amla_sim.crosscheck.vllm import FLASHMLA_DENSE_FP8, VLLM_TRITON_MLA, fp8_inputs


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


def predict(kernel: str, seed: int) -> list[dict]:
    spec = KERNELS[kernel]
    assert spec in (FLASHMLA_DENSE_FP8, VLLM_TRITON_MLA)
    rows = []
    for i, r in enumerate(spec.recipes(seed)):
        shapes = spec.outputs(r)
        arrays = {f"c{i}_{k}": np.zeros(s, d) for k, (s, d, _) in shapes.items()}  # shapes only: stages() reads
        stages = {name: sim for name, _, sim in spec.stages(r, i, arrays)}      # the model's side
        q, kv = fp8_inputs(r)
        row = {"case": i, "seed": r["seed"], "input_crc": input_crc(q, kv), "out_crc": crc(stages["out"]),
               "lse_crc": crc(stages["lse"])}
        if "splits" in stages:
            row["splits"] = stages["splits"].tolist()
        rows.append(row)
        print(kernel, rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["predict", "record"])
    p.add_argument("out")
    p.add_argument("--kernel", choices=["flashmla-dense-fp8", "vllm-triton-mla"])
    p.add_argument("--seeds", default="1000")
    p.add_argument("--predicted")
    p.add_argument("--captures", nargs="+", default=[])
    a = p.parse_args()
    if a.what == "predict":
        data = {"kernel": a.kernel, **{str(s): predict(a.kernel, s) for s in map(int, a.seeds.split(","))}}
    else:
        predicted = json.loads(Path(a.predicted).read_text())
        spec = KERNELS[predicted["kernel"]]
        data = {"kernel": predicted["kernel"]}
        for path in a.captures:
            with np.load(path) as z:
                meta = json.loads(str(z["meta"]))
                seed = meta["cases"][0]["seed"] - spec.recipes(0)[0]["seed"]
                rows = []
                for i, (case, want) in enumerate(zip(meta["cases"], predicted[str(seed)], strict=True)):
                    got = {"out_crc": crc(z[f"c{i}_out"]), "lse_crc": crc(z[f"c{i}_lse"]),
                           "splits": z[f"c{i}_splits"].tolist() if f"c{i}_splits" in z else None}
                    assert case["input_crc"] == want["input_crc"], (path, i)
                    rows.append({"case": i, **got, "repeat_identical": case["repeat_identical"],
                                 "quant_identical": case.get("quant_identical"),
                                 "as_predicted": got["out_crc"] == want["out_crc"] and got["lse_crc"] == want["lse_crc"]
                                 and got["splits"] in (None, want.get("splits"))})
                data[f"{seed} {meta['device']}"] = {"seed": seed, "device": meta["device"], "cases": rows}
                print(path, meta["device"], sum(r["as_predicted"] for r in rows), "of", len(rows), "as predicted")
    atomic_write(Path(a.out), json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()

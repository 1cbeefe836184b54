"""FlashAttention-3's MLA decode: the model's predictions for a device run, written before it, and the run's record.

    python scripts/fa3_predictions.py predict OUT.json --seeds 0,1000,2000
    python scripts/fa3_predictions.py record OUT.json --predicted P.json --captures CAPTURE.npz [CAPTURE.npz ...]

``predict`` runs no GPU: per seed and case of ``amla_sim.crosscheck.fa3.FA3_CASES`` (seeds shifted by the seed),
the CRC-32 of the bits fa3_mla predicts for out and lse (the kernel's layouts) and the split counts it predicts.
``record``: captures written by ``amla-sim crosscheck --kernel fa3-mla --seed N --save CAPTURE`` against those
predictions (per case, the device's CRCs, whether they equal the predicted ones, and the device), for runs whose
bits are not committed.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import numpy as np

from amla_sim.algorithms.deployed.fa3 import fa3_mla
from amla_sim.crosscheck.fa3 import FA3_MLA, fa3_inputs
from amla_sim.crosscheck.files import input_crc


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


def predict(seed: int) -> list[dict]:
    rows = []
    for i, r in enumerate(FA3_MLA.recipes(seed)):
        q, kv = fa3_inputs(r)
        res = fa3_mla(q, kv, seqlens=np.array(r["seqlens"]), scale=r["scale"], causal=r["causal"],
                      page_size=r["page_size"], num_splits=r["num_splits"], varlen_q=r["varlen_q"], trace=True)
        b, sq, H = r["batch"], r["sq"], r["heads"]
        rows.append({"case": i, "seed": r["seed"], "input_crc": input_crc(q, kv),
                     "out_crc": crc(res.out.reshape(b * sq, H, 512).view(np.uint16)),
                     "lse_crc": crc(res.lse.astype(np.float32).view(np.uint32)),
                     "splits": list(res.trace["schedule"][0].splits)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["predict", "record"])
    p.add_argument("out")
    p.add_argument("--seeds", default="0")
    p.add_argument("--predicted")
    p.add_argument("--captures", nargs="+", default=[])
    a = p.parse_args()
    if a.what == "predict":
        data = {str(s): predict(s) for s in map(int, a.seeds.split(","))}
    else:
        predicted = json.loads(Path(a.predicted).read_text())
        data = {}
        for path in a.captures:
            with np.load(path) as z:
                meta = json.loads(str(z["meta"]))
                seed = meta["cases"][0]["seed"] - FA3_MLA.recipes(0)[0]["seed"]
                rows = []
                for i, (case, want) in enumerate(zip(meta["cases"], predicted[str(seed)])):  # a capture may
                    # predate the last cases of the table
                    got = {"out_crc": crc(z[f"c{i}_out"]), "lse_crc": crc(z[f"c{i}_lse"]),
                           "splits": z[f"c{i}_splits"].tolist() if f"c{i}_splits" in z else None}
                    assert case["input_crc"] == want["input_crc"], (path, i)
                    rows.append({"case": i, **got, "repeat_identical": case["repeat_identical"],
                                 "as_predicted": got["out_crc"] == want["out_crc"] and got["lse_crc"] == want["lse_crc"]
                                 and got["splits"] in (None, want["splits"])})
                data[f"{seed} {meta['device']}"] = {"seed": seed, "device": meta["device"], "cases": rows}
                print(path, meta["device"], sum(r["as_predicted"] for r in rows), "of", len(rows), "as predicted")
    Path(a.out).write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()

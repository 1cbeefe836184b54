"""Build the committed fixtures of issue 12 from the folders scripts/capture_thirdparty.py writes on a GPU.

    python scripts/make_thirdparty_fixtures.py H200_DIR [--h100 H100_DIR]

From H200_DIR (lg2_table.npz, lg2_inputs.npz, nan_dot.npz, sglang.npz, flashmla.npz):
- amla_sim/arith/lg2_sm90.npz: MUFU.LG2 on every significand of [1, 2) and of [0.5, 1), first FP32 bits + steps;
- tests/data/log_units.npz: an eighth of the random inputs, every edge input, a quarter of the binade inputs (their
  lg2.approx, .ftz, tl.log and tl.log2 results) and tl.log on every 64th FP32 of [1, 2);
- tests/data/nan_dot.npz, tests/data/flashmla_decode.npz: as captured;
- tests/data/sglang_decode.npz: as captured, less the partial outputs of cases 0 and 1 (2 MB each; case 2 keeps them).
With --h100, tests/data/thirdparty_h100_record.json: a SHA-256 prefix of every array the H100 wrote, which
tests/test_thirdparty.py compares with the committed H200 arrays.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent
N_RANDOM = 1 << 18  # capture_thirdparty.py's two random sets, then the edge inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("h200")
    ap.add_argument("--h100")
    args = ap.parse_args()
    src, data = Path(args.h200), ROOT / "tests" / "data"
    with np.load(src / "lg2_table.npz") as t:
        np.savez_compressed(ROOT / "amla_sim" / "arith" / "lg2_sm90.npz",
                            one_first=t["table_first"].astype(np.uint32), one_step=t["table_delta"].astype(np.int32),
                            half_first=t["half_first"].astype(np.uint32), half_step=t["half_delta"].astype(np.int32))
        log_one = t["log_every16"][::4]
        meta = t["meta"]
    with np.load(src / "lg2_inputs.npz") as z:
        x = z["x"]
        idx = np.concatenate([np.arange(0, N_RANDOM, 8), np.arange(N_RANDOM, 2 * N_RANDOM, 8),
                              np.arange(2 * N_RANDOM, x.size)])
        b = np.arange(0, z["xb"].size, 4)
        np.savez_compressed(data / "log_units.npz", x=x[idx], lg2=z["x_raw"][idx], lg2_ftz=z["x_ftz"][idx],
                            log=z["x_log"][idx], log2=z["x_log2"][idx], xb=z["xb"][b], xb_lg2=z["xb_raw"][b],
                            xb_log=z["xb_log"][b], log_one_every64=log_one, meta=meta)
    with np.load(src / "nan_dot.npz") as z:
        np.savez_compressed(data / "nan_dot.npz", **{k: z[k] for k in z.files})
    with np.load(src / "sglang.npz") as z:
        np.savez_compressed(data / "sglang_decode.npz",
                            **{k: z[k] for k in z.files if not k.endswith("_mid") or k == "c2_mid"})
    with np.load(src / "flashmla.npz") as z:
        np.savez_compressed(data / "flashmla_decode.npz", **{k: z[k] for k in z.files})
    if args.h100:
        record = {}
        for name in ("sglang.npz", "flashmla.npz", "nan_dot.npz", "lg2_inputs.npz", "lg2_table.npz"):
            with np.load(Path(args.h100) / name) as z:
                record[name] = {k: hashlib.sha256(np.ascontiguousarray(z[k]).tobytes()).hexdigest()[:16]
                                for k in z.files if k != "meta"}
        note = ("sha256 (16 hex digits) of every array the H100 wrote; the committed files were written by an H200 "
                "and hash identically (tests/test_thirdparty.py)")
        (data / "thirdparty_h100_record.json").write_text(json.dumps(
            {"device": "NVIDIA H100 80GB HBM3", "script": "scripts/capture_thirdparty.py", "note": note,
             "files": record}, indent=1))


if __name__ == "__main__":
    main()

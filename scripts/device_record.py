"""Record that a second GPU reproduced the committed captures: device, sha256 of its files, fidelity rows.

    python scripts/device_record.py CAPTURE_DIR FIDELITY_DIR OUT.json

CAPTURE_DIR holds what ``scripts/capture_device.py DIR --only dots`` wrote there (device.json, triton_dot.npz);
FIDELITY_DIR what ``scripts/gpu_crosscheck.py DIR --steps fidelity`` wrote (fidelity.npz, fidelity_ci.npz).
tests/test_devices.py compares the hashes with the committed files of tests/data. Made tests/data/h100_record.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np


def main(capture_dir: str, fidelity_dir: str, out: str) -> None:
    def sha256(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    with open(os.path.join(capture_dir, "device.json")) as f:
        device = json.load(f)
    rows = json.loads(str(np.load(os.path.join(fidelity_dir, "fidelity.npz"))["rows"]))
    record = {
        "device": device,
        "made_by": "scripts/capture_device.py OUT --only dots; scripts/gpu_crosscheck.py OUT --steps fidelity; "
                   "scripts/device_record.py",
        "sha256": {"triton_dot.npz": sha256(os.path.join(capture_dir, "triton_dot.npz")),
                   "fidelity_ci.npz": sha256(os.path.join(fidelity_dir, "fidelity_ci.npz"))},
        "fidelity_rows": rows,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])

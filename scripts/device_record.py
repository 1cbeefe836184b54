"""Record that a second GPU reproduced the committed captures: device, sha256 of its files, fidelity rows.

    python scripts/device_record.py CAPTURE_DIR FIDELITY_DIR OUT.json

CAPTURE_DIR holds what ``scripts/capture_device.py DIR --only dots``, ``scripts/capture_ex2_edges.py DIR`` and
``scripts/capture_div_edges.py DIR`` wrote there (device.json, triton_dot.npz, ex2_edges.npz, div_edges.npz);
FIDELITY_DIR what ``scripts/gpu_crosscheck.py DIR --steps fidelity`` wrote (fidelity_ci.npz holds every row).
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
    rows = json.loads(str(np.load(os.path.join(fidelity_dir, "fidelity_ci.npz"))["rows"]))
    captures = sorted(name for name in os.listdir(capture_dir) if name.endswith(".npz"))
    record = {
        "device": device,
        "made_by": "scripts/capture_device.py C --only dots; scripts/capture_ex2_edges.py C; "
                   "scripts/capture_div_edges.py C; scripts/gpu_crosscheck.py F --steps fidelity; "
                   "scripts/device_record.py C F",
        "sha256": {**{name: sha256(os.path.join(capture_dir, name)) for name in captures},
                   "fidelity_ci.npz": sha256(os.path.join(fidelity_dir, "fidelity_ci.npz"))},
        "fidelity_rows": rows,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])

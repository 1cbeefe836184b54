"""A capture's record without its arrays, for a capture whose arrays another committed capture already holds: the
meta and, per case, the sha256 of each array's bytes (and its dtype and shape), so that a test can show the two
captures are the same bits without storing them twice.

    python scripts/capture_digest.py CAPTURE.npz RECORD.json
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def digest(a: np.ndarray) -> str:
    """sha256 of an array's bytes in C order, with its dtype and shape."""
    a = np.ascontiguousarray(a)
    return f"{a.dtype.str}{list(a.shape)}:{hashlib.sha256(a.tobytes()).hexdigest()}"


def main(src: str, dst: str) -> None:
    with np.load(src) as z:
        meta = json.loads(str(z["meta"]))
        arrays = {k: digest(z[k]) for k in sorted(z.files) if k != "meta"}
    with open(dst, "w") as f:
        json.dump({"meta": meta, "sha256": arrays}, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])

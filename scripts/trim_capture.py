"""Keep some cases of a deployed kernel's capture: the device's arrays of those cases, renumbered, and their recipes,
byte for byte (a smaller file to commit; nothing is recomputed).

Run anywhere:  python scripts/trim_capture.py IN.npz OUT.npz CASE[,CASE...]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from amla_sim._files import atomic_savez


def trim(src: str, dst: str, keep: list[int]) -> None:
    with np.load(src) as z:
        meta = json.loads(str(z["meta"]))
        arrays = {}
        for new, old in enumerate(keep):
            prefix = f"c{old}_"
            arrays.update({f"c{new}_{k[len(prefix):]}": z[k] for k in z.files if k.startswith(prefix)})
    meta["cases"] = [meta["cases"][i] for i in keep]
    meta["trimmed_from"] = {"cases": keep}
    atomic_savez(dst, meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    trim(sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3].split(",")])

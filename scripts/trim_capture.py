"""Keep some cases of a deployed kernel's capture: the device's arrays of those cases, renumbered, and their recipes,
byte for byte (a smaller file to commit; nothing is recomputed). With ``--keep-heads N``, for a capture whose
recipes keep the first heads of each call (``fa3-prefill``): only the first N of them (a grouped call's first group
where that is more), out (T, h, d) and lse (h, T) cut to them and each recipe's ``keep_heads`` set to their count.

Run anywhere:  python scripts/trim_capture.py IN.npz OUT.npz CASE[,CASE...] [--keep-heads N]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from amla_sim._files import atomic_savez


def trim(src: str, dst: str, keep: list[int], heads: int | None = None) -> None:
    with np.load(src) as z:
        meta = json.loads(str(z["meta"]))
        arrays = {}
        for new, old in enumerate(keep):
            prefix = f"c{old}_"
            arrays.update({f"c{new}_{k[len(prefix):]}": z[k] for k in z.files if k.startswith(prefix)})
    meta["cases"] = [dict(meta["cases"][i]) for i in keep]
    meta["trimmed_from"] = {"cases": keep}
    if heads is not None:
        for i, case in enumerate(meta["cases"]):
            n = max(heads, case["heads"] // case["heads_k"])  # a grouped call keeps at least its first group
            if not 1 <= n <= case["keep_heads"] or n % (case["heads"] // case["heads_k"]):
                raise SystemExit(f"--keep-heads: case {keep[i]} keeps {case['keep_heads']} heads in groups of "
                                 f"{case['heads'] // case['heads_k']}; {n} is not a whole number of them")
            case["keep_heads"] = n
            arrays[f"c{i}_out"] = np.ascontiguousarray(arrays[f"c{i}_out"][:, :n])
            arrays[f"c{i}_lse"] = np.ascontiguousarray(arrays[f"c{i}_lse"][:n])
        meta["trimmed_from"]["keep_heads"] = heads
    atomic_savez(dst, meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    args = sys.argv[1:]
    heads = None
    if "--keep-heads" in args:
        i = args.index("--keep-heads")
        heads = int(args[i + 1])
        del args[i:i + 2]
    trim(args[0], args[1], [int(i) for i in args[2].split(",")], heads)

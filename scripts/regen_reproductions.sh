#!/usr/bin/env bash
# Re-run every committed reproduction (docs/reproductions/) with its recorded settings into OUT (default: a new
# temporary folder), then copy summary.json, table.md and table.png back. The draws depend only on the seed and the
# table, so the means must come out identical to the committed ones: the script stops if one differs. OUT must not
# exist: a folder of earlier runs would resume, finish at once and check nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -u /tmp/regen.XXXXXX)}
if [ -e "$OUT" ]; then
    echo "regen_reproductions: $OUT exists; give a new folder (runs there would resume, not recompute)" >&2
    exit 2
fi
echo "regen_reproductions: runs in $OUT"
run() {  # folder table samples context heads machine schedule
    amla-sim reproduce "$2" --samples "$3" --context "$4" --heads "$5" --machine "$6" --schedule "$7" \
        --jobs 2 --engine numba --quiet --out "$OUT/$1" > /dev/null
    python - "$1" "$2" "$OUT" <<'PY'
import json, shutil, sys
folder, table, out = sys.argv[1], sys.argv[2], sys.argv[3]
old = json.load(open(f"docs/reproductions/{folder}/summary.json"))
new = json.load(open(f"{out}/{folder}/{table}/summary.json"))
key = lambda r: (r["distribution"], r["algorithm"])
assert {key(r): r["ours"] for r in old["rows"]} == {key(r): r["ours"] for r in new["rows"]}, f"{folder}: means differ"
for f in ("summary.json", "table.md", "table.png"):
    shutil.copy(f"{out}/{folder}/{table}/{f}", f"docs/reproductions/{folder}/{f}")
print(f"{folder}: {len(new['rows'])} means identical; files copied")
PY
}
run amla-table3 amla-table3 100 8192 128 ieee32-fast reference
run amla-table4 amla-table4 100 8192 128 ieee32-fast reference
run snapmla-configs snapmla-configs 20 4096 128 ieee32-fast reference
run etap-table1-kernel etap-table1-kernel 16 4096 16 sm90-cuda reference
run etap-table1 etap-table1 20 65536 16 ieee32-fast reference
run fp8-mla fp8-mla 100 4096 128 sm90-cuda reference
run sm90-triton/amla-table3 amla-table3 100 8192 128 sm90-triton amla-sim-gpu
run sm90-triton/amla-table4 amla-table4 100 8192 128 sm90-triton amla-sim-gpu

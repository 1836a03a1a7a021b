#!/usr/bin/env bash
# scripts/gpu-ab.sh — decode A/B of built libminikv libraries on one GPU: bench/bench_decode_matrix.py
# once per library per round, the libraries interleaved (A B A B ...) so that the GPU's drift over
# minutes falls on both, then one table of every cell: each library's median time over the rounds,
# its ratio to the first library's, and its share of cuDNN's bytes/s.
#
#   scripts/gpu-ab.sh LABEL=LIB [LABEL=LIB ...] [-- bench_decode_matrix.py args...]
#   e.g. scripts/gpu-ab.sh main=build-a/libminikv.so next=build-b/libminikv.so -- --quick --storage 3
#
# Environment (optional): ROUNDS (2), OUT (results and logs: ab-rounds.json, every round's
# results by label; ab.log; ab-summary.txt; default ./gpu-ab). Needs torch with CUDA, like
# the benchmark.
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"

parse_ab_args LIB "$@"
shift "$ab_shift"
labels=("${ab_labels[@]}") libs=("${ab_paths[@]}")
for lib in "${libs[@]}"; do [ -f "$lib" ] || die "no library at $lib"; done
rounds=${ROUNDS:-2}
out=${OUT:-gpu-ab}
mkdir -p "$out"
rm -f "$out"/ab-*-r*.json "$out/ab-rounds.json"  # the summary reads every round's file: none from an earlier run

for ((r = 1; r <= rounds; r++)); do
  for i in "${!labels[@]}"; do
    echo "== round $r: ${labels[$i]} (${libs[$i]})" | tee -a "$out/ab.log"
    MINIKV_LIBRARY=${libs[$i]} PYTHONUNBUFFERED=1 python3 "$MINIKV_ROOT/bench/bench_decode_matrix.py" \
      --out "$out/ab-${labels[$i]}-r$r.json" "$@" 2>&1 | tee -a "$out/ab.log"
  done
done

python3 - "$out" "${labels[@]}" <<'EOF' | tee "$out/ab-summary.txt"
import glob, json, os, statistics, sys

out, labels = sys.argv[1], sys.argv[2:]
cells = {}  # cell -> label -> [(ms, of_cudnn_rate)]
for label in labels:
    for path in sorted(glob.glob(os.path.join(out, f"ab-{label}-r*.json"))):
        for r in json.load(open(path))["results"]:
            if "minikv_ms" not in r:
                continue
            cell = (r["dtype"], r["storage"], r.get("kernel", "auto"), r["B"], r["H"], r["Hkv"], r["D"], r["L"])
            cells.setdefault(cell, {}).setdefault(label, []).append((r["minikv_ms"], r.get("of_cudnn_rate", float("nan"))))
head = "cell".ljust(52) + "".join(f"{l:>26}" for l in labels)
print(head + "\n" + " " * 52 + "".join(f"{'ms  ×first  of cuDNN':>26}" for _ in labels))
for cell, by in cells.items():
    name = "{} {} {} B{} {}/{} D{} L{}".format(*cell)
    base = statistics.median(m for m, _ in by[labels[0]]) if labels[0] in by else float("nan")
    row = name.ljust(52)
    for l in labels:
        if l not in by:
            row += f"{'-':>26}"
            continue
        ms = statistics.median(m for m, _ in by[l])
        rate = statistics.median(c for _, c in by[l])
        row += f"{ms:10.4f} {ms / base:6.3f} {100 * rate:7.0f}%"
    print(row)
# One file for every round (a remote runner may bring back only a few files).
rounds = {l: [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, f"ab-{l}-r*.json")))] for l in labels}
json.dump(rounds, open(os.path.join(out, "ab-rounds.json"), "w"), indent=1)
EOF
rm -f "$out"/ab-*-r*.json

#!/usr/bin/env bash
# scripts/gpu-ab.sh — A/B of built libminikv libraries on one GPU, the libraries interleaved
# (A B A B ...) so that the GPU's drift over minutes falls on both, then one table with each
# library's median over the rounds and its ratio to the first library's.
#
#   scripts/gpu-ab.sh LABEL=LIB [LABEL=LIB ...] [-- bench_decode_matrix.py args...]
#   scripts/gpu-ab.sh LABEL=LIB [LABEL=LIB ...] -- trace ncu_driver.py args...
#   e.g. scripts/gpu-ab.sh main=build-a/libminikv.so next=build-b/libminikv.so -- --quick --storage 3
#        scripts/gpu-ab.sh main=a.so next=b.so -- trace prefill --mode window --Hkv 32 --L 4096 --reps 6
#
# Decode (the default): bench/bench_decode_matrix.py per library per round; the table has every
# cell's time, ratio and share of cuDNN's bytes/s. `trace`: bench/ncu_driver.py --trace per
# library per round; the table has the GPU microseconds per rep of every kernel and the wall
# time per rep (a prefill's forward, scores, selection and store side by side).
#
# Environment (optional): ROUNDS (2), OUT (results and logs: ab-rounds.json, every round's
# results by label; ab.log; ab-summary.txt; default ./gpu-ab). Needs torch with CUDA, like
# the benchmarks.
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"

parse_ab_args LIB "$@"
shift "$ab_shift"
labels=("${ab_labels[@]}") libs=("${ab_paths[@]}")
for lib in "${libs[@]}"; do [ -f "$lib" ] || die "no library at $lib"; done
trace=0
if [ "${1:-}" = trace ]; then
  trace=1
  shift
fi
rounds=${ROUNDS:-2}
out=${OUT:-gpu-ab}
mkdir -p "$out"
rm -f "$out"/ab-*-r*.json "$out/ab-rounds.json"  # the summary reads every round's file: none from an earlier run

for ((r = 1; r <= rounds; r++)); do
  for i in "${!labels[@]}"; do
    echo "== round $r: ${labels[$i]} (${libs[$i]})" | tee -a "$out/ab.log"
    json=$out/ab-${labels[$i]}-r$r.json
    if [ $trace = 1 ]; then
      MINIKV_LIBRARY=${libs[$i]} PYTHONUNBUFFERED=1 python3 "$MINIKV_ROOT/bench/ncu_driver.py" \
        "$@" --trace --json "$json" 2>&1 | tee -a "$out/ab.log"
    else
      MINIKV_LIBRARY=${libs[$i]} PYTHONUNBUFFERED=1 python3 "$MINIKV_ROOT/bench/bench_decode_matrix.py" \
        --out "$json" "$@" 2>&1 | tee -a "$out/ab.log"
    fi
  done
done

python3 - "$out" "${labels[@]}" <<'EOF' | tee "$out/ab-summary.txt"
import glob, json, os, re, statistics, sys

out, labels = sys.argv[1], sys.argv[2:]
rounds = {l: [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, f"ab-{l}-r*.json")))] for l in labels}
trace = any("kernels" in run for runs in rounds.values() for run in runs)


def kernel_name(name):
    """'void ns::(anonymous namespace)::store_kept_kernel<__half>(ns::StoreParams)' -> 'store_kept_kernel<__half>'."""
    name = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "")
    head, sep, args = name.partition("<")
    head = re.sub(r"\(.*$", "", head)
    targs = ("<" + args.rsplit(">", 1)[0] + ">") if sep else ""
    return re.sub(r"^.*::", "", head) + targs


cells = {}  # row -> label -> [(value, share of cuDNN's rate or None)]
for label, runs in rounds.items():
    for run in runs:
        if "kernels" in run:  # trace: ncu_driver.py --json
            for name, k in run["kernels"].items():
                cells.setdefault(kernel_name(name), {}).setdefault(label, []).append((k["us_per_rep"], None))
            cells.setdefault("wall per rep, ms", {}).setdefault(label, []).append((statistics.median(run["wall_ms"]), None))
            continue
        for r in run["results"]:
            if "minikv_ms" not in r:
                continue
            cell = "{} {} {} B{} {}/{} D{} L{}".format(
                r["dtype"], r["storage"], r.get("kernel", "auto"), r["B"], r["H"], r["Hkv"], r["D"], r["L"])
            cells.setdefault(cell, {}).setdefault(label, []).append((r["minikv_ms"], r.get("of_cudnn_rate", float("nan"))))
width = max([len(c) for c in cells] + [40]) + 2
unit = "us per rep  ×first" if trace else "ms  ×first  of cuDNN"
print("".ljust(width) + "".join(f"{l:>26}" for l in labels))
print("".ljust(width) + "".join(f"{unit:>26}" for _ in labels))
for cell, by in cells.items():
    base = statistics.median(v for v, _ in by[labels[0]]) if labels[0] in by else float("nan")
    row = cell.ljust(width)
    for l in labels:
        if l not in by:
            row += f"{'-':>26}"
            continue
        v = statistics.median(x for x, _ in by[l])
        shares = [s for _, s in by[l] if s is not None]
        share = f"{100 * statistics.median(shares):7.0f}%" if shares else " " * 8
        row += f"{v:10.4f} {v / base:6.3f} {share}"
    print(row)
# One file for every round (a remote runner may bring back only a few files).
json.dump(rounds, open(os.path.join(out, "ab-rounds.json"), "w"), indent=1)
EOF
rm -f "$out"/ab-*-r*.json

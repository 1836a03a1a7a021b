#!/usr/bin/env bash
# scripts/engine-ab.sh — A/B of built minikv-engine binaries (examples/engine), or of built
# libminikv libraries under one engine, on one machine: `ENGINE --bench ARGS` once per binary
# or library per round, interleaved (A B A B ...) so that the GPU's drift over minutes falls
# on all, then one table: per (model, cache, context) the median ms per token and the median
# dense part (the step without attention), per throughput row the median decode tokens/s,
# each with its ratio to the first's.
#
#   scripts/engine-ab.sh LABEL=ENGINE|LIBRARY [LABEL=ENGINE|LIBRARY ...] [-- minikv-engine --bench args...]
#   e.g. scripts/engine-ab.sh main=build-a/examples/engine/minikv-engine \
#          next=build-b/examples/engine/minikv-engine -- --random llama2-7b --contexts 32768 --no-throughput
#        ENGINE=build/examples/engine/minikv-engine scripts/engine-ab.sh \
#          main=build-a/libminikv.so next=build-b/libminikv.so -- --random llama2-7b --no-latency
#
# A LIBRARY (a path ending in .so or .so.N...) runs under the engine that ENGINE names (it
# links libminikv dynamically), with the library's folder first on LD_LIBRARY_PATH; the log
# shows the libminikv each run resolved.
# Environment (optional): ENGINE (for libraries), ROUNDS (2), OUT (results and logs:
# engine-ab-rounds.json, every round's JSON by label; engine-ab.log; engine-ab-summary.txt;
# default ./engine-ab).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"

parse_ab_args "ENGINE|LIBRARY" "$@"
shift "$ab_shift"
labels=("${ab_labels[@]}") engines=("${ab_paths[@]}")
is_library() { [[ $1 =~ \.so(\.[0-9]+)*$ ]]; }
for e in "${engines[@]}"; do
  if is_library "$e"; then
    [ -f "$e" ] || die "no library at $e"
    [ -x "${ENGINE:-}" ] || die "$e is a library: ENGINE must name an executable minikv-engine to run it under"
  else
    [ -x "$e" ] || die "no executable engine at $e"
  fi
done
# run_engine PATH ARGS...: the engine at PATH, or ENGINE under the library at PATH.
run_engine() {
  local path=$1
  shift
  if is_library "$path"; then
    local dir
    dir=$(cd "$(dirname "$path")" && pwd)
    LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$ENGINE" | grep -m1 libminikv || true
    LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$ENGINE" "$@"
  else
    "$path" "$@"
  fi
}
for a in "$@"; do [ "$a" != "--json" ] || die "--json is this script's (OUT holds every round's)"; done
rounds=${ROUNDS:-2}
out=${OUT:-engine-ab}
mkdir -p "$out"
rm -f "$out"/engine-ab-*-r*.json "$out/engine-ab-rounds.json"  # none from an earlier run in the summary

for ((r = 1; r <= rounds; r++)); do
  for i in "${!labels[@]}"; do
    echo "== round $r: ${labels[$i]} (${engines[$i]})" | tee -a "$out/engine-ab.log"
    run_engine "${engines[$i]}" --bench "$@" --json "$out/engine-ab-${labels[$i]}-r$r.json" 2>&1 | tee -a "$out/engine-ab.log"
  done
done

python3 - "$out" "${labels[@]}" <<'EOF' | tee "$out/engine-ab-summary.txt"
import glob, json, os, statistics, sys

out, labels = sys.argv[1], sys.argv[2:]
runs = {l: [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, f"engine-ab-{l}-r*.json")))] for l in labels}
# (section, row name) -> label -> {field: [values over rounds]}
rows = {}
fields = {"latency": ("ms_per_token", "dense_ms"), "throughput": ("decode_tokens_per_s", "step_ms")}
for l, rs in runs.items():
    for run in rs:
        for section, keys in fields.items():
            for r in run.get(section, []):
                name = (f"{r['model']} {r['cache']} {r['context']}" if section == "latency"
                        else f"{r['model']} {r['cache']} batch {r.get('batch', '?')}")
                cell = rows.setdefault((section, name), {}).setdefault(l, {k: [] for k in keys})
                for k in keys:
                    if r.get(k) is not None:
                        cell[k].append(r[k])
for section, (main_key, second_key) in fields.items():
    names = [n for s, n in rows if s == section]
    if not names:
        continue
    print(f"\n{section}: {main_key} (x first), {second_key}")
    print("row".ljust(34) + "".join(f"{l:>30}" for l in labels))
    for n in names:
        by = rows[(section, n)]
        med = {l: (statistics.median(by[l][main_key]) if l in by and by[l][main_key] else None,
                   statistics.median(by[l][second_key]) if l in by and by[l][second_key] else None) for l in labels}
        base = med[labels[0]][0]
        line = n.ljust(34)
        for l in labels:
            v, w = med[l]
            line += f"{'-':>30}" if v is None else f"{v:11.3f} {v / base if base else float('nan'):6.3f}x {w if w is not None else float('nan'):10.3f}"
        print(line)
# One file for every round (a remote runner may bring back only a few files).
json.dump(runs, open(os.path.join(out, "engine-ab-rounds.json"), "w"), indent=1)
EOF
rm -f "$out"/engine-ab-*-r*.json

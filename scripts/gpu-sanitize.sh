#!/usr/bin/env bash
# scripts/gpu-sanitize.sh — compute-sanitizer over the CUDA backend within a time budget, on
# a machine with an sm_80+ NVIDIA GPU (made for an H200):
#   1. builds the library, the device API fuzz (tests/gpu/fuzz_cuda_api.cpp) and the GPU test
#      binaries it runs (ninja; a build gpu-check.sh left in the same directory is reused);
#   2. memcheck (--leak-check full) on the fuzz, one seed after another (3 iterations x 60
#      calls each) for GPU_SANITIZE_MEMCHECK_S seconds: a seed starts only while the time
#      left holds one more run as long as the longest so far;
#   3. racecheck, then synccheck, on small runs that reach every kernel family: the fuzz
#      (one short seed), gpu_test_cuda_backend on five cases that take the fast, the
#      one-warp (the default storage), the tensor-core and the generic decode kernels (sinks,
#      16-bit and 8-bit storage) after the wgmma prefill with WINDOW's pass and the wgmma score
#      pass, and gpu_test_cuda_prefill_chunk on chunked prompts at head_dim 96 (the
#      mma.sync prefill, the generic decode's packed rows) and 128; each run is cut at
#      GPU_SANITIZE_RUN_S seconds.
# Every run is also cut where the budget ends; what the budget left out is reported SKIPPED,
# a run cut short INCOMPLETE (neither counts as clean).
# Under $OUT: build.log, memcheck.log, racecheck.log, synccheck.log (every run's command,
# output and sanitizer summary) and summary.txt: a header, then one line per tool. Exit
# status 0 only if every run of every tool completed with no sanitizer error and no failed
# check.
#
# Environment (all optional):
#   GPU_SANITIZE_BUDGET      seconds for the whole script, build included (default 570: one
#                            10-minute device call with room to copy the logs back)
#   GPU_SANITIZE_TOOLS       which tools, in order (default "memcheck racecheck synccheck")
#   GPU_SANITIZE_MEMCHECK_S  seconds of memcheck fuzz (default: 2/5 of the budget left after
#                            the build when racecheck or synccheck follow, else all of it)
#   GPU_SANITIZE_RUN_S       seconds at most per racecheck or synccheck run (default 150)
#   GPU_SANITIZE_SEED        first fuzz seed of the memcheck runs (default 1000)
#   MINIKV_BUILD_DIR         build directory (build-gpu-check in the repository, shared with
#                            gpu-check.sh)
#   GPU_SANITIZE_BIN_DIR     run these prebuilt binaries instead of building: a directory with
#                            fuzz_cuda_api, gpu_test_cuda_backend and gpu_test_cuda_prefill_chunk
#                            (scripts/gpu-pack.sh's pack, unpacked: .deps/packed/tests, with
#                            LD_LIBRARY_PATH on its lib)
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES (90a)
#   MINIKV_JOBS              parallel build jobs (nproc)
#   OUT                      logs and summary (<build>/gpu-sanitize)
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_arguments "$@"

start=$(date +%s)
budget=${GPU_SANITIZE_BUDGET:-570}
tools=${GPU_SANITIZE_TOOLS:-memcheck racecheck synccheck}
run_s=${GPU_SANITIZE_RUN_S:-150}
seed0=${GPU_SANITIZE_SEED:-1000}
root=$MINIKV_ROOT
build=${MINIKV_BUILD_DIR:-$root/build-gpu-check}
out=${OUT:-$build/gpu-sanitize}
archs=${MINIKV_CUDA_ARCHITECTURES:-90a}
jobs=${MINIKV_JOBS:-$(nproc)}
for t in $tools; do
  case $t in memcheck|racecheck|synccheck) ;; *) die "GPU_SANITIZE_TOOLS: '$t' is not memcheck, racecheck or synccheck" ;; esac
done
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
left() { echo $((budget - ($(date +%s) - start))); }

export PATH=$PATH:/usr/local/cuda/bin
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$san" ] || die "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
commit=${MINIKV_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
say "gpu-sanitize $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $commit, budget ${budget} s, tools: $tools"
say "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); $("$san" --version 2>&1 | grep -io 'version [0-9.]*' | head -1)"

# ---- 1. build ------------------------------------------------------------------------
bins=${GPU_SANITIZE_BIN_DIR:-$build/tests}
fuzz=$bins/fuzz_cuda_api
backend_test=$bins/gpu_test_cuda_backend
chunk_test=$bins/gpu_test_cuda_prefill_chunk
t0=$(date +%s)
if [ -n "${GPU_SANITIZE_BIN_DIR:-}" ]; then
  for b in "$fuzz" "$backend_test" "$chunk_test"; do [ -x "$b" ] || die "GPU_SANITIZE_BIN_DIR: no $b"; done
  say "build: none, the binaries of $bins"
else
  {
    configure "$build" -DMINIKV_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$archs" -DMINIKV_TESTS=ON &&
      timeout "$(left)" ninja -C "$build" -j "$jobs" fuzz_cuda_api gpu_test_cuda_backend \
        gpu_test_cuda_prefill_chunk
  } >"$out/build.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    say "build: FAIL (exit $rc, $(($(date +%s) - t0)) s; build.log)"
    tail -30 "$out/build.log"
    exit 1
  fi
  say "build: $(($(date +%s) - t0)) s"
fi

# ---- the runs ------------------------------------------------------------------------
# run_one <tool> <seconds> <label> <command...>: one sanitizer run appended to <tool>.log;
# sets run_status (clean | ERRORS | FAILED | INCOMPLETE | SKIPPED), run_time, run_line.
run_one() {
  local tool=$1 limit=$2 label=$3
  shift 3
  local log=$out/$tool.log extra=()
  case $tool in
    memcheck) extra=(--leak-check full) ;;
    racecheck) extra=(--racecheck-report analysis) ;;
  esac
  run_time=0
  if [ "$(left)" -lt 10 ] || [ "$limit" -lt 1 ]; then
    run_status=SKIPPED
    run_line="$label SKIPPED (budget)"
    echo "==== $tool $label: skipped, $(left) s of the budget left" >>"$log"
    return
  fi
  echo "==== $tool $label: $* (at most $limit s)" >>"$log"
  local t0 rc before
  before=$(wc -l <"$log")
  t0=$(date +%s)
  timeout -k 10 "$limit" "$san" --tool "$tool" "${extra[@]}" --error-exitcode 99 "$@" >>"$log" 2>&1
  rc=$?
  run_time=$(($(date +%s) - t0))
  local tally
  tally=$(tail -n +"$((before + 1))" "$log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY" | tail -1 | sed 's/^=* *//')
  case $rc in
    0) run_status=clean ;;
    99) run_status=ERRORS ;;
    124|137) run_status=INCOMPLETE ;;
    *) run_status=FAILED ;;
  esac
  run_line="$label $run_status ${run_time} s${tally:+ ($tally)}"
  echo "==== $tool $label: $run_status, exit $rc, ${run_time} s" >>"$log"
}

overall=0
tool_summary() {  # tool_summary <tool> <runs> <clean> <lines...>
  local tool=$1 runs=$2 clean=$3 joined
  shift 3
  joined=$(printf '%s; ' "$@")
  say "$tool: $clean/$runs runs clean, $(($(date +%s) - tool_t0)) s: ${joined%; }"
  [ "$clean" -eq "$runs" ] || overall=1
}

# Runs of racecheck and synccheck: label and command. Doctest filters pick small cases
# (prompts of at most 200 tokens, at most 40 decode steps); -sc takes comma-separated names.
small_runs=(
  "fuzz seed 5|$fuzz --seed 5 --iterations 1 --ops 30"
  "backend fast+warp+mma+generic|$backend_test -tc=CUDA matches CPU on prefill + selection* -sc=f16 hd128 gqa8 keep-all,f16 hd64 mha 16/16 keep-all 17 sinks,bf16 hd64 gqa2 8/2 G16,f16 hd128 gqa4 cumulative 2/2 G16,f16 hd128 gqa4 4/2 G32 4 sinks"
  "prefill_chunk hd96+hd128|$chunk_test -tc=CUDA chunked prefill equals* -sc=f16 hd96 gqa8 pyramid 2/2 G16,f16 hd128 gqa8 keep-all"
)
n_small=0
for t in $tools; do [ "$t" = memcheck ] || n_small=$((n_small + ${#small_runs[@]})); done

for tool in $tools; do
  : >"$out/$tool.log"
  tool_t0=$(date +%s)
  lines=()
  runs=0
  clean=0
  if [ "$tool" = memcheck ]; then
    # What the memcheck fuzz may take: its setting, else 2/5 of what is left when other
    # tools follow, else all of it.
    slot=${GPU_SANITIZE_MEMCHECK_S:-$(($(left) * (n_small > 0 ? 2 : 5) / 5))}
    end=$(($(date +%s) + slot))
    longest=0
    seeds=()
    seed=$seed0
    while :; do
      remaining=$((end - $(date +%s)))
      [ "$(left)" -lt "$remaining" ] && remaining=$(left)
      # One more seed only if it fits as the longest run did (always the first one).
      [ ${#seeds[@]} -gt 0 ] && [ "$remaining" -lt $((longest + longest / 4 + 5)) ] && break
      run_one memcheck "$remaining" "fuzz seed $seed" "$fuzz" --seed "$seed" --iterations 3 --ops 60
      [ "$run_status" = SKIPPED ] && break
      runs=$((runs + 1))
      [ "$run_status" = clean ] && clean=$((clean + 1))
      [ "$run_status" = clean ] || lines+=("$run_line")
      seeds+=("$seed")
      [ "$run_time" -gt "$longest" ] && longest=$run_time
      seed=$((seed + 1))
      [ "$run_status" = INCOMPLETE ] && break
    done
    lines=("fuzz_cuda_api seeds ${seeds[*]:-none} x 3 iterations x 60 ops, longest ${longest} s" "${lines[@]}")
    [ $runs -eq 0 ] && runs=1  # nothing ran: not clean
  else
    for entry in "${small_runs[@]}"; do
      label=${entry%%|*}
      # Split the command at spaces except inside the doctest filters (-tc=, -sc= to the end
      # of the entry or to the next " -").
      cmd=${entry#*|}
      read -r bin rest <<<"$cmd"
      args=()
      if [[ $rest == -tc=* ]]; then
        args+=("${rest%% -sc=*}")
        [[ $rest == *" -sc="* ]] && args+=("-sc=${rest#* -sc=}")
      else
        read -r -a args <<<"$rest"
      fi
      # Cut at GPU_SANITIZE_RUN_S, and where the budget ends.
      limit=$(left)
      [ "$limit" -gt "$run_s" ] && limit=$run_s
      run_one "$tool" "$limit" "$label" "$bin" "${args[@]}"
      runs=$((runs + 1))
      [ "$run_status" = clean ] && clean=$((clean + 1))
      lines+=("$run_line")
    done
  fi
  tool_summary "$tool" "$runs" "$clean" "${lines[@]}"
done

say "$([ $overall -eq 0 ] && echo 'gpu-sanitize: ALL CLEAN' || echo 'gpu-sanitize: NOT ALL CLEAN (see the logs)') in $(($(date +%s) - start)) s"
exit $overall

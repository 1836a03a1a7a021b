#!/usr/bin/env bash
# scripts/gpu-check.sh — the whole GPU check in one go, on a machine with an sm_80+ NVIDIA
# GPU (made for an H200):
#   1. configure libminikv with the CUDA backend (sm_90a by default) and build it, its tests
#      and the C demo with ninja;
#   2. run the GPU test suite (ctest -L gpu);
#   3. run the C demo on the GPU;
#   4. run compute-sanitizer memcheck and racecheck on every GPU test binary and on the
#      device API-sequence fuzz (tests/gpu/fuzz_cuda_api.cpp, a shorter run).
# Logs and a summary go to $OUT: build.log, ctest.log, demo.log, memcheck.log,
# racecheck.log, summary.txt. Exit status 0 only if every step passed.
#
# Environment (all optional):
#   MINIKV_BUILD_DIR   build directory             (build-gpu-check in the repository)
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES (90a; "80;90a-real" for A100 + H100)
#   MINIKV_JOBS        parallel build jobs         (nproc)
#   OUT                logs and summary            (<build>/gpu-check)
#   GPU_CHECK_SANITIZE 0 skips step 4; a list ("memcheck") runs only those tools (default 1:
#                      memcheck racecheck)
#   GPU_CHECK_SANITIZER_TIMEOUT seconds per sanitizer run (default 300)
#   MINIKV_COMMIT      commit label for the summary when .git is absent
# doctest: Debian's doctest-dev, or the header copied to .deps/include/doctest/doctest.h.
# Google Highway (the CPU backend's SIMD kernels): Debian's libhwy-dev, or, on a machine
# without apt, Debian's libhwy-dev and libhwy1 packages unpacked into .deps/hwy
# (apt-get download libhwy-dev libhwy1 elsewhere; for f in *.deb; do dpkg -x $f .deps/hwy; done).
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_positional_build_dir "$@"
no_arguments "$@"
renamed_setting MINIKV_CUDA_ARCHS MINIKV_CUDA_ARCHITECTURES

root=$MINIKV_ROOT
build=${MINIKV_BUILD_DIR:-$root/build-gpu-check}
out=${OUT:-$build/gpu-check}
archs=${MINIKV_CUDA_ARCHITECTURES:-90a}
jobs=${MINIKV_JOBS:-$(nproc)}
sanitize=${GPU_CHECK_SANITIZE:-1}
san_timeout=${GPU_CHECK_SANITIZER_TIMEOUT:-300}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
failed=0
say() { echo "$*" | tee -a "$summary"; }
record() {  # record <name> <status>
  if [ "$2" -eq 0 ]; then say "PASS  $1"; else say "FAIL  $1 (exit $2)"; failed=1; fi
}

export PATH=$PATH:/usr/local/cuda/bin
# MINIKV_COMMIT names the commit where the tree travels without .git (a remote GPU box).
commit=${MINIKV_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
# Local changes are looked for only when git names the commit (a copied tree may carry a stale .git).
say "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $commit$([ -z "${MINIKV_COMMIT:-}" ] && git -C "$root" rev-parse --verify -q HEAD >/dev/null 2>&1 && ! git -C "$root" diff --quiet HEAD -- kernels src include tests/gpu && echo " (+ local changes)")"
say "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
say "nvcc: $(nvcc --version 2>&1 | grep -o 'release [0-9.]*' | head -1), cmake $(cmake --version | head -1 | awk '{print $3}'), archs $archs"

# ---- 1. build ------------------------------------------------------------------------
t0=$(date +%s)
{
  configure "$build" -DMINIKV_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$archs" -DMINIKV_TESTS=ON -DMINIKV_EXAMPLES=ON &&
    # Only what this check runs: the library, the GPU test binaries, the fuzz and the C demo.
    targets=$(ninja -C "$build" -t targets all | awk -F: '/^(gpu_test_[A-Za-z0-9_]+|fuzz_cuda_api|minikv|minikv_demo): /{print $1}' | sort -u) &&
    echo "targets: $targets" &&
    ninja -C "$build" -j "$jobs" $targets
} >"$out/build.log" 2>&1
rc=$?
record "build ($(($(date +%s) - t0)) s)" $rc
if [ $rc -ne 0 ]; then
  tail -40 "$out/build.log"
  exit 1
fi

# ---- 2. GPU tests ----------------------------------------------------------------------
t0=$(date +%s)
ctest --test-dir "$build" -L gpu --output-on-failure --timeout 900 >"$out/ctest.log" 2>&1
rc=$?
record "ctest -L gpu ($(($(date +%s) - t0)) s): $(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1)" $rc
[ $rc -ne 0 ] && grep -E "ERROR|FAILED|failed|error:" "$out/ctest.log" | head -40
mapfile -t bins < <(find "$build/tests" -maxdepth 1 -type f -name 'gpu_test_*' -perm -u+x | sort)
# Per-binary doctest totals (ctest runs one executable per test file without discovery).
for b in "${bins[@]}"; do
  say "      $(basename "$b"): $("$b" --count 2>/dev/null | grep -o 'unskipped test cases passing the current filters: [0-9]*' || true)"
done

# ---- 3. the C demo on the GPU --------------------------------------------------------
if [ -x "$build/tools/minikv_demo" ]; then
  "$build/tools/minikv_demo" --backend cuda >"$out/demo.log" 2>&1
  rc=$?
  record "C demo --backend cuda: $(tail -1 "$out/demo.log")" $rc
fi

# ---- 4. compute-sanitizer --------------------------------------------------------------
if [ "$sanitize" != 0 ]; then
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  tools="memcheck racecheck"
  [ "$sanitize" != 1 ] && tools=$sanitize
  for tool in $tools; do
    : >"$out/$tool.log"
    for b in "${bins[@]}"; do
      args=()
      # racecheck instruments every shared-memory access: leave out the long-prompt and
      # large-batch subcases (same kernels as the others, many more launches).
      [ $tool = racecheck ] && args=(--subcase-exclude='*long*,*batch*')
      t0=$(date +%s)
      echo "==== $tool $(basename "$b") ${args[*]}" >>"$out/$tool.log"
      timeout "$san_timeout" "$san" --tool $tool --error-exitcode 99 "$b" "${args[@]}" >>"$out/$tool.log" 2>&1
      rc=$?
      summary_line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/$tool.log" | tail -1)
      record "$tool $(basename "$b") ($(($(date +%s) - t0)) s): ${summary_line:-no summary}$([ $rc -eq 124 ] && echo ' TIMEOUT')" $rc
    done
    fuzz=$build/tests/fuzz_cuda_api
    if [ -x "$fuzz" ]; then
      t0=$(date +%s)
      echo "==== $tool fuzz_cuda_api --seed 7 --iterations 2 --ops 40" >>"$out/$tool.log"
      timeout "$san_timeout" "$san" --tool $tool --error-exitcode 99 "$fuzz" --seed 7 --iterations 2 --ops 40 >>"$out/$tool.log" 2>&1
      rc=$?
      summary_line=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/$tool.log" | tail -1)
      record "$tool fuzz_cuda_api ($(($(date +%s) - t0)) s): ${summary_line:-no summary}$([ $rc -eq 124 ] && echo ' TIMEOUT')" $rc
    fi
  done
fi

say "$([ $failed -eq 0 ] && echo 'gpu-check: ALL PASSED' || echo 'gpu-check: FAILURES (see logs)')"
exit $failed

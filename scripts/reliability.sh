#!/usr/bin/env bash
# scripts/reliability.sh — libminikv's reliability checks (issue 7), CPU backend:
#   asan  the whole CPU test suite (ctest -L cpu: unit, contract, fuzz-corpus replay, OOM
#         injection, threads) built with -fsanitize=address,undefined (MINIKV_SANITIZE=ON)
#         in build-asan; LeakSanitizer on, any report fails the run;
#   tsan  the concurrency tests (tests/reliability/test_threads: threads with their own
#         caches vs a serial run, per-thread/per-handle errors, MINIKV_NUM_THREADS
#         determinism) built with -fsanitize=thread in build-tsan;
#   fuzz  the libFuzzer targets tests/fuzz/fuzz_api_sequence and fuzz_config, built with
#         clang -fsanitize=fuzzer,address,undefined in build-fuzz, each run for
#         FUZZ_SECONDS from the committed corpus (the two run side by side).
# Usage: scripts/reliability.sh [asan] [tsan] [fuzz]      (no argument: all three)
# Environment (all optional):
#   FUZZ_SECONDS  seconds per fuzz target                        (60)
#   FUZZ_MERGE    1: rewrite tests/fuzz/corpus/*/min-* as a set cover of every edge reached
#                 (committed corpus + this run), via tests/fuzz/select_corpus.py
#   MINIKV_JOBS   build / ctest parallelism                      (nproc)
# A fuzz crash leaves its input in build-fuzz/artifacts/; replay it with
#   build-fuzz/tests/fuzz/<target> <file>      (FUZZ_TRACE=1 prints every call of
#   fuzz_api_sequence) or any build's tests/fuzz/<target>_replay <file>.
# Installs clang and libFuzzer (Debian: clang, libclang-rt-14-dev) when missing.
# Takes about 20 minutes on 2 cores with the defaults, mostly the ASan build (its emulated
# kernel tests, tests/emulation, compile slowly under the sanitizer; they run in about 5).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
cd "$MINIKV_ROOT"

FUZZ_SECONDS=${FUZZ_SECONDS:-60}
JOBS=${MINIKV_JOBS:-$(nproc)}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(asan tsan fuzz)
for s in "${STAGES[@]}"; do
  case "$s" in asan|tsan|fuzz) ;; *) die "unknown stage '$s' (asan, tsan or fuzz)" ;; esac
done
wants() { local s; for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# The sanitizers' verdicts must fail the run, with stacks.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}

# Sanitizer builds: CPU only (CUDA device code is not instrumented), no bindings/examples.
COMMON=(-G Ninja -DMINIKV_CUDA=OFF -DMINIKV_TESTS=ON -DMINIKV_EXAMPLES=OFF
        -DCMAKE_BUILD_TYPE=RelWithDebInfo)
SUMMARY=()
start=$SECONDS

step "dependencies"
pkgs=(build-essential cmake ninja-build doctest-dev libhwy-dev)
wants fuzz && pkgs+=(clang libclang-rt-14-dev)
install_packages "${pkgs[@]}"

if wants asan; then
  step "ASan+UBSan: configure and build the CPU test suite (build-asan)"
  t0=$SECONDS
  cmake -S . -B build-asan "${COMMON[@]}" -DMINIKV_SANITIZE=ON >/dev/null
  cmake --build build-asan -j "$JOBS"
  step "ASan+UBSan: ctest -L cpu"
  ctest --test-dir build-asan --output-on-failure --no-tests=error -j "$JOBS" -L cpu | tee build-asan/ctest.log
  n=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2/p' build-asan/ctest.log | tail -1)
  SUMMARY+=("asan+ubsan: ctest -L cpu, ${n:-?} tests passed, no sanitizer report ($((SECONDS - t0)) s)")
fi

if wants tsan; then
  step "TSan: configure and build the concurrency tests (build-tsan)"
  t0=$SECONDS
  cmake -S . -B build-tsan "${COMMON[@]}" \
    "-DCMAKE_C_FLAGS=-fsanitize=thread -fno-omit-frame-pointer" \
    "-DCMAKE_CXX_FLAGS=-fsanitize=thread -fno-omit-frame-pointer" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" \
    "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread" >/dev/null
  cmake --build build-tsan -j "$JOBS" --target reliability_threads
  step "TSan: reliability_threads (tests/reliability/test_threads.cpp)"
  # setarch -R: TSan's shadow mapping needs the classic layout on kernels with a large
  # mmap_rnd_bits (it then fails with "unexpected memory mapping").
  runner=()
  setarch "$(uname -m)" -R true 2>/dev/null && runner=(setarch "$(uname -m)" -R)
  "${runner[@]}" build-tsan/tests/reliability/reliability_threads
  SUMMARY+=("tsan: reliability_threads (threads with own caches, migrating handle, per-thread/per-handle errors, MINIKV_NUM_THREADS determinism) clean ($((SECONDS - t0)) s)")
fi

if wants fuzz; then
  step "libFuzzer: configure and build (build-fuzz, clang, ASan+UBSan)"
  t0=$SECONDS
  flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  CC=clang CXX=clang++ cmake -S . -B build-fuzz "${COMMON[@]}" -DMINIKV_FUZZ_LIBFUZZER=ON \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=-fsanitize=address,undefined" >/dev/null
  cmake --build build-fuzz -j "$JOBS" --target fuzz_api_sequence fuzz_config
  step "libFuzzer: ${FUZZ_SECONDS} s per target"
  mkdir -p build-fuzz/artifacts
  pids=()
  for target in fuzz_api_sequence fuzz_config; do
    work=build-fuzz/corpus/$target
    mkdir -p "$work"
    cp -n tests/fuzz/corpus/$target/* "$work"/ 2>/dev/null || true
    # Half the cores each (at least one): the two targets run side by side.
    build-fuzz/tests/fuzz/$target -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 \
      -rss_limit_mb=2048 -timeout=30 -artifact_prefix="build-fuzz/artifacts/$target-" \
      "$work" >"build-fuzz/$target.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  i=0
  for target in fuzz_api_sequence fuzz_config; do
    if ! wait "${pids[$i]}"; then
      failed=1
      printf '\n---- %s FAILED; last lines of build-fuzz/%s.log:\n' "$target" "$target"
      tail -n 60 "build-fuzz/$target.log"
      ls -1 build-fuzz/artifacts/"$target"-* 2>/dev/null | sed 's/^/    reproducer: /'
    fi
    i=$((i + 1))
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "build-fuzz/$target.log" | tail -1)
    files=$(find "build-fuzz/corpus/$target" -type f | wc -l)
    committed=$(find "tests/fuzz/corpus/$target" -type f | wc -l)
    SUMMARY+=("fuzz: $target ${runs:-?} executions in ${FUZZ_SECONDS} s, corpus $committed committed -> $files")
  done
  [ "$failed" = 0 ] || die "a fuzz target found a failing input (see above)"
  if [ "${FUZZ_MERGE:-0}" = 1 ]; then
    for target in fuzz_api_sequence fuzz_config; do
      step "refresh tests/fuzz/corpus/$target (seeds + a set cover of the edges reached)"
      rm -rf "build-fuzz/merge-$target" && mkdir -p "build-fuzz/merge-$target"
      build-fuzz/tests/fuzz/$target -merge=1 -merge_control_file="build-fuzz/merge-$target.ctl" \
        "build-fuzz/merge-$target" "tests/fuzz/corpus/$target" "build-fuzz/corpus/$target" >/dev/null 2>&1
      python3 tests/fuzz/select_corpus.py "build-fuzz/merge-$target.ctl" "tests/fuzz/corpus/$target"
    done
  fi
  SUMMARY+=("fuzz: build + runs $((SECONDS - t0)) s")
fi

step "reliability summary ($((SECONDS - start)) s)"
for line in "${SUMMARY[@]}"; do note "$line"; done

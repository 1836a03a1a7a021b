#!/usr/bin/env bash
# scripts/gpu-packed-tests.sh — on a GPU machine: unpacks scripts/gpu-pack.sh's tar (with
# python3, so no xz is needed there) and runs every GPU test binary in it, each within what
# is left of a time limit, so that one call of a lent machine tests a build made elsewhere.
# Logs go to $OUT: test-<name>.log per binary, summary.txt, and all of it in logs.tgz (a
# runner that brings back only a few files brings back that one). The packed library is
# also left at .deps/packed/lib/libminikv.so for benchmarks in the same call
# (MINIKV_LIBRARY=... bench/bench_gpu.py ...). Exit status 0 only if every binary ran and passed.
#
#   scripts/gpu-packed-tests.sh
#
# Environment (all optional):
#   PACK         the tar                              (.pack/gpu.tar.xz)
#   LIMIT        seconds for all the tests together   (480)
#   TEST_LIMIT   seconds at most for one binary       (150; decode_matrix, run last, needs more)
#   TESTS        the binaries to run, by name         (all that are packed, in the pack's order)
#   DOCTEST_ARGS arguments for every binary, split at spaces (none). decode_matrix takes more
#                than one call's time: TESTS=decode_matrix with DOCTEST_ARGS
#                --test-case=*across*bits* runs its first case, --test-case-exclude=... the rest
#   OUT          logs                                 (gpu-packed-tests in the repository)
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_arguments "$@"

pack=${PACK:-$MINIKV_ROOT/.pack/gpu.tar.xz}
out=${OUT:-$MINIKV_ROOT/gpu-packed-tests}
limit=${LIMIT:-480} test_limit=${TEST_LIMIT:-150}
dest=$MINIKV_ROOT/.deps
[ -f "$pack" ] || die "no pack at $pack (scripts/gpu-pack.sh makes it)"
mkdir -p "$out" "$dest"
rm -rf "$dest/packed"
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$pack" "$dest" ||
  die "could not unpack $pack"
lib=$dest/packed/lib
export LD_LIBRARY_PATH=$lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
summary=$out/summary.txt
{
  sed 's/^/packed: /' "$dest/packed/PACKED"
  echo "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
} | tee "$summary"

t0=$(date +%s) failed=0
read -r -a names <<<"${TESTS:-$(sed -n 's/^tests //p' "$dest/packed/PACKED")}"  # gpu-pack.sh's order
read -r -a doctest_args <<<"${DOCTEST_ARGS:-}"
for name in "${names[@]}"; do
  bin=$dest/packed/tests/gpu_test_cuda_$name
  if [ ! -x "$bin" ]; then
    echo "FAIL  $name (not in the pack)" | tee -a "$summary"
    failed=1
    continue
  fi
  left=$((limit - $(date +%s) + t0))
  if [ "$left" -lt 20 ]; then
    echo "SKIP  $name (the time limit is spent)" | tee -a "$summary"
    failed=1
    continue
  fi
  [ "$left" -gt "$test_limit" ] && left=$test_limit
  start=$(date +%s)
  timeout "$left" "$bin" "${doctest_args[@]}" >"$out/test-$name.log" 2>&1
  rc=$?
  counts=$(grep -E '^\[doctest\] (test cases|assertions)' "$out/test-$name.log" | tr -s ' ' | tr '\n' ' ')
  if [ $rc -eq 0 ]; then verdict=PASS; else verdict=FAIL; failed=1; fi
  [ $rc -eq 124 ] && verdict="FAIL (stopped after ${left} s)"
  # Without a device the GPU tests skip themselves and pass: that is not a pass here.
  if [ $rc -eq 0 ] && [[ $counts == *"assertions: 0 |"* ]]; then verdict="FAIL (no assertion ran: no GPU?)"; failed=1; fi
  echo "$verdict  $name, $(($(date +%s) - start)) s: $counts" | tee -a "$summary"
done
logs=$(mktemp)
tar czf "$logs" -C "$out" --exclude=logs.tgz . && mv "$logs" "$out/logs.tgz"
exit $failed

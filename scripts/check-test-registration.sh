#!/usr/bin/env bash
# scripts/check-test-registration.sh BUILD_DIR — fails unless every doctest case compiled
# into the test executables of BUILD_DIR is registered with CTest under a label (cpu or gpu),
# i.e. runs under `ctest -L cpu` / `ctest -L gpu`. CTest's per-case registration gives a
# name containing ',' no label and splits one containing ';' into entries that run nothing;
# tests/CMakeLists.txt rejects such names at configure time, and this compares the counts
# after the build: cases each executable lists (--list-test-cases) against entries
# "<executable>:<case>" that ctest lists with a label.
set -euo pipefail
build=${1:?usage: scripts/check-test-registration.sh BUILD_DIR}
[ -f "$build/CTestTestfile.cmake" ] || { echo "no CTest tree in $build" >&2; exit 2; }

registered=$(ctest --test-dir "$build" -N -L 'cpu|gpu' | sed -n 's/^ *Test *#[0-9]*: //p')
all=$(ctest --test-dir "$build" -N | sed -n 's/^ *Test *#[0-9]*: //p')
status=0 compiled_total=0 registered_total=0
while IFS= read -r bin; do
  name=$(basename "$bin")
  if ! printf '%s\n' "$all" | grep -q "^$name:"; then
    # Registered as one CTest entry (no per-case discovery): the whole executable runs.
    continue
  fi
  cases=$("$bin" --list-test-cases | sed -e '1,2d' -e '/^=====/,$d')
  n_compiled=$(printf '%s' "$cases" | grep -c . || true)
  n_registered=$(printf '%s\n' "$registered" | grep -c "^$name:" || true)
  compiled_total=$((compiled_total + n_compiled))
  registered_total=$((registered_total + n_registered))
  if [ "$n_compiled" != "$n_registered" ]; then
    status=1
    echo "$name: $n_compiled test cases compiled, $n_registered registered with a label; not run:" >&2
    while IFS= read -r c; do
      [ -n "$c" ] || continue
      printf '%s\n' "$registered" | grep -qxF "$name:$c" || echo "    $c" >&2
    done <<<"$cases"
  fi
done < <(find -H "$build/tests" -maxdepth 2 -type f -perm -u+x \
           \( -name 'test_*' -o -name 'reliability_*' -o -name 'gpu_test_*' \) | sort)
echo "test registration: $registered_total of $compiled_total compiled doctest cases registered with a label"
exit $status

#!/usr/bin/env bash
# scripts/gpu-pack.sh — builds here (nvcc compiles without a GPU) what a GPU machine runs, and
# packs it into one xz tar small enough to travel with the tree: libminikv with the CUDA
# backend for every head_dim (a library built for fewer fails the GPU tests' other head_dims
# with UNSUPPORTED), the GPU test binaries, the device fuzz (fuzz_cuda_api, for
# scripts/gpu-sanitize.sh's GPU_SANITIZE_BIN_DIR), minikv-engine without a CPU BLAS (the GPU machine
# has no libopenblas) and the Highway runtime libminikv links (the GPU machine has no apt).
# On the GPU machine, scripts/gpu-packed-tests.sh unpacks it and runs the tests. Building
# from scratch takes ~10 minutes on two cores; the tar is ~25 MB, ~50 MB with the storage test.
#
#   scripts/gpu-pack.sh
#
# Environment (all optional):
#   MINIKV_BUILD_DIR   build directory                  (build-gpu-pack in the repository)
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES (90a)
#   MINIKV_JOBS        parallel build jobs              (nproc)
#   PACK               the tar written                  (.pack/gpu.tar.xz; .pack/ is ignored by git)
#   PACK_STORAGE_TEST  1: also gpu_test_cuda_storage, which links the kernels in (0)
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_arguments "$@"

build=${MINIKV_BUILD_DIR:-$MINIKV_ROOT/build-gpu-pack}
pack=${PACK:-$MINIKV_ROOT/.pack/gpu.tar.xz}
# In the order gpu-packed-tests.sh runs them: decode_matrix, the longest (minutes), last.
tests=(prefill_chunk backend append_decode fast_decode determinism reliability decode_matrix)
[ "${PACK_STORAGE_TEST:-0}" = 1 ] && tests=(storage "${tests[@]}")
export PATH=$PATH:/usr/local/cuda/bin

step "configure and build ($build)"
configure "$build" -DMINIKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${MINIKV_CUDA_ARCHITECTURES:-90a}" \
  -DMINIKV_TESTS=ON -DMINIKV_EXAMPLES=ON -DCMAKE_DISABLE_FIND_PACKAGE_BLAS=ON >/dev/null
ninja -C "$build" -j "${MINIKV_JOBS:-$(nproc)}" minikv minikv-engine fuzz_cuda_api "${tests[@]/#/gpu_test_cuda_}"

step "pack ($pack)"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/packed/lib" "$stage/packed/tests"
cp -P "$build"/libminikv.so* "$stage/packed/lib/"
cp "$build/examples/engine/minikv-engine" "$stage/packed/"
for t in "${tests[@]}"; do cp "$build/tests/gpu_test_cuda_$t" "$stage/packed/tests/"; done
cp "$build/tests/fuzz_cuda_api" "$stage/packed/tests/"  # for scripts/gpu-sanitize.sh
# The Highway libraries libminikv resolves here, under their SONAMEs.
ldd "$build/libminikv.so" | awk '/libhwy/ {print $1, $3}' | while read -r soname path; do
  cp -L "$path" "$stage/packed/lib/$soname"
done
{
  echo "commit $(git -C "$MINIKV_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$MINIKV_ROOT" diff --quiet HEAD -- kernels src include tests 2>/dev/null || echo ' (+ local changes)')"
  echo "archs ${MINIKV_CUDA_ARCHITECTURES:-90a}"
  echo "tests ${tests[*]}"
} >"$stage/packed/PACKED"
mkdir -p "$(dirname "$pack")"
tar cf - -C "$stage" packed | xz -6 -T"${MINIKV_JOBS:-$(nproc)}" >"$pack.tmp"
mv "$pack.tmp" "$pack"
note "$(du -h "$pack" | cut -f1) in $pack ($(tr '\n' ';' <"$stage/packed/PACKED"))"
note "on the GPU machine: scripts/gpu-packed-tests.sh (run with carry [\"${pack#"$MINIKV_ROOT"/}\"])"

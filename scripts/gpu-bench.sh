#!/usr/bin/env bash
# scripts/gpu-bench.sh — the GPU benchmark in one go: builds libminikv with the CUDA backend
# (only the library) unless MINIKV_LIBRARY names a built one, then runs bench/bench_gpu.py
# (needs torch with CUDA) and writes bench-<date>.json and bench.log to $OUT.
# docs/performance.md shows the results and how to read them.
#
#   scripts/gpu-bench.sh [bench_gpu.py args...]      e.g. --dtype bf16, --quick
# Environment (all optional):
#   MINIKV_BUILD_DIR   build directory                 (build-gpu-bench in the repository)
#   MINIKV_LIBRARY     a built libminikv.so: no build
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES (90a)
#   MINIKV_JOBS        parallel build jobs             (nproc)
#   OUT                results and logs                (<build>/bench)
#   MINIKV_COMMIT      commit label when .git is absent
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_positional_build_dir "$@"
renamed_setting MINIKV_CUDA_ARCHS MINIKV_CUDA_ARCHITECTURES

build=${MINIKV_BUILD_DIR:-$MINIKV_ROOT/build-gpu-bench}
out=${OUT:-$build/bench}
mkdir -p "$out"
export PATH=$PATH:/usr/local/cuda/bin
if [ -z "${MINIKV_LIBRARY:-}" ]; then
  configure "$build" -DMINIKV_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${MINIKV_CUDA_ARCHITECTURES:-90a}" -DMINIKV_TESTS=OFF \
    -DMINIKV_EXAMPLES=OFF >"$out/bench-build.log" 2>&1
  ninja -C "$build" -j "${MINIKV_JOBS:-$(nproc)}" minikv >>"$out/bench-build.log" 2>&1 ||
    { tail -30 "$out/bench-build.log"; exit 1; }
  export MINIKV_LIBRARY=$build/libminikv.so
fi
export MINIKV_COMMIT=${MINIKV_COMMIT:-$(git -C "$MINIKV_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp=$(date -u +%Y%m%d-%H%M%S)
PYTHONUNBUFFERED=1 python3 "$MINIKV_ROOT/bench/bench_gpu.py" --out "$out/bench-$stamp.json" "$@" 2>&1 |
  tee "$out/bench.log"

#!/usr/bin/env bash
# GPU benchmark in one go (issue 4): builds libminikv with the CUDA backend (only the library,
# sm_90a by default) unless MINIKV_LIBRARY points at a built one, then runs
# bench/bench_gpu.py (needs torch with CUDA) and writes bench-<date>.json + bench.log to $OUT.
#
#   scripts/gpu-bench.sh [build-dir] [bench_gpu.py args...]   (default build-gpu-bench)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build-gpu-bench}
shift || true
out=${OUT:-$build/bench}
mkdir -p "$out"
export PATH=$PATH:/usr/local/cuda/bin
if [ -z "${MINIKV_LIBRARY:-}" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMINIKV_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${MINIKV_CUDA_ARCHS:-90a}" -DMINIKV_TESTS=OFF -DMINIKV_EXAMPLES=OFF \
    >"$out/bench-build.log" 2>&1
  ninja -C "$build" -j "${JOBS:-$(nproc)}" minikv >>"$out/bench-build.log" 2>&1 || { tail -30 "$out/bench-build.log"; exit 1; }
  export MINIKV_LIBRARY=$build/libminikv.so
fi
export MINIKV_COMMIT=${MINIKV_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp=$(date -u +%Y%m%d-%H%M%S)
PYTHONUNBUFFERED=1 python3 "$root/bench/bench_gpu.py" --out "$out/bench-$stamp.json" "$@" 2>&1 | tee "$out/bench.log"

#!/usr/bin/env bash
# scripts/demo.sh — the quick start: installs what is missing, builds libminikv and its C
# demo (tools/minikv_demo.c), and runs the demo: a synthetic LLaMA-shaped workload through a
# MiniKV cache and a keep-everything reference cache (docs/demo.md explains the output).
# Arguments go to the demo; `--help` prints this and, once the demo is built, its flags.
#
# Environment (all optional):
#   MINIKV_BUILD_DIR  build directory          (build-demo in the repository)
#   MINIKV_CUDA       AUTO | ON | OFF          (AUTO: ON when nvcc is found and a GPU is visible;
#                                               the demo then runs on the GPU)
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES of a CUDA build
#   MINIKV_BUILD_TYPE CMake build type         (Release)
#   MINIKV_JOBS       parallel build jobs      (nproc)
# Works on a fresh Debian 12 as root or as a user with sudo; safe to run again.
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$MINIKV_ROOT"

BUILD=${MINIKV_BUILD_DIR:-$MINIKV_ROOT/build-demo}
JOBS=${MINIKV_JOBS:-$(nproc)}
DEMO="$BUILD/tools/minikv_demo"

if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
  script_header "${BASH_SOURCE[0]}"
  if [ -x "$DEMO" ]; then
    printf '\nThe demo'"'"'s flags (%s --help):\n' "$DEMO"
    "$DEMO" --help
  else
    printf '\nThe demo'"'"'s flags: run scripts/demo.sh once to build it, then --help again.\n'
  fi
  exit 0
fi

step "dependencies"
install_packages build-essential cmake ninja-build pkg-config libhwy-dev

step "configure ($BUILD)"
choose_cuda "${MINIKV_CUDA:-AUTO}" run
configure "$BUILD" -DMINIKV_TESTS=OFF -DMINIKV_EXAMPLES=ON "${CUDA_ARGS[@]}"

step "build"
cmake --build "$BUILD" -j "$JOBS" --target minikv_demo

args=("$@")
if [ "$CUDA_STATE" = ON ]; then
  # Run on the GPU unless the caller chose a backend.
  case " $* " in *" --backend"*) ;; *) args=(--backend auto "${args[@]}") ;; esac
fi
step "run: minikv_demo ${args[*]}"
exec "$DEMO" "${args[@]}"

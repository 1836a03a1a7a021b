#!/usr/bin/env bash
# bench/ncu.sh — Nsight Compute profiles of the hot kernels, on the GPU machine: decode fast
# path at B=8 L=32K (GQA-4 and MHA), the generic decode kernel (4-bit keys, 2-bit values,
# G=32; MHA and GQA-8) and the prefill forward + score kernels (mma.sync, or wgmma on sm_90a)
# at L=32K MHA, fp16. Builds the library unless MINIKV_LIBRARY names one; writes <name>.txt
# (the details page, then the warp-stall breakdown per issued instruction) to $OUT/ncu, and
# <name>.ncu-rep when NCU_KEEP_REPORTS=1.
#
#   bench/ncu.sh [name...]   names: decode-gqa4 decode-mha generic-mha generic-gqa8
#                            mma-gqa4 mma-gqa8 k4v2-gqa4 k4v2-gqa7 prefill-mha (default: all)
# Environment (all optional):
#   MINIKV_BUILD_DIR   build directory                 (build-ncu in the repository)
#   MINIKV_LIBRARY     a built libminikv.so: no build
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES (90a)
#   MINIKV_JOBS        parallel build jobs             (nproc)
#   OUT                where ncu/ goes                 (the build directory)
#   NCU_KEEP_REPORTS   1 keeps the .ncu-rep files
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
help_if_asked "$@"
no_positional_build_dir "$@"
renamed_setting MINIKV_CUDA_ARCHS MINIKV_CUDA_ARCHITECTURES
names="decode-gqa4 decode-mha generic-mha generic-gqa8 mma-gqa4 mma-gqa8 k4v2-gqa4 k4v2-gqa7 prefill-mha"
for n in "$@"; do
  [[ " $names " == *" $n "* ]] || die "unknown profile '$n' (one of: $names)"
done
root=$MINIKV_ROOT
build=${MINIKV_BUILD_DIR:-$root/build-ncu}
out=${OUT:-$build}/ncu
mkdir -p "$out"
export PATH=$PATH:/usr/local/cuda/bin
if [ -z "${MINIKV_LIBRARY:-}" ]; then
  { cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMINIKV_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${MINIKV_CUDA_ARCHITECTURES:-90a}" -DMINIKV_TESTS=OFF \
      -DMINIKV_EXAMPLES=OFF &&
    ninja -C "$build" -j "${MINIKV_JOBS:-$(nproc)}" minikv; } >"$out/build.log" 2>&1 ||
    { tail -30 "$out/build.log"; exit 1; }
  export MINIKV_LIBRARY=$build/libminikv.so
fi
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
drv="python3 $root/bench/ncu_driver.py"
wanted=" ${*:-$names} "
profile() {  # profile <name> <kernel regex> <launches to skip> <count> <driver args...>
  local name=$1 regex=$2 skip=$3 count=$4
  shift 4
  [[ $wanted == *" $name "* ]] || return 0
  "$ncu" --set full --import-source no -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    -f -o "$out/$name" $drv "$@" >"$out/$name.log" 2>&1
  "$ncu" --import "$out/$name.ncu-rep" --page details >"$out/$name.txt" 2>&1
  { echo "== warp stall reasons (cycles per issued instruction)"
    "$ncu" --import "$out/$name.ncu-rep" --page raw 2>&1 |
      grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio|smsp__inst_executed.sum |sm__pipe_tensor_op_hmma_cycles_active.avg.pct|sm__inst_executed_pipe_[a-z_]+.avg.pct" |
      awk '$NF+0 > 0.005'; } >>"$out/$name.txt"
  [ "${NCU_KEEP_REPORTS:-0}" = 1 ] || rm -f "$out/$name.ncu-rep"
  echo "$name: $(grep -c 'Duration' "$out/$name.txt") kernels profiled"
}
profile decode-gqa4 decode_fast_kernel 1 1 decode --B 8 --H 32 --Hkv 8
profile decode-mha decode_fast_kernel 1 1 decode --B 8 --H 32 --Hkv 32
profile generic-mha decode_generic_kernel 1 1 decode --B 8 --H 32 --Hkv 32 --mode window --key-bits 4 --group 32
profile generic-gqa8 decode_generic_kernel 1 1 decode --B 8 --H 64 --Hkv 8 --mode window --key-bits 4 --group 32
MINIKV_DECODE_KERNEL=mma profile mma-gqa4 decode_mma_kernel 1 1 decode --B 8 --H 32 --Hkv 8 --mode window --key-bits 4 --group 32
MINIKV_DECODE_KERNEL=mma profile mma-gqa8 decode_mma_kernel 1 1 decode --B 8 --H 64 --Hkv 8 --mode window --key-bits 4 --group 32
profile k4v2-gqa4 decode_k4v2_kernel 1 1 decode --B 8 --H 32 --Hkv 8 --mode window --key-bits 4 --group 32
profile k4v2-gqa7 decode_k4v2_kernel 1 1 decode --B 8 --H 28 --Hkv 4 --mode window --key-bits 4 --group 32
profile prefill-mha 'prefill_(attention|scores|wgmma|scores_wgmma)_kernel' 2 2 prefill --H 32 --Hkv 32 --reps 2

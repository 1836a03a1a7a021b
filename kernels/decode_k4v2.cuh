// What the default storage's two decode kernels share (decode_k4v2.cu: four-warp CTAs of 4
// or 8 head slots; decode_k4v2_warp.cu: one-warp CTAs of 1, 2 or 4): their launch arguments,
// the block of a quantized tile, and the loads of key rows and value scales.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_check.h"
#include "decode_k4v2_plan.h"
#include "decode_tiles.cuh"
#include "params.h"

namespace minikv {
namespace kernels {

struct K4V2Args {
  DecodeParams p;
  K4V2Tiles tiles;
  FastDivU32 block_tokens;  // R
};
static_assert(sizeof(K4V2Args) <= 4096, "kernel parameters exceed 4 KB");

[[maybe_unused]] __device__ __forceinline__ uint32_t lds32(const uint8_t *p) { return *reinterpret_cast<const uint32_t *>(p); }
[[maybe_unused]] __device__ __forceinline__ void sts32(uint8_t *p, uint32_t v) { *reinterpret_cast<uint32_t *>(p) = v; }

// The block of a quantized tile (nullptr for a 16-bit tile or past the split): a global load
// of the block table, issued a tile before the copies that need it.
[[maybe_unused]] __device__ __forceinline__ const uint8_t *k4v2_block_of(const K4V2Args &a, const TileRef &tr,
                                                        const int32_t *table) {
  if (tr.segment != kSegQuantized) return nullptr;
  const BlockLayout &bl = a.p.st.block;
  return a.p.st.pool + uint64_t(table[a.block_tokens.div(tr.first)]) * bl.bytes;
}

// Host: raises `kernel`'s dynamic shared-memory limit to `smem`, asks for the largest shared
// memory carveout (the CTAs per SM are counted in shared memory; these kernels stage through
// it, not L1), and returns its resident CTAs of `threads` per SM, or 0 where this device has
// not loaded an sm_90 image of it.
template <typename Kernel> uint32_t configure_sm90_kernel(Kernel kernel, uint32_t threads, uint32_t smem) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || attr.binaryVersion < 90) {
    (void)cudaGetLastError();  // a failed attribute query leaves no sticky error
    return 0;
  }
  MINIKV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  MINIKV_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  int blocks = 0;
  MINIKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, static_cast<int>(threads), smem));
  return static_cast<uint32_t>(blocks > 0 ? blocks : 1);
}

// A lane's quarter of a token's KB-bit key row: D · KB / 32 bytes at p (aligned to their
// size), as D · KB / 128 words.
template <int D, int KB = 4>
__device__ __forceinline__ void load_key_quarter(const uint8_t *p, uint32_t (&w)[D * KB / 128]) {
  constexpr int N = D * KB / 128;
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int v = 0; v < N / 4; ++v) {
      const uint4 u = reinterpret_cast<const uint4 *>(p)[v];
      w[4 * v] = u.x; w[4 * v + 1] = u.y; w[4 * v + 2] = u.z; w[4 * v + 3] = u.w;
    }
  } else if constexpr (N == 2) {
    const uint2 u = *reinterpret_cast<const uint2 *>(p);
    w[0] = u.x; w[1] = u.y;
  } else {
    static_assert(N == 1, "a quarter row of 4, 8 or a multiple of 16 bytes");
    w[0] = *reinterpret_cast<const uint32_t *>(p);
  }
}

// A token's VG value scales (at vs) and minima (at vm), 16-bit, as VG / 2 words each.
template <int VG>
__device__ __forceinline__ void load_value_scales(const uint8_t *vs, const uint8_t *vm, uint32_t (&s)[(VG + 1) / 2],
                                                  uint32_t (&m)[(VG + 1) / 2]) {
  if constexpr (VG == 8) {
    const uint4 s8 = *reinterpret_cast<const uint4 *>(vs), m8 = *reinterpret_cast<const uint4 *>(vm);
    s[0] = s8.x; s[1] = s8.y; s[2] = s8.z; s[3] = s8.w;
    m[0] = m8.x; m[1] = m8.y; m[2] = m8.z; m[3] = m8.w;
  } else if constexpr (VG == 4) {
    const uint2 s4 = *reinterpret_cast<const uint2 *>(vs), m4 = *reinterpret_cast<const uint2 *>(vm);
    s[0] = s4.x; s[1] = s4.y;
    m[0] = m4.x; m[1] = m4.y;
  } else if constexpr (VG == 2) {
    s[0] = lds32(vs);
    m[0] = lds32(vm);
  } else {
    static_assert(VG == 1, "1, 2, 4 or 8 value groups");
    s[0] = *reinterpret_cast<const uint16_t *>(vs);
    m[0] = *reinterpret_cast<const uint16_t *>(vm);
  }
}

}  // namespace kernels
}  // namespace minikv

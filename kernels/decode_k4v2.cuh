// What the default storage's two decode kernels share (decode_k4v2.cu: four-warp CTAs for
// GQA groups; decode_k4v2_mha.cu: one-warp CTAs for MHA): their launch arguments and the
// block of a quantized tile.
#pragma once

#include <cstdint>

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

}  // namespace kernels
}  // namespace minikv

// Shared-memory plan of the tensor-core GQA decode kernel (decode_mma.cu): tile sizes, the
// pipeline depth and where each region lives. Computed from the storage layout alone,
// identically on the host (dynamic shared memory, occupancy, split count) and in the kernel.
#pragma once

#include <cstdint>

#include "decode_generic_plan.h"  // generic_row_stride, layout_quantized_stage, ...

namespace minikv {
namespace kernels {

constexpr uint32_t kMmaWarps = 4;            // warps of one CTA; each takes a quarter of a tile
constexpr uint32_t kMmaThreads = 32 * kMmaWarps;
constexpr uint32_t kMmaMaxTile = 128;        // tokens per tile, at most
constexpr uint32_t kMmaWarpTokens = kMmaMaxTile / kMmaWarps;  // a warp's tokens of a tile, at most
constexpr uint32_t kMmaQuantStageBudget = 20480;  // bytes a 128-token quantized stage may take
constexpr uint32_t kMmaRowStageBudget = 18432;    // bytes a 16-bit-row stage may take (or the quantized one's)
constexpr uint32_t kMmaMaxHeads = 8;         // query heads of one CTA: the mma's 8 live rows
constexpr uint32_t kMmaMaxGroups = 8;        // value groups per token (D / G), at most

// x / d for a divisor fixed at launch (x, d < 2^31) by a multiply-high: Granlund and
// Montgomery's round-up method, l = ceil(log2 d), mul = floor(2^32 (2^l − d) / d) + 1.
struct FastDivU32 {
  uint32_t d, mul, shift;
  static FastDivU32 make(uint32_t d) {
    uint32_t l = 0;
    while ((1ull << l) < d) ++l;
    return {d, static_cast<uint32_t>((1ull << 32) * ((1ull << l) - d) / d + 1), l};
  }
  MINIKV_HD uint32_t div(uint32_t x) const {
    return (static_cast<uint32_t>((uint64_t(x) * mul) >> 32) + x) >> shift;
  }
};

struct MmaDecodePlan {
  uint32_t qtile;     // tokens per tile of quantized storage: divides R, 16..128
  uint32_t ptile;     // tokens per tile of 16-bit rows (sinks, residual): 16..64
  uint32_t stages;    // pipeline depth: 3, or 2 where a stage is large
  uint32_t k_stride;  // staged bytes per quantized-storage key row (codes or values)
  uint32_t v_stride;
  uint32_t p_stride;  // staged bytes per 16-bit row
  // Offsets inside one stage, quantized tile (key rows at 0):
  uint32_t q_vcodes, q_kscale, q_kmin, q_vscale, q_vmin;
  uint32_t p_v;       // 16-bit tile: K rows at 0, V rows here
  uint32_t stage_bytes;
  // After the stages:
  uint32_t sv;     // [warp][kMmaMaxGroups][kMmaWarpTokens] fp32 value scales of the warp's tokens
  uint32_t mv;     // [warp][kMmaMaxGroups][kMmaWarpTokens] dtype value minima of the warp's tokens
  uint32_t qp, q2;  // [D / 8][32 lanes] 32-bit query operands (natural pairs, key-pair order)
  uint32_t xs;      // [warp][D / 16][32 lanes] uint4: the warp's q ⊙ s_k operand pieces
  // At the end, over the stages (drained by then): the warps' partial results.
  uint32_t merge_o;   // [warp][kMmaMaxHeads][D] fp32 unnormalized outputs
  uint32_t merge_ml;  // [warp][kMmaMaxHeads][2] fp32 running max and sum
  uint32_t total;  // dynamic shared memory of one CTA
};

MINIKV_HD MmaDecodePlan make_mma_decode_plan(const BlockLayout &bl) {
  MmaDecodePlan g{};
  const uint32_t D = bl.head_dim, e = bl.elem_bytes;
  g.k_stride = generic_row_stride(bl.k_row_bytes);
  g.v_stride = generic_row_stride(bl.v_row_bytes);
  g.p_stride = generic_row_stride(uint64_t(D) * e);
  // Quantized tiles of 128 tokens (32 per warp) where they fit the budget, else 64 (16 per
  // warp, every warp busy); smaller only where R is.
  uint32_t qtile = generic_pow2_divisor(bl.tokens, kMmaMaxTile);
  while (qtile > 64 && layout_quantized_stage(bl, qtile, g) > kMmaQuantStageBudget) qtile /= 2;
  g.qtile = qtile;
  const uint32_t qbytes = layout_quantized_stage(bl, qtile, g);
  // 16-bit tiles (a few per sequence next to the quantized ones) no larger than a quantized stage.
  const uint32_t row_budget = qbytes > kMmaRowStageBudget ? qbytes : kMmaRowStageBudget;
  uint32_t ptile = 64;
  while (ptile > 16 && 2ull * ptile * g.p_stride > row_budget) ptile /= 2;
  g.ptile = ptile;
  g.p_v = generic_align16(uint64_t(ptile) * g.p_stride);
  const uint32_t pbytes = generic_align16(uint64_t(g.p_v) + uint64_t(ptile) * g.p_stride);
  g.stage_bytes = qbytes > pbytes ? qbytes : pbytes;
  // Three stages where they are small; two large ones already keep ~20 KB per CTA in flight
  // and leave room for four CTAs per SM.
  g.stages = g.stage_bytes <= 14336 ? 3 : 2;
  uint32_t off = g.stages * g.stage_bytes;
  g.merge_o = 0;
  g.merge_ml = generic_align16(uint64_t(kMmaWarps) * kMmaMaxHeads * D * 4);
  const uint32_t merge_end = generic_align16(uint64_t(g.merge_ml) + kMmaWarps * kMmaMaxHeads * 2 * 4);
  if (off < merge_end) off = merge_end;
  g.sv = off;
  off = generic_align16(off + uint64_t(kMmaWarps) * kMmaMaxGroups * kMmaWarpTokens * 4);
  g.mv = off;
  off = generic_align16(off + uint64_t(kMmaWarps) * kMmaMaxGroups * kMmaWarpTokens * e);
  g.qp = off;
  off = generic_align16(off + uint64_t(D / 8) * 32 * 4);
  g.q2 = off;
  off = generic_align16(off + uint64_t(D / 8) * 32 * 4);
  g.xs = off;
  off = generic_align16(off + uint64_t(kMmaWarps) * (D / 16) * 32 * 16);
  g.total = off;
  return g;
}

// What a launch needs beyond its DecodeParams, made once at minikv_cache_create (the plan
// and R's divisor depend on the storage layout alone).
struct MmaLaunchPlan {
  MmaDecodePlan g;
  FastDivU32 block_tokens;  // R
};
inline MmaLaunchPlan make_mma_launch_plan(const BlockLayout &bl) {
  return {make_mma_decode_plan(bl), FastDivU32::make(bl.tokens)};
}

}  // namespace kernels
}  // namespace minikv

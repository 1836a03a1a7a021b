// Shared-memory plan of the tensor-core GQA decode kernel (decode_mma.cu): tile sizes and
// where each staged region lives. Computed from the storage layout alone, identically on
// the host (dynamic shared memory, occupancy) and in the kernel.
#pragma once

#include <cstdint>

#include "decode_generic_plan.h"  // generic_row_stride, layout_quantized_stage, ...

namespace minikv {
namespace kernels {

constexpr uint32_t kMmaMaxTile = 64;         // tokens per tile, at most (eight n-tiles of 8)
constexpr uint32_t kMmaStageBudget = 12288;  // bytes one pipeline stage may take
constexpr uint32_t kMmaMaxHeads = 8;         // query heads of one CTA: the mma's 8 live rows
constexpr uint32_t kMmaMaxGroups = 8;        // value groups per token (D / G), at most

struct MmaDecodePlan {
  uint32_t qtile;     // tokens per tile of quantized storage: divides R, 16..64
  uint32_t ptile;     // tokens per tile of 16-bit rows (sinks, residual): 16..64
  uint32_t k_stride;  // staged bytes per quantized-storage key row (codes or values)
  uint32_t v_stride;
  uint32_t p_stride;  // staged bytes per 16-bit row
  // Offsets inside one stage, quantized tile (key rows at 0):
  uint32_t q_vcodes, q_kscale, q_kmin, q_vscale, q_vmin;
  uint32_t p_v;       // 16-bit tile: K rows at 0, V rows here
  uint32_t stage_bytes;
  // After the two stages:
  uint32_t sv;     // [kMmaMaxGroups][kMmaMaxTile] fp32 value scales of the tile, by group
  uint32_t mv;     // [kMmaMaxGroups][kMmaMaxTile] dtype value minima of the tile, by group
  uint32_t qp, q2;  // [D / 8][32 lanes] 32-bit query operands (natural pairs, key-pair order)
  uint32_t total;  // dynamic shared memory of one CTA
};

MINIKV_HD MmaDecodePlan make_mma_decode_plan(const BlockLayout &bl) {
  MmaDecodePlan g{};
  const uint32_t D = bl.head_dim, e = bl.elem_bytes;
  g.k_stride = generic_row_stride(bl.k_row_bytes);
  g.v_stride = generic_row_stride(bl.v_row_bytes);
  g.p_stride = generic_row_stride(uint64_t(D) * e);
  uint32_t qtile = generic_pow2_divisor(bl.tokens, kMmaMaxTile);
  while (qtile > 16 && layout_quantized_stage(bl, qtile, g) > kMmaStageBudget) qtile /= 2;
  g.qtile = qtile;
  const uint32_t qbytes = layout_quantized_stage(bl, qtile, g);
  uint32_t ptile = kMmaMaxTile;
  while (ptile > 16 && 2ull * ptile * g.p_stride > kMmaStageBudget) ptile /= 2;
  g.ptile = ptile;
  g.p_v = generic_align16(uint64_t(ptile) * g.p_stride);
  const uint32_t pbytes = generic_align16(uint64_t(g.p_v) + uint64_t(ptile) * g.p_stride);
  g.stage_bytes = qbytes > pbytes ? qbytes : pbytes;
  uint32_t off = 2 * g.stage_bytes;
  g.sv = off;
  off = generic_align16(off + uint64_t(kMmaMaxGroups) * kMmaMaxTile * 4);
  g.mv = off;
  off = generic_align16(off + uint64_t(kMmaMaxGroups) * kMmaMaxTile * e);
  g.qp = off;
  off = generic_align16(off + uint64_t(D / 8) * 32 * 4);
  g.q2 = off;
  off = generic_align16(off + uint64_t(D / 8) * 32 * 4);
  g.total = off;
  return g;
}

}  // namespace kernels
}  // namespace minikv

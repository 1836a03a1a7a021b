// Shared-memory plan of the generic decode kernel (decode_generic.cuh): how many tokens one
// tile stages and where each staged region lives. Computed from the storage layout alone,
// identically on the host (dynamic shared-memory size, occupancy) and in the kernel.
#pragma once

#include <cstdint>

#include "../src/layout.h"

namespace minikv {
namespace kernels {

constexpr uint32_t kGenericThreads = 128;       // one CTA: four warps
constexpr uint32_t kGenericMaxTile = 64;        // tokens per tile, at most
constexpr uint32_t kGenericStageBudget = 24576; // bytes one pipeline stage may take
constexpr uint32_t kGenericMaxHeads = 8;        // query heads of one CTA (NR)
constexpr uint32_t kGenericWarps = kGenericThreads / 32;
constexpr uint32_t kGenericWarpTokens = kGenericMaxTile / kGenericWarps;  // a warp's tokens, at most

// Staged rows get an odd number of 16-byte units: eight consecutive rows read at the same
// unit index then fall in eight distinct bank groups (conflict-free 16-byte loads). Code
// rows that are not a multiple of 16 bytes (2-bit head_dim 80 and 96: 20 and 24 bytes;
// 4-bit head_dim 80: 40) stay packed, a tile staged as one contiguous copy: an odd number
// of words (20 B) or of 8-byte units (24 B, 40 B) per row spreads eight consecutive rows
// over distinct banks for the 4- or 8-byte loads that read them. Such rows exist only where
// head_dim is not a multiple of 64 (2-bit rows are head_dim / 4 bytes): a kernel instance
// for another head_dim passes kMayPack = false and keeps the test out of its code.
MINIKV_HD constexpr bool generic_may_pack(uint32_t head_dim) { return head_dim % 64 != 0; }
template <bool kMayPack = true> MINIKV_HD uint32_t generic_row_stride(uint64_t row_bytes) {
  if (kMayPack && row_bytes % 16 != 0) return static_cast<uint32_t>(row_bytes);
  const uint32_t units = static_cast<uint32_t>((row_bytes + 15) / 16);
  return (units | 1u) * 16u;
}

struct GenericDecodePlan {
  uint32_t qtile;        // tokens per tile of quantized storage: divides R, 16..64
  uint32_t ptile;        // tokens per tile of 16-bit rows (sinks, residual): 16 or 32
  uint32_t k_stride;     // staged bytes per quantized-storage key row (codes or values)
  uint32_t v_stride;     // same for values
  uint32_t p_stride;     // staged bytes per 16-bit row
  // Offsets inside one stage, quantized tile:
  uint32_t q_vcodes, q_kscale, q_kmin, q_vscale, q_vmin;
  // ... and 16-bit tile: K rows at 0, V rows at p_v.
  uint32_t p_v;
  uint32_t stage_bytes;  // one stage (two are in flight)
  // Offsets after the two stages (each warp owns one slice of the first three):
  uint32_t qs;           // [4 warps][NR][D] fp32: q ⊙ key scale of the warp's key group;
                         // at the end, the warps' unnormalized outputs
  uint32_t probs;        // [4 warps][NR][kGenericWarpTokens] fp32 probabilities
  uint32_t ml;           // [4 warps][2][NR] fp32 running max and sum, at the end
  uint32_t q;            // [NR][D] fp32 query rows
  uint32_t total;        // dynamic shared memory of one CTA
};

MINIKV_HD uint32_t generic_align16(uint64_t x) { return static_cast<uint32_t>((x + 15) / 16 * 16); }

// Largest power of two <= cap that divides n (n a multiple of 16 here).
MINIKV_HD uint32_t generic_pow2_divisor(uint32_t n, uint32_t cap) {
  uint32_t t = cap;
  while (t > 16 && n % t != 0) t /= 2;
  return t;
}

// Layout of a quantized tile of t tokens inside one stage: key rows at 0 (out.k_stride
// apart), then value rows (out.v_stride apart), key scales and minima of its groups, value
// scales and minima of its tokens; writes out.q_* and returns the stage bytes. Shared by the
// generic and the tensor-core decode plans.
template <typename Plan>
MINIKV_HD uint32_t layout_quantized_stage(const BlockLayout &bl, uint32_t t, Plan &out) {
  const uint32_t D = bl.head_dim, e = bl.elem_bytes, G = bl.group;
  const uint32_t groups = bl.key_bits == 16 ? 0 : (t >= G ? t / G : 1);
  uint32_t off = generic_align16(uint64_t(t) * out.k_stride);
  out.q_vcodes = off;
  off = generic_align16(off + uint64_t(t) * out.v_stride);
  out.q_kscale = off;
  off = generic_align16(off + uint64_t(groups) * D * e);
  out.q_kmin = off;
  off = generic_align16(off + uint64_t(groups) * D * e);
  const uint32_t vgroups = bl.value_bits == 16 ? 0 : D / G;
  out.q_vscale = off;
  off = generic_align16(off + uint64_t(t) * vgroups * e);
  out.q_vmin = off;
  off = generic_align16(off + uint64_t(t) * vgroups * e);
  return off;
}

template <bool kMayPack = true>
MINIKV_HD GenericDecodePlan make_generic_decode_plan(const BlockLayout &bl, uint32_t nr) {
  GenericDecodePlan g{};
  const uint32_t D = bl.head_dim, e = bl.elem_bytes;
  g.k_stride = generic_row_stride<kMayPack>(bl.k_row_bytes);
  g.v_stride = generic_row_stride<kMayPack>(bl.v_row_bytes);
  g.p_stride = generic_row_stride(uint64_t(D) * e);

  // Quantized tile: the largest power of two dividing R whose staged rows fit the budget.
  uint32_t qtile = generic_pow2_divisor(bl.tokens, kGenericMaxTile);
  while (qtile > 16 && layout_quantized_stage(bl, qtile, g) > kGenericStageBudget) qtile /= 2;
  g.qtile = qtile;
  const uint32_t qbytes = layout_quantized_stage(bl, qtile, g);

  g.ptile = 2 * 32 * g.p_stride <= kGenericStageBudget ? 32 : 16;
  g.p_v = generic_align16(uint64_t(g.ptile) * g.p_stride);
  const uint32_t pbytes = generic_align16(uint64_t(g.p_v) + uint64_t(g.ptile) * g.p_stride);
  g.stage_bytes = qbytes > pbytes ? qbytes : pbytes;

  uint32_t off = 2 * g.stage_bytes;
  g.qs = off;
  off = generic_align16(off + uint64_t(kGenericWarps) * nr * D * 4);
  g.probs = off;
  off = generic_align16(off + uint64_t(kGenericWarps) * nr * kGenericWarpTokens * 4);
  g.ml = off;
  off = generic_align16(off + uint64_t(kGenericWarps) * 2 * nr * 4);
  g.q = off;
  off = generic_align16(off + uint64_t(nr) * D * 4);
  g.total = off;
  return g;
}

}  // namespace kernels
}  // namespace minikv

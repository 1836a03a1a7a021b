// Shared-memory layout of the default storage's decode kernel (decode_k4v2.cu: 4-bit keys,
// 2-bit values, G = 32): compile-time for each (dtype size, head_dim, head slots), so no
// address in the kernel is computed from a run-time stride. Stages are sized for the largest
// tile; a shorter tile fills the start of each region.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda_shapes.h"      // K4V2WarpHeadDims
#include "decode_mma_plan.h"  // FastDivU32, generic_pow2_divisor

namespace minikv {
namespace kernels {

constexpr uint32_t kK4V2Warps = 4;
constexpr uint32_t kK4V2Threads = 32 * kK4V2Warps;
constexpr uint32_t kK4V2Group = 32;     // G: the storage this kernel decodes
constexpr uint32_t kK4V2MaxTile = 128;  // quantized tokens per tile, at most (4 key groups)
// The one-warp kernel's tiles (decode_k4v2_warp.cu) of KB-bit keys, VB-bit values and group
// G: 64 tokens where 128 tokens' codes and scales would outgrow its 16-bit row stage (more
// than 6 bits of key and value together), so that 10-12 CTAs still share an SM with the same
// bytes in flight (one stage and twelve CTAs measured faster than two stages and six for the
// default storage); a whole key group at least.
constexpr uint32_t k4v2_max_tile(uint32_t key_bits, uint32_t value_bits, uint32_t group = kK4V2Group) {
  const uint32_t t = key_bits + value_bits > 6 ? kK4V2MaxTile / 2 : kK4V2MaxTile;
  return t > group ? t : group;
}
constexpr uint32_t kK4V2RowTile = 30;   // 16-bit rows (sinks, residual) per tile: a stage's worth

// An odd number of 16-byte units: rows read 16 bytes per lane (ldmatrix) without conflicts.
constexpr uint32_t k4v2_odd_stride(uint32_t bytes) { return ((bytes + 15) / 16 | 1u) * 16; }
constexpr uint32_t k4v2_align(uint32_t x, uint32_t a) { return (x + a - 1) / a * a; }

template <uint32_t E, uint32_t D, uint32_t kH> struct K4V2Layout {
  static constexpr uint32_t kGroupsMax = kK4V2MaxTile / kK4V2Group;
  static constexpr uint32_t kVG = D / kK4V2Group;  // value groups per token
  // Quantized stage: the tile's rows as the block stores them (one bulk copy per region).
  static constexpr uint32_t kKCodes = 0;
  static constexpr uint32_t kVCodes = kKCodes + kK4V2MaxTile * D / 2;
  static constexpr uint32_t kKScale = kVCodes + kK4V2MaxTile * D / 4;
  static constexpr uint32_t kKMin = kKScale + kGroupsMax * D * E;
  static constexpr uint32_t kVScale = kKMin + kGroupsMax * D * E;
  static constexpr uint32_t kVMin = kVScale + kK4V2MaxTile * kVG * E;
  static constexpr uint32_t kQuantBytes = kVMin + kK4V2MaxTile * kVG * E;
  // 16-bit stage: K rows at 0, V rows at kRowV, kRowStride apart.
  static constexpr uint32_t kRowStride = k4v2_odd_stride(D * E);
  static constexpr uint32_t kRowV = kK4V2RowTile * kRowStride;
  static constexpr uint32_t kRowBytes = 2 * kRowV;
  static constexpr uint32_t kStageBytes = k4v2_align(kQuantBytes > kRowBytes ? kQuantBytes : kRowBytes, 128);
  // Eight head slots double the operand buffers: two stages keep three CTAs per SM.
  static constexpr uint32_t kStages = kH <= 4 ? 3 : 2;
  // The key operand: [2 passes][(group parity, head, hi / lo) rows][D] fp16.
  static constexpr uint32_t kBqkStride = k4v2_odd_stride(D * 2);
  static constexpr uint32_t kBqkPass = 4 * kH * kBqkStride;
  static constexpr uint32_t kBqk = kStages * kStageBytes;
  // P·V's B: [spans, at least 2][(head, value group) rows][tile tokens] fp16.
  static constexpr uint32_t kSpans = D / 64 > 2 ? D / 64 : 2;
  static constexpr uint32_t kBpvStride = k4v2_odd_stride(kK4V2MaxTile * 2);
  static constexpr uint32_t kBpvSpan = 2 * kH * kBpvStride;
  static constexpr uint32_t kBpv = kBqk + 2 * kBqkPass;
  static constexpr uint32_t kQn = kBpv + kSpans * kBpvSpan;           // [kH][D] dtype: queries
  static constexpr uint32_t kUq = k4v2_align(kQn + kH * D * E, 16);   // [kH] fp32 2^(12 − kq)
  static constexpr uint32_t kUs = kUq + kH * 4;                       // [4] fp32 2^(12 − ks)
  static constexpr uint32_t kBiasPart = k4v2_align(kUs + 16, 16);     // [warp][8][8] fp32
  static constexpr uint32_t kRed = kBiasPart + kK4V2Warps * 64 * 4;    // [warp][kH + 1] fp32
  static constexpr uint32_t kFin = k4v2_align(kRed + kK4V2Warps * (kH + 1) * 4, 16);  // [warp][kH][1 + VG]
  static constexpr uint32_t kMbar = k4v2_align(kFin + kK4V2Warps * kH * (1 + kVG) * 4, 16);
  static constexpr uint32_t kTotal = kMbar + kStages * 8;
};

// Three CTAs per SM (the registers are sized for them, __launch_bounds__) need each CTA's
// shared memory within a third of the SM's 228 KB, less the 1 KB the runtime reserves per CTA.
constexpr uint32_t kK4V2SmemPerCta = 228 * 1024 / 3 - 1024;
static_assert(K4V2Layout<2, 128, 4>::kTotal <= kK4V2SmemPerCta && K4V2Layout<2, 128, 8>::kTotal <= kK4V2SmemPerCta &&
                  K4V2Layout<2, 64, 4>::kTotal <= kK4V2SmemPerCta && K4V2Layout<2, 64, 8>::kTotal <= kK4V2SmemPerCta,
              "decode_k4v2's shared memory no longer fits three CTAs per SM");
static_assert(K4V2Layout<2, 128, 4>::kRowBytes <= K4V2Layout<2, 128, 4>::kStageBytes,
              "a 16-bit tile must fit a stage");
// The epilogue's outputs and (max, sum) of 8 head slots, over stage 0.
static_assert(8 * (128 + 2) * 4 <= K4V2Layout<2, 128, 8>::kStageBytes && 8 * (64 + 2) * 4 <= K4V2Layout<2, 64, 8>::kStageBytes,
              "decode_k4v2's epilogue rows must fit a stage");
// Bulk copies and ldmatrix need 16-byte aligned shared addresses; mbarriers 8.
template <uint32_t D> constexpr bool k4v2_aligned() {
  using L = K4V2Layout<2, D, 8>;
  return L::kVCodes % 16 == 0 && L::kKScale % 16 == 0 && L::kKMin % 16 == 0 && L::kVScale % 16 == 0 &&
         L::kVMin % 16 == 0 && L::kRowV % 16 == 0 && L::kStageBytes % 16 == 0 && L::kBqk % 16 == 0 &&
         L::kBpv % 16 == 0 && L::kQn % 16 == 0 && L::kMbar % 8 == 0;
}
static_assert(k4v2_aligned<64>() && k4v2_aligned<128>(), "decode_k4v2's regions must stay 16-byte aligned");

// The tile sizes of a launch (SequenceTiles reads qtile and ptile): quantized tiles of up to
// 128 tokens that divide R, 16-bit tiles of kK4V2RowTile rows.
struct K4V2Tiles {
  uint32_t qtile, ptile;
};

// The instance's query-head slots (kH) for p.heads_per_cta query heads per CTA.
constexpr uint32_t k4v2_head_slots(uint32_t heads_per_cta) { return heads_per_cta <= 4 ? 4 : 8; }

// The storage (key bits, value bits, group) that the one-warp kernel (decode_k4v2_warp.cu) is
// compiled for: at G = 32 the default storage, MINIKV_PRESET_QUALITY's, 2- and 4-bit keys and
// values, and 8-bit keys with 2- or 4-bit values (keys are the sensitive side); at G = 64 and
// 128 (fewer scale bytes) 4-bit keys + 2-bit values and 2-bit both; at G = 16 the paper's
// 2-bit keys and values, and 4-bit both.
constexpr bool k4v2_warp_storage(uint32_t key_bits, uint32_t value_bits, uint32_t group) {
  const bool low = (key_bits == 4 || key_bits == 2) && value_bits == 2;
  if (group == 16) return key_bits == value_bits && (key_bits == 2 || key_bits == 4);
  if (group == 32) return low || (key_bits == 8 && value_bits <= 8) || (key_bits == 4 && value_bits == 4);
  return (group == 64 || group == 128) && low;
}
// Whether the one-warp kernel has an instance for that storage at head_dim D: one of
// K4V2WarpHeadDims split into whole groups, G = 16 up to 128 only (at 256 a token's sixteen
// value groups would outgrow the registers).
constexpr bool k4v2_warp_instance(uint32_t key_bits, uint32_t value_bits, uint32_t group, uint32_t head_dim) {
  return k4v2_warp_storage(key_bits, value_bits, group) && in_list(K4V2WarpHeadDims{}, head_dim) &&
         head_dim % group == 0 && (group > 16 || head_dim <= 128);
}
// Whether the decode plan takes the one-warp kernel for its storage at a GQA group of n_rep
// query heads: groups of up to four, and 4/4 bits at G ≥ 32 at any group (the measurements
// behind it: kernels/cuda_backend.cpp); otherwise the four-warp kernel (default storage) or
// decode_mma.
constexpr bool k4v2_warp_planned(uint32_t key_bits, uint32_t value_bits, uint32_t group, uint32_t n_rep) {
  return n_rep <= 4 || (key_bits == 4 && value_bits == 4 && group >= 32);
}
// Whether the paper's storage (decode_fast_path's) takes the one-warp kernel rather than the
// fast kernel: for groups of two, and of four at head_dim 64 (H100, 32K and 128K, same run:
// 0.85-0.88x the fast kernel's time at 16/8, 0.68x at 32/8 head_dim 64; at 32/8 head_dim 128
// 1.01x at 32K and 1.13x at 128K, under MHA 1.07x at B 1, at 64/8 1.18x).
constexpr bool k4v2_warp_before_fast(uint32_t n_rep, uint32_t head_dim) {
  return n_rep == 2 || (n_rep == 4 && head_dim == 64);
}
// fn(key bits, value bits, group) as integral constants, for one of k4v2_warp_storage's.
template <typename Fn>
void dispatch_k4v2_warp_storage(uint32_t key_bits, uint32_t value_bits, uint32_t group, Fn &&fn) {
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using I8 = std::integral_constant<int, 8>;
  auto bits = [&](auto g) {
    if constexpr (decltype(g)::value == 16) {
      if (key_bits == 2 && value_bits == 2) fn(I2{}, I2{}, g);
      else if (key_bits == 4 && value_bits == 4) fn(I4{}, I4{}, g);
    } else if (key_bits == 4 && value_bits == 2) fn(I4{}, I2{}, g);
    else if (key_bits == 2 && value_bits == 2) fn(I2{}, I2{}, g);
    else if constexpr (decltype(g)::value == 32) {
      if (key_bits == 8 && value_bits == 8) fn(I8{}, I8{}, g);
      else if (key_bits == 4 && value_bits == 4) fn(I4{}, I4{}, g);
      else if (key_bits == 8 && value_bits == 4) fn(I8{}, I4{}, g);
      else if (key_bits == 8 && value_bits == 2) fn(I8{}, I2{}, g);
    }
  };
  if (group == 16) bits(std::integral_constant<int, 16>{});
  else if (group == 32) bits(std::integral_constant<int, 32>{});
  else if (group == 64) bits(std::integral_constant<int, 64>{});
  else if (group == 128) bits(std::integral_constant<int, 128>{});
}

// What a launch needs beyond its DecodeParams, made once at minikv_cache_create.
struct K4V2LaunchPlan {
  K4V2Tiles tiles;
  FastDivU32 block_tokens;  // R
  // The split merge after the one-warp kernel starts as its programmatic dependent: where the
  // driver can also capture that edge into a CUDA graph (12.3 and later).
  bool programmatic_merge;
};
inline K4V2LaunchPlan make_k4v2_launch_plan(const BlockLayout &bl, int driver_version) {
  return {{generic_pow2_divisor(bl.tokens, k4v2_max_tile(bl.key_bits, bl.value_bits, bl.group)), kK4V2RowTile},
          FastDivU32::make(bl.tokens),
          driver_version >= 12030};
}

}  // namespace kernels
}  // namespace minikv

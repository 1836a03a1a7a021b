// Shared-memory plan of the default storage's decode kernel (decode_k4v2.cu: 4-bit keys,
// 2-bit values, G = 32): tile sizes, the pipeline depth and where each region lives.
// Computed from the storage layout and the heads per CTA alone, identically on the host
// (dynamic shared memory, occupancy) and in the kernel.
#pragma once

#include <cstdint>

#include "decode_mma_plan.h"  // FastDivU32, generic_align16, generic_pow2_divisor

namespace minikv {
namespace kernels {

constexpr uint32_t kK4V2Warps = 4;
constexpr uint32_t kK4V2Threads = 32 * kK4V2Warps;
constexpr uint32_t kK4V2Group = 32;        // G: the storage this kernel decodes
constexpr uint32_t kK4V2MaxTile = 128;     // quantized tokens per tile, at most (4 key groups)
constexpr uint32_t kK4V2RowTile = 32;      // 16-bit rows (sinks, residual) per tile
constexpr uint32_t kK4V2Stages = 3;

struct K4V2Plan {
  uint32_t qtile;        // quantized tokens per tile: divides R, 32..128
  uint32_t ptile;        // 16-bit rows per tile
  uint32_t stage_bytes;  // one pipeline stage (either kind of tile)
  // Quantized stage, as the block stores the tile's rows (key codes at 0): contiguous, so
  // each region is one bulk copy.
  uint32_t q_vcodes, q_kscale, q_kmin, q_vscale, q_vmin;
  // 16-bit stage: K rows at 0, V rows at p_v, p_stride apart (an odd number of 16-byte units:
  // conflict-free ldmatrix).
  uint32_t p_stride, p_v;
  // After the stages.
  uint32_t bqk, bqk_stride, bqk_pass;  // [2 passes][2·kH·2 rows][D] fp16: the q ⊙ s_k pieces
  uint32_t bpv, bpv_stride, bpv_span;  // [spans][2·kH rows][qtile] fp16: p · s_v per value group
  uint32_t qn;         // [kH][D] dtype: the CTA's queries
  uint32_t uq;         // [kH] fp32: 2^(12 − kq) per head
  uint32_t us;         // [4] fp32: 2^(12 − ks) per key group of the tile
  uint32_t bias_part;  // [4 warps][8 heads][8] fp32: q · m_k partial sums (head, key group)
  uint32_t red;        // [4 warps][kH + 1] fp32: the warps' tile maxima (logits, value scales)
  uint32_t fin;        // [4 warps][kH][1 + D / 32] fp32: the warps' sums and Σ p · m_v
  uint32_t mbar;       // [stages] mbarriers
  uint32_t total;      // bytes from the 1024-aligned base
  uint32_t launch;     // dynamic shared memory to request (the base may need aligning)
};

MINIKV_HD K4V2Plan make_k4v2_plan(const BlockLayout &bl, uint32_t kH) {
  K4V2Plan g{};
  const uint32_t D = bl.head_dim, e = bl.elem_bytes;
  g.qtile = generic_pow2_divisor(bl.tokens, kK4V2MaxTile);
  g.ptile = kK4V2RowTile;
  const uint32_t groups = g.qtile / kK4V2Group;
  g.q_vcodes = g.qtile * D / 2;
  g.q_kscale = g.q_vcodes + g.qtile * D / 4;
  g.q_kmin = g.q_kscale + groups * D * e;
  g.q_vscale = g.q_kmin + groups * D * e;
  g.q_vmin = g.q_vscale + g.qtile * (D / kK4V2Group) * e;
  const uint32_t qbytes = g.q_vmin + g.qtile * (D / kK4V2Group) * e;
  g.p_stride = ((D * e / 16) | 1u) * 16;
  g.p_v = g.ptile * g.p_stride;
  const uint32_t pbytes = 2 * g.p_v;
  g.stage_bytes = generic_align16(qbytes > pbytes ? qbytes : pbytes);
  uint32_t off = kK4V2Stages * g.stage_bytes;
  g.bqk_stride = ((D * 2 / 16) | 1u) * 16;
  g.bqk = off;
  g.bqk_pass = 4 * kH * g.bqk_stride;
  off += 2 * g.bqk_pass;
  // Spans: 16-byte units of a value row (64 channels each); the 16-bit tiles of bf16 use
  // span 1 for the probabilities' low pieces even where head_dim is 64.
  const uint32_t spans = D / 64 > 2 ? D / 64 : 2;
  g.bpv_stride = ((g.qtile * 2 / 16) | 1u) * 16;
  if (g.bpv_stride < ((kK4V2RowTile * 2 / 16) | 1u) * 16) g.bpv_stride = ((kK4V2RowTile * 2 / 16) | 1u) * 16;
  g.bpv = off;
  g.bpv_span = 2 * kH * g.bpv_stride;
  off += spans * g.bpv_span;
  g.qn = off;
  off = generic_align16(off + kH * D * e);
  g.uq = off;
  off = generic_align16(off + kH * 4);
  g.us = off;
  off = generic_align16(off + 4 * 4);
  g.bias_part = off;
  off = generic_align16(off + kK4V2Warps * 8 * 8 * 4);
  g.red = off;
  off = generic_align16(off + kK4V2Warps * (kH + 1) * 4);
  g.fin = off;
  off = generic_align16(off + kK4V2Warps * kH * (1 + D / 32) * 4);
  g.mbar = off;
  off = generic_align16(off + kK4V2Stages * 8);
  g.total = off;
  g.launch = off + 1024;
  return g;
}

// What a launch needs beyond its DecodeParams, made once at minikv_cache_create.
struct K4V2LaunchPlan {
  K4V2Plan g;
  FastDivU32 block_tokens;  // R
  uint32_t heads;           // kH: 4 or 8 query-head slots per CTA
};
inline K4V2LaunchPlan make_k4v2_launch_plan(const BlockLayout &bl, uint32_t heads_per_cta) {
  const uint32_t kH = heads_per_cta <= 4 ? 4 : 8;
  return {make_k4v2_plan(bl, kH), FastDivU32::make(bl.tokens), kH};
}

}  // namespace kernels
}  // namespace minikv

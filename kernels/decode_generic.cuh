// Decode attention for every storage configuration: key and value codes of 2, 4 or 8 bits
// or 16-bit rows, any group size, attention sinks, the 16-bit residual, every compiled
// head_dim (cuda_shapes.h: 64, 80, 96, 128, 256), and GQA groups of up to kGenericMaxHeads
// query heads per CTA (larger groups take several CTAs).
//
// One CTA (four warps) per (split, KV head × head chunk, sequence). A split walks its tiles
// in cache order — sinks, quantized blocks, residual (decode_generic_plan.h sizes them) —
// with the next tile's bytes in flight by cp.async while this one is computed:
//   1. quantized keys: q ⊙ s_k and q · m_k of each key group of the tile (fp32), so that a
//      logit is Σ_d (q ⊙ s_k)_d · c_d + q · m_k with the integer code c exact in fp32;
//   2. logits: thread = (token, lane), partial dots summed through shared memory;
//   3. online softmax per head, fp32, log2 units;
//   4. P·V̂: thread = (8 consecutive channels, token subset): Σ p·(c·s_v + m_v) is
//      accumulated as Σ (p·s_v)·c + Σ p·m_v.
// No intermediate is rounded to 16 bits: results agree with the CPU backend to fp32 rounding.
// In a launch of minikv_append_decode the residual's newest row is staged from the caller's
// k/v, and one CTA per (sequence, KV head) stores it into the slot (decode_common.cuh).
// A CTA with one split writes the normalized output, otherwise (max, sum, unnormalized
// output) partials that decode_merge.cu combines.
//
// The kernel itself, instantiated once per head_dim by decode_generic_hd<D>.cu (the
// head_dim values build as separate translation units, in parallel); decode_generic.cu
// sizes and launches it.
#pragma once

#include <type_traits>

#include "common.cuh"
#include "decode_common.cuh"
#include "decode_generic_plan.h"
#include "decode_tiles.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

__device__ __forceinline__ void copy_bytes(uint8_t *dst, const uint8_t *src, uint64_t bytes) {
  for (uint32_t u = threadIdx.x; u < bytes / 16; u += kGenericThreads)
    cp_async_16(dst + u * 16, src + u * 16, true);
}

// `rows` rows of `row_bytes` into rows of `stride` bytes. Rows that are not a multiple of 16
// bytes are staged packed (stride == row_bytes, generic_row_stride): a tile's rows are
// contiguous in the pool, start 16-byte aligned and span a multiple of 16 bytes (tiles of
// quantized storage are multiples of 16 tokens), so they move as one block
// (generic_may_pack). Row `sub` (if below `rows`) comes from `sub_src` instead: the
// appended token (decode_common.cuh; 16-bit rows only, which are never packed).
template <bool kMayPack>
__device__ __forceinline__ void copy_rows(uint8_t *dst, uint32_t stride, const uint8_t *src,
                                          uint64_t row_bytes, uint32_t rows,
                                          uint32_t sub = kNoAppendedRow,
                                          const uint8_t *sub_src = nullptr) {
  if (kMayPack && row_bytes % 16 != 0) return copy_bytes(dst, src, row_bytes * rows);
  const uint32_t units = static_cast<uint32_t>(row_bytes / 16);
  if ((units & (units - 1)) == 0 && units <= kGenericThreads) {  // the usual case: no division
    const uint32_t u = threadIdx.x & (units - 1), step = kGenericThreads / units;
    for (uint32_t r = threadIdx.x / units; r < rows; r += step)
      cp_async_16(dst + r * stride + u * 16, (r == sub ? sub_src : src + r * row_bytes) + u * 16, true);
    return;
  }
  for (uint32_t x = threadIdx.x; x < rows * units; x += kGenericThreads) {
    const uint32_t r = x / units, u = x % units;
    cp_async_16(dst + r * stride + u * 16, (r == sub ? sub_src : src + r * row_bytes) + u * 16, true);
  }
}

// Issues the cp.async copies of one tile of KV head `kvh` of sequence blockIdx.z into
// `stage`; the appended token's residual row (minikv_append_decode) comes from the caller's
// buffers.
/// \tparam HD head_dim (the compiled value of bl.head_dim)
template <int HD>
__device__ void stage_tile(const DecodeParams &p, const GenericDecodePlan &g, const TileRef &tr,
                           const int32_t *table, const uint8_t *res_slot, uint32_t kvh,
                           uint8_t *stage) {
  const BlockLayout &bl = p.st.block;
  const uint64_t D = bl.head_dim, e = bl.elem_bytes, G = bl.group;
  if (tr.segment == kSegQuantized) {
    // A tile never crosses a block: qtile divides R.
    const uint32_t R = bl.tokens, row0 = tr.first % R;
    const uint8_t *block = p.st.pool + uint64_t(table[tr.first / R]) * bl.bytes;
    constexpr bool kMayPack = generic_may_pack(HD);
    copy_rows<kMayPack>(stage, g.k_stride, block + bl.k_codes + kvh * bl.k_codes_head() + row0 * bl.k_row_bytes,
              bl.k_row_bytes, tr.count);
    copy_rows<kMayPack>(stage + g.q_vcodes, g.v_stride,
              block + bl.v_codes + kvh * bl.v_codes_head() + row0 * bl.v_row_bytes, bl.v_row_bytes,
              tr.count);
    if (bl.key_bits != 16) {
      const uint64_t groups = (tr.count + G - 1) / G, at = (row0 / G) * D * e;
      copy_bytes(stage + g.q_kscale, block + bl.k_scale + kvh * bl.k_scale_head() + at, groups * D * e);
      copy_bytes(stage + g.q_kmin, block + bl.k_min + kvh * bl.k_scale_head() + at, groups * D * e);
    }
    if (bl.value_bits != 16) {
      const uint64_t at = row0 * (D / G) * e, bytes = tr.count * (D / G) * e;
      copy_bytes(stage + g.q_vscale, block + bl.v_scale + kvh * bl.v_scale_head() + at, bytes);
      copy_bytes(stage + g.q_vmin, block + bl.v_min + kvh * bl.v_scale_head() + at, bytes);
    }
  } else {
    const RowTileSource src = row_tile_source(p, tr, res_slot, kvh);
    copy_rows<false>(stage, g.p_stride, src.k, D * e, tr.count, src.sub, src.sub_k);
    copy_rows<false>(stage + g.p_v, g.p_stride, src.v, D * e, tr.count, src.sub, src.sub_v);
  }
}

// Codes are read without conversion: a B-bit code c at bit offset o < 16 of a 32-bit
// pattern, masked in place, is the fp32 denormal c · 2^(o - 149) (one LOP3). The other
// operand carries 2^(64 - o), so a product is c · x · 2^-85, a normal float whenever
// |c · x| >= 2^-41 (a smaller term is off by at most 2^-64 in true units), and 2^85 is
// applied once to the sum. fp32 FMAs keep denormal operands (no --use_fast_math, no FTZ).
__device__ __forceinline__ float pow2f(int e) { return __int_as_float((127 + e) << 23); }
constexpr float kCodeUnscale = 38685626227668133590597632.0f;  // 2^85

// Offset (< 16) of code i within its 16-bit half of a word, and the half it lies in.
template <int B> __host__ __device__ constexpr uint32_t code_offset(uint32_t i) { return (i * B) % 16; }
template <int B> __device__ __forceinline__ float code_denormal(uint32_t word, uint32_t i) {
  constexpr uint32_t kMask = (1u << B) - 1u;
  const uint32_t half = i * B >= 16 ? word >> 16 : word;
  return __uint_as_float(half & (kMask << code_offset<B>(i)));
}

// The key codes one lane loads at once: 16 bytes, or 8 or 4 where a row is not a multiple
// of 16 bytes (packed rows, generic_row_stride).
__host__ __device__ constexpr uint32_t code_unit_bytes(uint32_t row_bytes) {
  return row_bytes % 16 == 0 ? 16 : row_bytes % 8 == 0 ? 8 : 4;
}
template <uint32_t N>
using CodeUnit = std::conditional_t<N == 16, uint4, std::conditional_t<N == 8, uint2, uint32_t>>;
// Word i of a loaded unit.
template <typename V> __device__ __forceinline__ uint32_t unit_word(const V &v, uint32_t i) {
  if constexpr (std::is_same<V, uint4>::value) return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  else if constexpr (std::is_same<V, uint2>::value) return i == 0 ? v.x : v.y;
  else return v;
}

/// Partial logits of one token over the code units u = j, j + L, ... of its key row.
/// \tparam T  dtype of 16-bit rows
/// \tparam D  head_dim
/// \tparam NR query heads of the CTA
/// \tparam B  key bits (2, 4, 8: codes against qs = q ⊙ s_k; 16: values against q)
template <typename T, int D, int NR, int B>
__device__ __forceinline__ void key_dots(const uint8_t *row, const float *qv, uint32_t j,
                                         uint32_t lanes, float (&lg)[NR]) {
  if constexpr (B == 16) {
#pragma unroll 1
    for (uint32_t u = j; u < D / 8; u += lanes) {
      float f[8];
      unpack8<T>(*reinterpret_cast<const uint4 *>(row + u * 16), f);
#pragma unroll
      for (int h = 0; h < NR; ++h) lg[h] = fma_dot(qv + h * D + u * 8, f, lg[h]);
    }
  } else {
    constexpr uint32_t kPerWord = 32 / B;
    constexpr uint32_t kUnit = code_unit_bytes(D * B / 8);
#pragma unroll 1
    for (uint32_t u = j; u < D * B / (8 * kUnit); u += lanes) {
      const CodeUnit<kUnit> w = *reinterpret_cast<const CodeUnit<kUnit> *>(row + u * kUnit);
      // Not unrolled: where the unit loop runs once (D = 64) ptxas would otherwise hoist
      // every qs load of the row and spill.
#pragma unroll 1
      for (uint32_t wi = 0; wi < kUnit / 4; ++wi) {
        const uint32_t word = unit_word(w, wi);
#pragma unroll
        for (uint32_t c = 0; c < kPerWord; c += 4) {
          const uint32_t d = u * (8 * kUnit / B) + wi * kPerWord + c;
          float f[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) f[k] = code_denormal<B>(word, c + k);
#pragma unroll
          for (int h = 0; h < NR; ++h) lg[h] = fma_dot(qv + h * D + d, f, lg[h]);
        }
      }
    }
  }
}

/// P·V̂ of a warp's tokens t = sub, sub + subs, ... < count for 8 consecutive channels.
/// \tparam B value bits (2, 4, 8: codes, with the token's group scale folded into p;
///           16: values)
template <typename T, int NR, int B>
__device__ __forceinline__ void value_tokens(const uint8_t *rows, uint32_t stride, const T *vs,
                                             const T *vm, uint32_t vgroups, uint32_t my_group,
                                             const float *probs, uint32_t count, uint32_t sub,
                                             uint32_t subs, uint32_t lane8,
                                             const float (&plain_scale)[8], float (&acc)[NR][8],
                                             float (&bm)[NR]) {
  using Tr = DType<T>;
#pragma unroll 2
  for (uint32_t t = sub; t < count; t += subs) {
    float pr[NR];
#pragma unroll
    for (int h = 0; h < NR; ++h) pr[h] = probs[h * kGenericWarpTokens + t];
    const uint8_t *row = rows + t * stride;
    float f[8];
    if constexpr (B == 16) {
      unpack8<T>(*reinterpret_cast<const uint4 *>(row + lane8 * 16), f);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] *= plain_scale[k];
#pragma unroll
      for (int h = 0; h < NR; ++h)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[h][k] = fmaf(pr[h], f[k], acc[h][k]);
    } else {
      uint32_t w0, w1 = 0;
      if constexpr (B == 2) {
        w0 = *reinterpret_cast<const uint16_t *>(row + lane8 * 2);
      } else if constexpr (B == 4) {
        w0 = *reinterpret_cast<const uint32_t *>(row + lane8 * 4);
      } else {
        const uint2 w = *reinterpret_cast<const uint2 *>(row + lane8 * 8);
        w0 = w.x;
        w1 = w.y;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = code_denormal<B>(B == 8 && k >= 4 ? w1 : w0, B == 8 ? k % 4 : k);
      const float s = Tr::to_float(vs[t * vgroups + my_group]) * pow2f(64);
      const float m = Tr::to_float(vm[t * vgroups + my_group]);
#pragma unroll
      for (int h = 0; h < NR; ++h) {
        const float ps = pr[h] * s;
        bm[h] = fmaf(pr[h], m, bm[h]);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[h][k] = fmaf(ps, f[k], acc[h][k]);
      }
    }
  }
}

// Offset of value code k of a lane's 8 channels (see code_denormal).
__device__ __forceinline__ uint32_t value_code_offset(uint32_t bits, uint32_t k) {
  return ((bits == 8 ? k % 4 : k) * bits) % 16;
}

// Resident CTAs per SM asked of ptxas (it caps registers to fit them): 3 (168 registers)
// for 4 and 8 query heads, where registers would otherwise decide residency; 1 (no cap)
// below. At 8 heads of head_dim 256 the q ⊙ s_k slices alone take 32 KB and shared memory
// (~92 KB) fits only 2 CTAs on an H100, so a cap for 3 would only add spills.
constexpr int generic_min_ctas(int d, int nr) { return nr < 4 ? 1 : nr * d >= 2048 ? 2 : 3; }

/// \tparam T  dtype of q/out and of 16-bit storage (__half or __nv_bfloat16)
/// \tparam D  head_dim
/// \tparam NR query heads per CTA (p.heads_per_cta of them are used)
///
/// Each warp takes a quarter of every tile and keeps its own softmax state (running max and
/// sum per head, its P·V̂ accumulators), so the only CTA-wide barrier of a tile is the one
/// that hands over the staged bytes; the four warps' states are merged at the end.
template <typename T, int D, int NR>
__global__ void __launch_bounds__(kGenericThreads, generic_min_ctas(D, NR))
    decode_generic_kernel(const __grid_constant__ DecodeParams p) {
  using Tr = DType<T>;
  MINIKV_DYNAMIC_SMEM(smem, 16);
  const BlockLayout &bl = p.st.block;
  const GenericDecodePlan g = make_generic_decode_plan<generic_may_pack(D)>(bl, NR);
  const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const DecodeCta cta(p);
  const uint32_t split = cta.split, seq = cta.seq, kvh = cta.kvh, chunk = cta.chunk, h0 = cta.h0, nh = cta.nh;
  const uint32_t G = bl.group;

  float *q_s = reinterpret_cast<float *>(smem + g.q);                                // [NR][D]
  float *qs_w = reinterpret_cast<float *>(smem + g.qs) + warp * NR * D;               // [NR][D]
  float *probs_w = reinterpret_cast<float *>(smem + g.probs) + warp * NR * kGenericWarpTokens;
  float *ml_s = reinterpret_cast<float *>(smem + g.ml);                               // [4][2][NR]

  const T *q = static_cast<const T *>(p.q) + (uint64_t(seq) * p.num_heads + h0) * D;
  for (uint32_t i = tid; i < NR * D; i += kGenericThreads)
    q_s[i] = i / D < nh ? Tr::to_float(q[i]) : 0.0f;

  const SequenceTiles<GenericDecodePlan> tiles(p.sinks[seq], p.quantized[seq], p.residual[seq], g);
  const SplitTiles range(tiles.total, p.splits, split);
  const uint32_t t_begin = range.begin, t_end = range.end;
  const SequenceSlot sslot(p, seq);
  const int32_t *table = sslot.table;
  const uint8_t *res_slot = sslot.residual;

  // P·V̂ roles inside the warp: kLanesPerRow lanes own 8 channels each of a token row, the
  // warp's kSubsets row subsets take every kSubsets-th token. Where D / 8 does not divide 32
  // (head_dim 80: 3 subsets of 10 lanes, 96: 2 of 12) the lanes past the last subset idle.
  constexpr uint32_t kLanesPerRow = D / 8;
  constexpr uint32_t kSubsets = 32 / kLanesPerRow;
  constexpr bool kIdleLanes = kSubsets * kLanesPerRow != 32;
  static_assert(D % 8 == 0 && D / 8 <= 32, "one warp covers a row in P.V");
  const uint32_t lane8 = lane % kLanesPerRow, sub = lane / kLanesPerRow;
  // With quantized values the accumulators hold code products in units of 2^(o_k - 85)
  // (code_denormal); 16-bit rows (sinks, residual) join them scaled the same way.
  const bool scaled_values = bl.value_bits != 16;
  float plain_scale[8];
#pragma unroll
  for (int k = 0; k < 8; ++k)
    plain_scale[k] = scaled_values ? pow2f(int(value_code_offset(bl.value_bits, k)) - 85) : 1.0f;

  float m_run[NR], l_run[NR], bias[NR], acc[NR][8], bm[NR];
#pragma unroll
  for (int h = 0; h < NR; ++h) {
    m_run[h] = -INFINITY;
    l_run[h] = 0.0f;
    bias[h] = 0.0f;
    bm[h] = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[h][k] = 0.0f;
  }
  uint32_t qs_group = ~0u;  // quantized key group whose q ⊙ s_k the warp holds

  // minikv_append_decode: the first split of the first head chunk stores the appended token
  // (decode_common.cuh); every CTA reads it from the caller's k/v (stage_tile).
  if (split == 0 && chunk == 0) store_appended_row(p, seq, kvh, tid, kGenericThreads);

  if (t_begin < t_end) stage_tile<D>(p, g, tiles.tile(t_begin, g), table, res_slot, kvh, smem);
  cp_async_commit();
  for (uint32_t ti = t_begin; ti < t_end; ++ti) {
    const uint8_t *stage = smem + ((ti - t_begin) & 1) * g.stage_bytes;
    cp_async_wait<0>();
    __syncthreads();  // this tile landed; every warp is done with the previous one
    if (ti + 1 < t_end)
      stage_tile<D>(p, g, tiles.tile(ti + 1, g), table, res_slot, kvh,
                 smem + ((ti + 1 - t_begin) & 1) * g.stage_bytes);
    cp_async_commit();

    const TileRef tr = tiles.tile(ti, g);
    const bool quantized = tr.segment == kSegQuantized;
    const uint32_t kb = quantized ? bl.key_bits : 16, vb = quantized ? bl.value_bits : 16;
    const uint32_t wtok = (quantized ? g.qtile : g.ptile) / kGenericWarps;  // S
    const uint32_t w0 = warp * wtok;
    const uint32_t count = tr.count > w0 ? min(wtok, tr.count - w0) : 0;
    if (count == 0) continue;

    // 1. The warp's tokens share one key group (G >= 16 >= S): its q ⊙ s_k and q · m_k.
    if (kb != 16) {
      const uint32_t group = (tr.first + w0) / G, gl = group - tr.first / G;
      if (group != qs_group) {
        qs_group = group;
        const T *ks = reinterpret_cast<const T *>(stage + g.q_kscale) + gl * D;
        const T *km = reinterpret_cast<const T *>(stage + g.q_kmin) + gl * D;
        for (uint32_t i = lane; i < NR * D; i += 32) {
          const uint32_t d = i % D;
          qs_w[i] = q_s[i] * Tr::to_float(ks[d]) * pow2f(64 - int((d * kb) % 16));
        }
#pragma unroll
        for (int h = 0; h < NR; ++h) {
          float b = 0.0f;
          for (uint32_t d = lane; d < D; d += 32) b = fmaf(q_s[h * D + d], Tr::to_float(km[d]), b);
          bias[h] = warp_sum(b);
        }
        __syncwarp();
      }
    } else {
#pragma unroll
      for (int h = 0; h < NR; ++h) bias[h] = 0.0f;
    }

    // 2. Logits: `lanes` lanes per token, eight consecutive lanes on eight consecutive
    //    tokens (one 16-byte unit index each: conflict-free with the odd row strides).
    const uint32_t lanes = 32 / wtok, tl = wtok < 8 ? wtok : 8;
    const uint32_t t = lane % tl + tl * (lane / (tl * lanes)), j = (lane / tl) % lanes;
    float x[NR];
#pragma unroll
    for (int h = 0; h < NR; ++h) x[h] = 0.0f;
    const float unscale = kb != 16 ? kCodeUnscale : 1.0f;
    if (t < count) {
      const uint8_t *row = stage + (w0 + t) * (quantized ? g.k_stride : g.p_stride);
      switch (kb) {
        case 2: key_dots<T, D, NR, 2>(row, qs_w, j, lanes, x); break;
        case 4: key_dots<T, D, NR, 4>(row, qs_w, j, lanes, x); break;
        case 8: key_dots<T, D, NR, 8>(row, qs_w, j, lanes, x); break;
        default: key_dots<T, D, NR, 16>(row, q_s, j, lanes, x); break;
      }
    }
#pragma unroll
    for (int h = 0; h < NR; ++h) {
      for (uint32_t o = tl; o < tl * lanes; o <<= 1) x[h] += __shfl_xor_sync(0xffffffffu, x[h], o);
      x[h] = t < count ? fmaf(x[h], unscale, bias[h]) * p.scale_log2 : -INFINITY;
    }

    // 3. Online softmax of the warp's tokens, per head.
    float corr[NR];
#pragma unroll
    for (int h = 0; h < NR; ++h) {
      const float m_new = fmaxf(m_run[h], warp_max(x[h]));
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float e = exp2f(x[h] - base);
      const float sum = warp_sum(j == 0 ? e : 0.0f);
      corr[h] = exp2f(m_run[h] - base);
      l_run[h] = l_run[h] * corr[h] + sum;
      m_run[h] = m_new;
      if (j == 0 && t < wtok) probs_w[h * kGenericWarpTokens + t] = e;
    }
    __syncwarp();

    // 4. P·V̂ of the warp's tokens.
#pragma unroll
    for (int h = 0; h < NR; ++h) {
      bm[h] *= corr[h];
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[h][k] *= corr[h];
    }
    const uint32_t stride = quantized ? g.v_stride : g.p_stride;
    const uint8_t *vrows = stage + (quantized ? g.q_vcodes : g.p_v) + w0 * stride;
    const uint32_t vgroups = D / G, my_group = lane8 * 8 / G;
    const T *vs = reinterpret_cast<const T *>(stage + g.q_vscale) + w0 * vgroups;
    const T *vm = reinterpret_cast<const T *>(stage + g.q_vmin) + w0 * vgroups;
    const uint32_t pv_count = kIdleLanes && sub >= kSubsets ? 0 : count;
    switch (vb) {
      case 2: value_tokens<T, NR, 2>(vrows, stride, vs, vm, vgroups, my_group, probs_w, pv_count, sub, kSubsets, lane8, plain_scale, acc, bm); break;
      case 4: value_tokens<T, NR, 4>(vrows, stride, vs, vm, vgroups, my_group, probs_w, pv_count, sub, kSubsets, lane8, plain_scale, acc, bm); break;
      case 8: value_tokens<T, NR, 8>(vrows, stride, vs, vm, vgroups, my_group, probs_w, pv_count, sub, kSubsets, lane8, plain_scale, acc, bm); break;
      default: value_tokens<T, NR, 16>(vrows, stride, vs, vm, vgroups, my_group, probs_w, pv_count, sub, kSubsets, lane8, plain_scale, acc, bm); break;
    }
  }
  cp_async_wait<0>();

  // Merge: token subsets inside the warp (into subset 0's lanes), then the four warps.
#pragma unroll
  for (int h = 0; h < NR; ++h)
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float a = acc[h][k] / plain_scale[k] + bm[h];  // a power of two: exact
      float sum = a;
      if constexpr (kIdleLanes) {
        for (uint32_t s = 1; s < kSubsets; ++s)
          sum += __shfl_down_sync(0xffffffffu, a, s * kLanesPerRow);
      } else {
        for (uint32_t o = kLanesPerRow; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      }
      acc[h][k] = sum;
    }
  __syncthreads();  // qs slices are free: they take the warps' outputs
  float *o_w = reinterpret_cast<float *>(smem + g.qs) + warp * NR * D;
  if (sub == 0) {
#pragma unroll
    for (int h = 0; h < NR; ++h)
#pragma unroll
      for (int k = 0; k < 8; ++k) o_w[h * D + lane8 * 8 + k] = acc[h][k];
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < NR; ++h) {
      ml_s[(warp * 2) * NR + h] = m_run[h];
      ml_s[(warp * 2 + 1) * NR + h] = l_run[h];
    }
  }
  __syncthreads();
  const float *o_all = reinterpret_cast<const float *>(smem + g.qs);
  for (uint32_t i = tid; i < nh * D; i += kGenericThreads) {
    const uint32_t h = i / D, d = i % D;
    float m = -INFINITY;
#pragma unroll
    for (uint32_t w = 0; w < kGenericWarps; ++w) m = fmaxf(m, ml_s[(w * 2) * NR + h]);
    float o = 0.0f, l = 0.0f;
    if (m != -INFINITY) {
#pragma unroll
      for (uint32_t w = 0; w < kGenericWarps; ++w) {
        const float wt = exp2f(ml_s[(w * 2) * NR + h] - m);  // 0 for a warp with no tokens
        o = fmaf(wt, o_all[(w * NR + h) * D + d], o);
        l = fmaf(wt, ml_s[(w * 2 + 1) * NR + h], l);
      }
    }
    store_decode_result<T, D>(p, uint64_t(seq) * p.num_heads + h0 + h, split, d, m, o, l);
  }
}

}  // namespace

template <typename T, int D, int NR> DecodeGenericKernel decode_generic_kernel_for() {
  return decode_generic_kernel<T, D, NR>;
}

}  // namespace kernels
}  // namespace minikv

// The kernel instances of head_dim D: both dtypes, every heads-per-CTA tile NR that
// dispatch_heads (decode_generic.cu) picks.
#define MINIKV_DECODE_GENERIC_HEAD_DIM(D)                                                   \
  namespace minikv {                                                                        \
  namespace kernels {                                                                       \
  template DecodeGenericKernel decode_generic_kernel_for<__half, D, 1>();                   \
  template DecodeGenericKernel decode_generic_kernel_for<__half, D, 2>();                   \
  template DecodeGenericKernel decode_generic_kernel_for<__half, D, 4>();                   \
  template DecodeGenericKernel decode_generic_kernel_for<__half, D, 8>();                   \
  template DecodeGenericKernel decode_generic_kernel_for<__nv_bfloat16, D, 1>();            \
  template DecodeGenericKernel decode_generic_kernel_for<__nv_bfloat16, D, 2>();            \
  template DecodeGenericKernel decode_generic_kernel_for<__nv_bfloat16, D, 4>();            \
  template DecodeGenericKernel decode_generic_kernel_for<__nv_bfloat16, D, 8>();            \
  }                                                                                         \
  }

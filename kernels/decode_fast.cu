// Decode attention over the compressed cache: flash-decoding with fused dequantization.
//
// The fast path for the paper's storage (decode_generic.cu serves every other one, with the
// same result to fp32 rounding: the CPU backend's):
//
// decode_fast_kernel (2-bit keys and values, G = 16, head_dim 64/128, GQA group 1/2/4/8):
//   one warp per CTA, one CTA per (split, KV head, sequence). A split walks tiles of 128
//   quantized tokens (8 key groups); each tile arrives by cp.async as a K unit (key codes,
//   scales, minima) and a V unit (value codes, scales, minima), 8 KB each at D = 128, in a
//   ring of one buffer per unit: the next tile's K unit loads during this tile's P·V̂, its V
//   unit during the next QK. 16 KB per warp: 12 warps per SM at D = 128, n_rep = 1.
//   - QK on tensor cores (fp16 mma m16n8k16 → fp32, for fp16 and bf16 data; qk_pieces.h):
//     q ⊙ s_k is exact in fp32; A = codes as fp16 subnormals (one LOP3 per pair), B = 2 fp16
//     pieces of q ⊙ s_k prescaled per column by a power of two, error ≤ 3·D·2^-33 ·
//     max|q ⊙ s_k| of the column; bias = q · m_k in fp32. The 8 columns of B are
//     (n_rep query heads) × (8 / n_rep key groups): one load of the KV tile serves the whole
//     GQA group and no column is padding.
//   - online softmax in fp32 (log2 units) per tile; probabilities stay fp32.
//   - P·V̂ on CUDA cores: a lane owns CPL channels of a token subset; each code becomes the
//     fp32 denormal c · 4^j · 2^-149 with one LOP3 (its own bit pattern), multiplied by
//     p · s · 2^64 in an FFMA; 4^-j · 2^85 is folded in once at the end, and
//     Σ p · (c·s + m) = Σ (p·s)·c + Σ p·m.
//   The residual (16-bit, up to R tokens) is folded in by the last split; in a launch of
//   minikv_append_decode its newest row is the caller's k/v, which split 0 stores into the
//   slot (decode_common.cuh). With one split the kernel writes the normalized output, else
//   (max, sum, unnormalized out) partials, and when a pair has few partials the last CTA to
//   finish merges them (merge_if_last); more partials go to decode_merge.cu.
#include <type_traits>

#include "common.cuh"
#include "decode_common.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "qk_pieces.h"
#include "../src/quant.h"

namespace minikv {
namespace kernels {
namespace {

constexpr uint32_t kFullMask = 0xffffffffu;

// Shared memory of one tile (8 key groups of 16 tokens) in two units, byte offsets; the K
// unit is read by QK only and the V unit by P·V̂ only, so a ring of one K and one V buffer
// keeps one unit in flight while the other is consumed (16 KB per warp at D = 128):
//   K unit: KC [8][16][D/4] key codes    KS [8][D] key scales    KM [8][D] key minima
//   V unit: VC [128][D/4] value codes    VS [128][D/16] scales   VM [128][D/16] minima
template <int D> struct FastStage {
  static constexpr int kKC = 0, kKS = 32 * D, kKM = 48 * D;
  static constexpr int kVC = 0, kVS = 32 * D, kVM = 48 * D;
  static constexpr int kUnitBytes = 64 * D;
};

template <typename T, int D, int NREP> struct FastCfg {
  static constexpr int kCs = 8 / NREP;      // key groups (M-tiles) per QK sub-tile
  // fp16 mma for both dtypes (qk_pieces.h); bf16 columns may need the second unscale factor.
  static constexpr bool kWideExp = std::is_same<T, __nv_bfloat16>::value;
  static constexpr int kPieces = 2;         // fp16 pieces of the prescaled q ⊙ s_k
  // Independent mma accumulators per M-tile (piece × k-step parity when registers allow):
  // short HMMA dependency chains, ptxas does not interleave M-tiles by itself.
  static constexpr int kAcc = kCs >= 4 ? 2 * kPieces : kPieces;
  static constexpr int kKsteps = D / 16;    // mma k-steps over the channels
  static constexpr int kQc = D / 4;         // channels of one lane quarter (lane % 4)
  static constexpr int kQw = D / 64;        // 32-bit code words of one quarter of a row
  static constexpr int kCpl = NREP <= 4 ? 16 : 8;  // P·V̂ channels per lane
  static constexpr int kLpr = D / kCpl;     // lanes per token row in P·V̂
  static constexpr int kSubsets = 32 / kLpr;  // token subsets in P·V̂
  // Resident CTAs (warps) per SM asked of ptxas: 12 caps registers at 168, the most that
  // fits 3 warps in each of the 4 register-file partitions (16 K registers each; at 169..204
  // only 2 fit: 8 warps/SM). Issue is the bottleneck, so warps per SM matter more than a few
  // registers: capped where the SASS stays spill-free at 168 — D = 128 with n_rep 1 and 2;
  // n_rep 4 (18 words, reloaded every tile) and n_rep 8 (dozens) keep 8 warps (measured at
  // d8ab35d: f16 n_rep 4 uncapped, 8 warps, ran 13 % faster than bf16 capped at 12).
  static constexpr int kMinCtas = D == 128 && NREP <= 2 ? 12 : 1;
};

// The 16 2-bit codes of one word (code j at bits 2j) as 8 fp16x2 pairs (code s, code s + 8),
// s = 0..7: fp16 subnormals c · 4^(s mod 4) · 2^-24, one LOP3 each (no magic number to
// subtract); B carries the 4^-(s mod 4) (qk_pieces.h). Fallback (!kF16SubnormalCodes):
// (pattern | 1024.0) − 1024.0 = c · 4^(s mod 4), exact; f16_magic = 0x64006400 comes in a
// register (see opaque_zero) so that pattern | magic is one LOP3.
__device__ __forceinline__ void key_pairs_f16(uint32_t w, uint32_t f16_magic, uint32_t (&a)[8]) {
#pragma unroll
  for (uint32_t s = 0; s < 8; ++s) {
    a[s] = f16_code_pair(w, s);
    if constexpr (!kF16SubnormalCodes)
      asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(a[s]) : "r"(a[s] | f16_magic), "r"(0x64006400u));
  }
}

// Value code k (of the CPL codes of u, code k at bits 2k) as the fp32 whose bit pattern is
// c · 4^e(k): a denormal, exactly c · 4^e(k) · 2^-149, in one LOP3 (no magic number to
// subtract). The FFMA that consumes it multiplies by p · s_v · kPvScale; with kPvScale = 2^64
// the product p · s_v · c · 4^e · 2^-85 is a normal fp32 (exact product, one rounding into
// the fp32 sum) whenever p · s_v · c ≥ 2^-41, and a smaller term is off by at most 2^-65 in
// true units. fp32 FMA keeps denormal operands (no --use_fast_math, no FTZ). finish() scales
// by 4^-e · 2^149 / kPvScale, a power of two.
constexpr float kPvScale = 18446744073709551616.0f;  // 2^64
template <int K> __device__ __forceinline__ float value_code(uint32_t u) {
  const uint32_t bits = K <= 10 ? (u & (3u << (2 * K))) : ((u >> 16) & (3u << (2 * (K - 8))));
  return __uint_as_float(bits);
}
template <int K> __host__ __device__ constexpr float value_code_inv_scale() {  // 4^-e(k)·2^85
  return (K <= 10 ? 1.0f / static_cast<float>(1u << (2 * K))
                  : 1.0f / static_cast<float>(1u << (2 * (K - 8)))) *
         (static_cast<float>(1ull << 42) * static_cast<float>(1ull << 43));
}
template <int CPL, int K = 0> struct ValueCodes {
  template <int NREP>
  static __device__ __forceinline__ void fma(uint32_t u, const float (&ps)[NREP],
                                             float (&acc)[NREP][CPL]) {
    const float c = value_code<K>(u);
#pragma unroll
    for (int r = 0; r < NREP; ++r) acc[r][K] = fmaf(ps[r], c, acc[r][K]);
    ValueCodes<CPL, K + 1>::fma(u, ps, acc);
  }
  template <int NREP>
  static __device__ __forceinline__ void finish(float (&acc)[NREP][CPL], const float (&bacc)[NREP]) {
#pragma unroll
    for (int r = 0; r < NREP; ++r) acc[r][K] = fmaf(acc[r][K], value_code_inv_scale<K>(), bacc[r]);
    ValueCodes<CPL, K + 1>::finish(acc, bacc);
  }
};
template <int CPL> struct ValueCodes<CPL, CPL> {
  template <int NREP>
  static __device__ __forceinline__ void fma(uint32_t, const float (&)[NREP], float (&)[NREP][CPL]) {}
  template <int NREP>
  static __device__ __forceinline__ void finish(float (&)[NREP][CPL], const float (&)[NREP]) {}
};

template <int N> __device__ __forceinline__ void load_probs(const float *src, float (&pr)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int r = 0; r < N; r += 4) {
      const float4 v = *reinterpret_cast<const float4 *>(src + r);
      pr[r] = v.x;
      pr[r + 1] = v.y;
      pr[r + 2] = v.z;
      pr[r + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const float2 v = *reinterpret_cast<const float2 *>(src);
    pr[0] = v.x;
    pr[1] = v.y;
  } else {
    pr[0] = src[0];
  }
}

// Online-softmax update over the logits p_s[t * NREP + r], t < count (entries past count are
// ignored): lane l owns head l % NREP (NREP divides 32, so p_s[l + 32 j] is always that
// head); turns them into exp2(x − m_new) in place and rescales the P·V̂ state.
template <int NREP, int CPL>
__device__ __forceinline__ void softmax_update(float *p_s, uint32_t count, uint32_t lane,
                                               float &m_run, float &l_run,
                                               float (&acc)[NREP][CPL], float (&bacc)[NREP]) {
  constexpr int kPer = 4 * NREP;  // 128 tokens × NREP heads / 32 lanes
  float v[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const uint32_t idx = lane + 32u * j;
    v[j] = idx / NREP < count ? p_s[idx] : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
#pragma unroll
  for (int off = 16; off >= NREP; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
  const float m_new = fmaxf(m_run, mx);
  const float base = m_new == -INFINITY ? 0.0f : m_new;
  const float corr = exp2f(m_run - base);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const float e = exp2f(v[j] - base);
    p_s[lane + 32u * j] = e;
    sum += e;
  }
#pragma unroll
  for (int off = 16; off >= NREP; off >>= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
  l_run = l_run * corr + sum;
  m_run = m_new;
#pragma unroll
  for (int r = 0; r < NREP; ++r) {
    const float cr = __shfl_sync(kFullMask, corr, r);
    bacc[r] *= cr;
#pragma unroll
    for (int k = 0; k < CPL; ++k) acc[r][k] *= cr;
  }
}

// Split merge fused into the fast kernel when a (sequence, KV head) has at most
// kFusedMergeMax split × head partials: the CTA that writes the last partials of the pair
// merges its NREP heads (the others' partials are visible through the fence + counter, read
// from L2) and resets the counter, so the next launch, or a CUDA graph replay, starts from
// zero. One warp reads NREP · splits · D floats, so larger merges (B = 1 GQA: 128 splits × 4
// heads, 256 KB) go to decode_merge_kernel, which spreads them over the GPU. The sums run over
// the splits in order: the result does not depend on which CTA merges.
constexpr uint32_t kFusedMergeMax = 32;
template <int NREP> __host__ __device__ constexpr bool fused_merge(uint32_t splits) {
  return splits > 1 && splits * NREP <= kFusedMergeMax;
}
template <typename T, int D, int NREP>
__device__ __forceinline__ void merge_if_last(const DecodeParams &p, uint32_t seq, uint32_t kvh,
                                              uint32_t lane, float *w_s) {
  uint32_t *counter = p.counters + uint64_t(seq) * p.num_kv_heads + kvh;
  if (!arrive_last_split(counter, p.splits, lane)) return;
  // Weights exp2(m_s − m) of every (head, split) into w_s (splits · NREP ≤ 32: one per lane).
  const uint32_t S = p.splits, r_l = lane / S, s_l = lane % S;
  const uint64_t head0 = uint64_t(seq) * p.num_heads + kvh * NREP;
  const bool live = r_l < uint32_t(NREP);
  const float ms = live ? __ldcg(p.part_ml + ((head0 + r_l) * S + s_l) * 2) : -INFINITY;
  const float ls = live ? __ldcg(p.part_ml + ((head0 + r_l) * S + s_l) * 2 + 1) : 0.0f;
#pragma unroll 1
  for (int r = 0; r < NREP; ++r) {
    float mr = -INFINITY;
    for (uint32_t s = 0; s < S; ++s) mr = fmaxf(mr, __shfl_sync(kFullMask, ms, r * S + s));
    const float w = ms == -INFINITY ? 0.0f : exp2f(ms - mr);  // empty split: weight 0
    if (r_l == uint32_t(r)) w_s[s_l] = w;
    float l = 0.0f;
    for (uint32_t s = 0; s < S; ++s) l += __shfl_sync(kFullMask, w * ls, r * S + s);
    __syncwarp();
    store_merged_head<T, D>(p, head0 + r, w_s, l, lane);
  }
}

/// \tparam T    dtype of q/out and of the scales and residual (__half or __nv_bfloat16)
/// \tparam D    head_dim (64 or 128)
/// \tparam NREP query heads per KV head (1, 2, 4 or 8)
template <typename T, int D, int NREP>
__global__ void __launch_bounds__(32, (FastCfg<T, D, NREP>::kMinCtas))
    decode_fast_kernel(const __grid_constant__ DecodeParams p) {
  using Cfg = FastCfg<T, D, NREP>;
  using St = FastStage<D>;
  constexpr int Cs = Cfg::kCs, PIECES = Cfg::kPieces, NA = Cfg::kAcc, KSTEPS = Cfg::kKsteps;
  constexpr int QC = Cfg::kQc, QW = Cfg::kQw, CPL = Cfg::kCpl, LPR = Cfg::kLpr,
                SUBSETS = Cfg::kSubsets;
  constexpr uint32_t kTile = kDecodeFastTile;
  static_assert(kTile == 128 && (D == 64 || D == 128) && 32 % NREP == 0 && NREP <= 8, "");
  __shared__ __align__(16) uint8_t stage_s[2][St::kUnitBytes];  // K unit, V unit
  __shared__ __align__(16) float p_s[kTile * NREP];

  const uint32_t split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z, lane = threadIdx.x;
  const uint32_t nq = p.quantized[seq], nres = p.residual[seq];
  const uint32_t tiles = (nq + kTile - 1) / kTile;
  const uint32_t per = (tiles + p.splits - 1) / p.splits;
  const uint32_t t_begin = min(tiles, split * per), t_end = min(tiles, t_begin + per);
  const uint32_t h0 = kvh * NREP;

  const BlockLayout &bl = p.st.block;
  const uint32_t R = bl.tokens;
  const int32_t *table = p.st.block_table + uint64_t(p.slot[seq]) * p.st.max_blocks_per_seq;

  // ---- per-lane roles ----
  // QK (mma fragments): g = lane / 4 is the token row (and g + 8) of an M-tile and the B
  // column n = g = (key group my_c, head my_r); i = lane % 4 owns channels [i·QC, (i+1)·QC).
  const uint32_t g = lane >> 2, qi = lane & 3;
  const uint32_t my_r = g % NREP, my_c = g / NREP;
  // P·V̂: lane owns channels [ch0, ch0 + CPL) of the tokens t ≡ sub (mod SUBSETS).
  const uint32_t ch0 = (lane % LPR) * CPL, sub = lane / LPR;
  const uint32_t gv = ch0 / 16, bo = (ch0 % 16) * 2;  // value group word, bit offset

  // A zero that ptxas cannot prove (it does not know p.n < 2^31): OR-ed into the decode magic
  // numbers it keeps them in registers, so each (bits & mask) | magic is a single LOP3
  // (with two immediates ptxas emits two).
  const uint32_t opaque_zero = p.n >> 31;
  const uint32_t f16_magic = 0x64006400u | opaque_zero;  // used only if !kF16SubnormalCodes

  const T *qg = static_cast<const T *>(p.q) + (uint64_t(seq) * p.num_heads + h0) * D;
  float q_reg[QC];  // q of head my_r, channels of quarter qi
#pragma unroll
  for (int v = 0; v < QC / 8; ++v) {
    float f[8];
    unpack8<T>(reinterpret_cast<const uint4 *>(qg + my_r * D + qi * QC)[v], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) q_reg[v * 8 + e] = f[e];
  }

  float m_run = -INFINITY, l_run = 0.0f;  // of head lane % NREP
  float acc[NREP][CPL], bacc[NREP];
#pragma unroll
  for (int r = 0; r < NREP; ++r) {
    bacc[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < CPL; ++k) acc[r][k] = 0.0f;
  }

  // ---- async copies of one unit: lane copies 16-byte chunks c = lane + 32 j of each group ----
  // chunk c of a group: [codes D/4 | scales D/8 | minima D/8], the same in both units (only
  // the source regions differ).
  constexpr int kJ = D / 64;
  uint32_t src_k[kJ], src_v[kJ], src_row[kJ], dst_off[kJ], dst_grp[kJ];
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const uint32_t c = lane + 32u * j;
    uint32_t k_src, v_src, dst, idx, row_mul, grp_stride;
    if (c < D / 4) {
      idx = c; k_src = uint32_t(bl.k_codes + kvh * bl.k_codes_head());
      v_src = uint32_t(bl.v_codes + kvh * bl.v_codes_head()); dst = St::kKC;
      row_mul = D / 4; grp_stride = 4 * D;
    } else if (c < 3 * D / 8) {
      idx = c - D / 4; k_src = uint32_t(bl.k_scale + kvh * bl.k_scale_head());
      v_src = uint32_t(bl.v_scale + kvh * bl.v_scale_head()); dst = St::kKS;
      row_mul = D / 8; grp_stride = 2 * D;
    } else {
      idx = c - 3 * D / 8; k_src = uint32_t(bl.k_min + kvh * bl.k_scale_head());
      v_src = uint32_t(bl.v_min + kvh * bl.v_scale_head()); dst = St::kKM;
      row_mul = D / 8; grp_stride = 2 * D;
    }
    src_k[j] = k_src + 16u * idx;  // + row0 · row_mul (row0: first row of the group)
    src_v[j] = v_src + 16u * idx;
    src_row[j] = row_mul;
    dst_off[j] = dst + 16u * idx;  // + group · grp_stride
    dst_grp[j] = grp_stride;
  }
  static_assert(St::kKC == St::kVC && St::kKS == St::kVS && St::kKM == St::kVM, "");
  // Pool block of key group `lane` (< 8) of a tile, -1 past the quantized tokens.
  auto group_block = [&](uint32_t tile) -> int32_t {
    const uint32_t t0 = tile * kTile + 16u * lane;
    return lane < 8 && tile < t_end && t0 < nq ? table[t0 / R] : -1;
  };
  auto issue_unit = [&](uint32_t tile, uint8_t *unit, int32_t blk_lane, const uint32_t(&src)[kJ]) {
    const uint32_t row_lane = (tile * kTile + 16u * lane) % R;  // first row of group `lane`
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int32_t blk = __shfl_sync(kFullMask, blk_lane, c);
      const uint32_t row0 = __shfl_sync(kFullMask, row_lane, c);
      const uint8_t *block = p.st.pool + (blk >= 0 ? uint64_t(blk) * bl.bytes : 0);
#pragma unroll
      for (int j = 0; j < kJ; ++j)
        cp_async_16(unit + dst_off[j] + c * dst_grp[j],
                    block + (blk >= 0 ? src[j] + row0 * src_row[j] : 0), blk >= 0);
    }
  };

  // minikv_append_decode: split 0 stores the appended token (decode_common.cuh).
  if (split == 0) store_appended_row(p, seq, kvh, lane, 32);

  // ---- quantized tiles ----
  // Ring of two units: K(k) and V(k) are issued, QK(k) waits for K(k); K(k+1) is issued into
  // the freed K buffer before P·V̂(k) waits for V(k); V(k+1) follows P·V̂(k). Each unit has
  // one compute phase (QK or P·V̂ of one tile) to arrive, with 16 KB per warp instead of the
  // 32 KB of two whole-tile stages: more warps per SM.
  uint8_t *const k_unit = stage_s[0], *const v_unit = stage_s[1];
  if (t_begin < t_end) {
    int32_t blk_cur = group_block(t_begin);
    issue_unit(t_begin, k_unit, blk_cur, src_k);
    cp_async_commit();
    issue_unit(t_begin, v_unit, blk_cur, src_v);
    cp_async_commit();
    int32_t blk_next = group_block(t_begin + 1);
    for (uint32_t tile = t_begin; tile < t_end; ++tile) {
      const bool more = tile + 1 < t_end;
      cp_async_wait<1>();  // K(tile); V(tile) may still be in flight
      __syncwarp();
      const uint8_t *st = k_unit;
      const uint32_t tok0 = tile * kTile, nvalid = min(kTile, nq - tok0);

      // -- logits on tensor cores, one sub-tile of Cs key groups per B --
#pragma unroll 1
      for (int u = 0; u < NREP; ++u) {
        if (uint32_t(u * Cs * 16) >= nvalid) break;
        // B column n = g: (q of head my_r) ⊙ (key scales of group u·Cs + my_c), as pieces;
        // bias = q · key minima, summed over the four quarters.
        uint32_t bf[PIECES][KSTEPS][2];
        float bias = 0.0f, unscale, unscale_big = 1.0f;  // of column g (qk_pieces.h)
        {
          const uint32_t grp = u * Cs + my_c;
          const uint4 *ks = reinterpret_cast<const uint4 *>(st + St::kKS + grp * 2 * D) + qi * (QC / 8);
          const uint4 *km = reinterpret_cast<const uint4 *>(st + St::kKM + grp * 2 * D) + qi * (QC / 8);
          float x[QC];
#pragma unroll
          for (int v = 0; v < QC / 8; ++v) {
            float s8[8], m8[8];
            unpack8<T>(ks[v], s8);
            unpack8<T>(km[v], m8);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              x[v * 8 + e] = q_reg[v * 8 + e] * s8[e];  // exact: 16-bit × 16-bit
              bias = fmaf(q_reg[v * 8 + e], m8[e], bias);
            }
          }
          // The column's max |x| over its four quarters sets the power-of-two prescale
          // sc[j] = 2^k · 4^-j, j = code position.
          float mx = 0.0f;
#pragma unroll
          for (int c = 0; c < QC; ++c) mx = fmaxf(mx, fabsf(x[c]));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
          const uint32_t e = f16_col_exp(mx);
          float sc[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) sc[j] = f16_col_scale(e, j);
          unscale = f16_col_unscale(e);
          if constexpr (Cfg::kWideExp) unscale_big = f16_col_unscale_big(e);
          // pair pr of the quarter = local channels (16·(pr/8) + pr%8, + 8), code position
          // pr mod 4; k-step ks uses pairs 2ks (k rows 2i, 2i+1) and 2ks + 1 (k rows 2i + 8,
          // 2i + 9), as the A side.
#pragma unroll
          for (int ks_ = 0; ks_ < KSTEPS; ++ks_) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int pr = 2 * ks_ + h, lo = 16 * (pr / 8) + pr % 8;
              f16_split_pair(x[lo] * sc[pr & 3], x[lo + 8] * sc[pr & 3], bf[0][ks_][h],
                             bf[1][ks_][h]);
            }
          }
        }
        bias += __shfl_xor_sync(kFullMask, bias, 1);
        bias += __shfl_xor_sync(kFullMask, bias, 2);
        const float bias0 = __shfl_sync(kFullMask, bias, 8 * qi);      // column 2i
        const float bias1 = __shfl_sync(kFullMask, bias, 8 * qi + 4);  // column 2i + 1
        const float us0 = __shfl_sync(kFullMask, unscale, 8 * qi);
        const float us1 = __shfl_sync(kFullMask, unscale, 8 * qi + 4);
        float ub0 = 1.0f, ub1 = 1.0f;
        if constexpr (Cfg::kWideExp) {
          ub0 = __shfl_sync(kFullMask, unscale_big, 8 * qi);
          ub1 = __shfl_sync(kFullMask, unscale_big, 8 * qi + 4);
        }

#pragma unroll
        for (int cm = 0; cm < Cs; ++cm) {
          const uint32_t grp = u * Cs + cm;
          const uint8_t *kc = st + St::kKC + grp * 4 * D + qi * (D / 16);
          uint32_t wg[QW], wg8[QW];
          if constexpr (QW == 2) {
            const uint2 a = *reinterpret_cast<const uint2 *>(kc + g * (D / 4));
            const uint2 b = *reinterpret_cast<const uint2 *>(kc + (g + 8) * (D / 4));
            wg[0] = a.x; wg[QW - 1] = a.y;
            wg8[0] = b.x; wg8[QW - 1] = b.y;
          } else {
            wg[0] = *reinterpret_cast<const uint32_t *>(kc + g * (D / 4));
            wg8[0] = *reinterpret_cast<const uint32_t *>(kc + (g + 8) * (D / 4));
          }
          uint32_t ag[QW * 8], ag8[QW * 8];
#pragma unroll
          for (int w = 0; w < QW; ++w) {
            uint32_t t8[8], u8[8];
            key_pairs_f16(wg[w], f16_magic, t8);
            key_pairs_f16(wg8[w], f16_magic, u8);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              ag[w * 8 + e] = t8[e];
              ag8[w * 8 + e] = u8[e];
            }
          }
          float d[NA][4];
#pragma unroll
          for (int a = 0; a < NA; ++a) d[a][0] = d[a][1] = d[a][2] = d[a][3] = 0.0f;
#pragma unroll
          for (int ks_ = 0; ks_ < KSTEPS; ++ks_) {
            const uint32_t af[4] = {ag[2 * ks_], ag8[2 * ks_], ag[2 * ks_ + 1], ag8[2 * ks_ + 1]};
#pragma unroll
            for (int pc = 0; pc < PIECES; ++pc)
              mma_16816<__half>(d[(pc + PIECES * (ks_ & 1)) % NA], af, bf[pc][ks_][0],
                                       bf[pc][ks_][1]);
          }
          // c0: (row g, col 2i), c1: (g, 2i + 1), c2: (g + 8, 2i), c3: (g + 8, 2i + 1); a
          // column n belongs to M-tile n / NREP (its key group) and head n % NREP.
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t col = 2 * qi + (e & 1), row = g + 8 * (e >> 1);
            // col / NREP == cm, spelled so that the compile-time part prunes e (n_rep = 1:
            // only the e of parity cm can be this lane's) and the rest does not depend on e.
            const bool mine = NREP == 1 ? ((e & 1) == (cm & 1) && qi == uint32_t(cm >> 1))
                                        : qi / (NREP / 2) == uint32_t(cm);
            if (mine) {
              float dot = 0.0f;
#pragma unroll
              for (int a = 0; a < NA; ++a) dot += d[a][e];
              dot *= (e & 1) ? us1 : us0;  // exact: powers of two
              if constexpr (Cfg::kWideExp) dot *= (e & 1) ? ub1 : ub0;
              const uint32_t tt = grp * 16 + row;
              p_s[tt * NREP + col % NREP] =
                  tt < nvalid ? (dot + ((e & 1) ? bias1 : bias0)) * p.scale_log2 : -INFINITY;
            }
          }
        }
      }
      __syncwarp();
      softmax_update<NREP, CPL>(p_s, nvalid, lane, m_run, l_run, acc, bacc);
      __syncwarp();  // QK is done with the K unit
      if (more) {
        issue_unit(tile + 1, k_unit, blk_next, src_k);
        cp_async_commit();
        cp_async_wait<1>();  // V(tile); K(tile + 1) may still be in flight
      } else {
        cp_async_wait<0>();
      }
      __syncwarp();

      // -- P·V̂ on CUDA cores --
      const uint8_t *sv = v_unit;
#pragma unroll(NREP <= 2 ? 4 : 2)
      for (uint32_t t = sub; t < nvalid; t += SUBSETS) {
        const uint32_t u = *reinterpret_cast<const uint32_t *>(sv + St::kVC + t * (D / 4) + 4 * gv) >> bo;
        const float s = DType<T>::to_float(reinterpret_cast<const T *>(sv + St::kVS)[t * (D / 16) + gv]);
        const float m = DType<T>::to_float(reinterpret_cast<const T *>(sv + St::kVM)[t * (D / 16) + gv]);
        const float s_up = s * kPvScale;  // exact: a power of two
        float pr[NREP], ps[NREP];
        load_probs<NREP>(p_s + t * NREP, pr);
#pragma unroll
        for (int r = 0; r < NREP; ++r) {
          ps[r] = pr[r] * s_up;
          bacc[r] = fmaf(pr[r], m, bacc[r]);
        }
        ValueCodes<CPL>::template fma<NREP>(u, ps, acc);
      }
      __syncwarp();  // the V unit and p_s are rewritten next
      if (more) {
        issue_unit(tile + 1, v_unit, blk_next, src_v);
        cp_async_commit();
        blk_next = group_block(tile + 2);  // consumed one tile later: latency hidden
      }
    }
  }
  // acc[r][k] · 4^-e(k) + Σ p·m: true units from here on.
  ValueCodes<CPL>::template finish<NREP>(acc, bacc);

  // ---- residual (16-bit) tokens: the last split ----
  // Chunks of 16 rows: K and V rows by cp.async into the K unit (K chunk v of row t stored at
  // v ^ (t mod D/8), so that lane = token reads are free of bank conflicts), q as fp32 in
  // the V unit; lanes t and t + 16 score token t over one half of the channels each, for
  // every head; P·V̂ as for the tiles.
  if (split + 1 == p.splits && nres > 0) {
    constexpr uint32_t kChunk = 16, kRowBytes = D * 2, kRowChunks = D / 8;
    const ResidualLayout &rl = p.st.res;
    const uint8_t *res_slot = p.st.residual + uint64_t(p.slot[seq]) * rl.bytes;
    const T *k_res = reinterpret_cast<const T *>(res_slot + rl.k) + uint64_t(kvh) * R * D;
    const T *v_res = reinterpret_cast<const T *>(res_slot + rl.v) + uint64_t(kvh) * R * D;
    uint8_t *k_s = stage_s[0], *v_s = stage_s[0] + kChunk * kRowBytes;
    float *q_f = reinterpret_cast<float *>(stage_s[1]);  // [NREP][D]
    const AppendedRow appended = appended_row(p, seq, kvh);  // its row: the caller's K/V
    for (uint32_t c8 = lane; c8 < NREP * D / 8; c8 += 32) {
      float f[8];
      unpack8<T>(reinterpret_cast<const uint4 *>(qg)[c8], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) q_f[c8 * 8 + e] = f[e];
    }
    for (uint32_t c0 = 0; c0 < nres; c0 += kChunk) {
      const uint32_t nv = min(kChunk, nres - c0);
      for (uint32_t c = lane; c < kChunk * kRowChunks; c += 32) {
        const uint32_t t = c / kRowChunks, v = c % kRowChunks;
        const uint32_t row = c0 + (t < nv ? t : 0);  // rows past nv: zeros
        const bool own = row == appended.row;
        const void *ks = own ? appended.k + v * 16 : static_cast<const void *>(k_res + uint64_t(row) * D + v * 8);
        const void *vs = own ? appended.v + v * 16 : static_cast<const void *>(v_res + uint64_t(row) * D + v * 8);
        cp_async_16(k_s + t * kRowBytes + (v ^ (t % kRowChunks)) * 16, ks, t < nv);
        cp_async_16(v_s + t * kRowBytes + v * 16, vs, t < nv);
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncwarp();
      {
        float lg[NREP];
#pragma unroll
        for (int r = 0; r < NREP; ++r) lg[r] = 0.0f;
        const uint32_t row = lane % kChunk, half = lane / kChunk;
        const uint8_t *krow = k_s + row * kRowBytes;
#pragma unroll 4
        for (uint32_t v = half * kRowChunks / 2; v < (half + 1) * kRowChunks / 2; ++v) {
          float kf[8];
          unpack8<T>(*reinterpret_cast<const uint4 *>(krow + (v ^ (row % kRowChunks)) * 16), kf);
#pragma unroll
          for (int r = 0; r < NREP; ++r) lg[r] = fma_dot(q_f + r * D + v * 8, kf, lg[r]);
        }
#pragma unroll
        for (int r = 0; r < NREP; ++r) lg[r] += __shfl_xor_sync(kFullMask, lg[r], kChunk);
        if (lane < kChunk)
#pragma unroll
          for (int r = 0; r < NREP; ++r) p_s[lane * NREP + r] = lane < nv ? lg[r] * p.scale_log2 : -INFINITY;
      }
      __syncwarp();
      softmax_update<NREP, CPL>(p_s, nv, lane, m_run, l_run, acc, bacc);  // reads t < nv only
      __syncwarp();
#pragma unroll 2
      for (uint32_t t = sub; t < nv; t += SUBSETS) {
        const uint4 *vrow = reinterpret_cast<const uint4 *>(v_s + t * kRowBytes + ch0 * 2);
        float pr[NREP];
        load_probs<NREP>(p_s + t * NREP, pr);
#pragma unroll
        for (int v = 0; v < CPL / 8; ++v) {
          float vf[8];
          unpack8<T>(vrow[v], vf);
#pragma unroll
          for (int r = 0; r < NREP; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][v * 8 + e] = fmaf(pr[r], vf[e], acc[r][v * 8 + e]);
        }
      }
      __syncwarp();  // k_s, v_s and p_s are rewritten by the next chunk
    }
  }

  // ---- sum the token subsets, write ----
#pragma unroll
  for (int off = LPR; off < 32; off <<= 1)
#pragma unroll
    for (int r = 0; r < NREP; ++r)
#pragma unroll
      for (int k = 0; k < CPL; ++k) acc[r][k] += __shfl_xor_sync(kFullMask, acc[r][k], off);
  float m_h[NREP], l_h[NREP];
#pragma unroll
  for (int r = 0; r < NREP; ++r) {
    m_h[r] = __shfl_sync(kFullMask, m_run, r);  // lane r owns head r
    l_h[r] = __shfl_sync(kFullMask, l_run, r);
  }
  if (sub == 0) {
#pragma unroll
    for (int r = 0; r < NREP; ++r) {
      const uint64_t head = uint64_t(seq) * p.num_heads + h0 + r;
      if (p.splits == 1) {
        const float inv = 1.0f / l_h[r];
        uint4 *o = reinterpret_cast<uint4 *>(static_cast<T *>(p.out) + head * D + ch0);
#pragma unroll
        for (int v = 0; v < CPL / 8; ++v) {
          uint4 w;
          w.x = output_pair<T>(acc[r][8 * v] * inv, acc[r][8 * v + 1] * inv);
          w.y = output_pair<T>(acc[r][8 * v + 2] * inv, acc[r][8 * v + 3] * inv);
          w.z = output_pair<T>(acc[r][8 * v + 4] * inv, acc[r][8 * v + 5] * inv);
          w.w = output_pair<T>(acc[r][8 * v + 6] * inv, acc[r][8 * v + 7] * inv);
          o[v] = w;
        }
      } else {
        const uint64_t part = head * p.splits + split;
        float4 *o = reinterpret_cast<float4 *>(p.part_o + part * D + ch0);
#pragma unroll
        for (int v = 0; v < CPL / 4; ++v)
          o[v] = make_float4(acc[r][4 * v], acc[r][4 * v + 1], acc[r][4 * v + 2], acc[r][4 * v + 3]);
        if (ch0 == 0) {
          p.part_ml[part * 2] = m_h[r];
          p.part_ml[part * 2 + 1] = l_h[r];
        }
      }
    }
  }
  if (fused_merge<NREP>(p.splits)) {
    __syncwarp();  // p_s is free: it holds the merge weights
    merge_if_last<T, D, NREP>(p, seq, kvh, lane, p_s);
  }
}

// The launchers; a CPU emulation (tests/emulation) runs the kernel itself.
#ifndef MINIKV_WARP_EMULATION
template <typename T, int D, int NREP>
void launch_fast_impl(minikv_dtype dtype, const DecodeParams &p, cudaStream_t stream) {
  const dim3 grid(p.splits, p.num_kv_heads, p.n);
  decode_fast_kernel<T, D, NREP><<<grid, 32, 0, stream>>>(p);
  check_launch_error("decode_fast_kernel");
  if (p.splits > 1 && !fused_merge<NREP>(p.splits)) launch_decode_merge(dtype, D, p, stream);
}

// fn(std::integral_constant<int, NREP>{}) for the compiled GQA group sizes.
template <typename Fn> void dispatch_n_rep(uint32_t n_rep, Fn &&fn) {
  switch (n_rep) {
    case 1: fn(std::integral_constant<int, 1>{}); return;
    case 2: fn(std::integral_constant<int, 2>{}); return;
    case 4: fn(std::integral_constant<int, 4>{}); return;
    case 8: fn(std::integral_constant<int, 8>{}); return;
    default: fail(MINIKV_ERR_INTERNAL, "minikv_decode: fast path for n_rep %u not compiled", n_rep);
  }
}
#endif  // MINIKV_WARP_EMULATION

}  // namespace

#ifndef MINIKV_WARP_EMULATION
bool decode_fast_path(const BlockLayout &bl, const ResidualLayout &rl, uint32_t n_rep) {
  return bl.key_bits == 2 && bl.value_bits == 2 && bl.group == 16 && bl.elem_bytes == 2 &&
         rl.sink_tokens == 0 &&
         in_list(FastDecodeHeadDims{}, bl.head_dim) && head_dim_compiled(bl.head_dim) &&
         (n_rep == 1 || n_rep == 2 || n_rep == 4 || n_rep == 8);
}

uint32_t decode_fast_ctas_per_sm(minikv_dtype dtype, uint32_t head_dim, uint32_t n_rep) {
  int blocks = 0;
  dispatch_dtype_head_dim<FastDecodeHeadDims>(dtype, head_dim, "minikv_cache_create",
                                              [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    dispatch_n_rep(n_rep, [&](auto nr) {
      constexpr int NREP = decltype(nr)::value;
      MINIKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &blocks, decode_fast_kernel<T, D, NREP>, 32, 0));
    });
  });
  return static_cast<uint32_t>(blocks > 0 ? blocks : 1);
}

void launch_decode_fast(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                        cudaStream_t stream) {
  dispatch_dtype_head_dim<FastDecodeHeadDims>(dtype, head_dim, "minikv_decode",
                                              [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    dispatch_n_rep(p.num_heads / p.num_kv_heads, [&](auto nr) {
      launch_fast_impl<T, D, decltype(nr)::value>(dtype, p, stream);
    });
  });
}

#endif  // MINIKV_WARP_EMULATION

}  // namespace kernels
}  // namespace minikv

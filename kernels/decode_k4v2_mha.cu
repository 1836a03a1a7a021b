// Decode attention for the default storage (4-bit keys, 2-bit values, G = 32; attention
// sinks and the 16-bit residual) under MHA, sm_90: one warp per CTA, one CTA per (split, KV
// head = query head, sequence), walking whole 128-token tiles with no CTA barrier.
//
// decode_k4v2.cu fills the mma's N columns with up to 8 query heads of a GQA group; with one
// head they are mostly padding, and its four warps pay three CTA barriers and a key operand
// of four head slots per tile for it. Here the columns hold the tile's key groups instead:
//
// QK (M = 16 tokens of one key group, N = (key group kg, hi / lo piece), K = channels in the
//   key-pair order of decode_operands.cuh, mma.sync m16n8k16 f16): A = the codes as fp16
//   subnormals (one LOP3 per pair, the rows as the block stores them). B column n = q ⊙ s_k
//   of key group n / 2 in the exact hi + lo fp16 pieces of decode_mma.cuh (piece n % 2),
//   built once per tile by the lanes that own the column. An M-tile's logits are the sum of
//   its key group's two columns: lanes i = kg hold them (tokens g, g + 8 of the M-tile).
//   The bias q · m_k of every group is one mma<T> of exact products per k-step (A = the
//   tile's key minima, one group per row; B = q).
// Softmax: one running max for the warp; lane (g, i) owns the probabilities of tokens g and
//   g + 8 of M-tiles 2i and 2i + 1.
// PV (M = channels, N = the span's two value groups, K = tokens): decode_k4v2.cu's P·V with
//   the four channel subsets of its four warps (8g + 2j, 8g + 2j + 1 of a 64-channel span,
//   j < 4) taken by this warp in turn; B = fp16(p · s_v · 2^Sv) (the one rounding MINIKV.md
//   allows), written by the lanes that hold p; Σ p · m_v on the CUDA cores.
// 16-bit rows (sinks, residual; tiles of kK4V2RowTile rows): on the CUDA cores in fp32,
//   lane = row for QK, lane = D / 32 channels for P·V (no rounding of p).
// Tiles are staged by bulk copies (cp.async.bulk + one mbarrier per stage) issued by the warp
// itself, two stages. Error against the CPU backend's fp32 decode: decode_mma.cuh's bounds
// (the same operands and roundings for quantized rows; 16-bit rows are exact fp32 products).
#include <type_traits>

#include "bulk_copy.cuh"
#include "common.cuh"
#include "decode_common.cuh"
#include "decode_k4v2.cuh"
#include "decode_operands.cuh"
#include "dispatch.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

constexpr uint32_t kMhaStages = 2;

// Shared memory of one CTA (one warp) at head_dim D, 16-bit dtypes; byte offsets.
template <uint32_t D> struct K4V2MhaLayout {
  static constexpr uint32_t kVG = D / kK4V2Group;
  // Quantized stage: the tile's rows as the block stores them (one bulk copy per region).
  static constexpr uint32_t kKCodes = 0;
  static constexpr uint32_t kVCodes = kKCodes + kK4V2MaxTile * D / 2;
  static constexpr uint32_t kKScale = kVCodes + kK4V2MaxTile * D / 4;
  static constexpr uint32_t kKMin = kKScale + kK4V2MaxTile / kK4V2Group * D * 2;
  static constexpr uint32_t kVScale = kKMin + kK4V2MaxTile / kK4V2Group * D * 2;
  static constexpr uint32_t kVMin = kVScale + kK4V2MaxTile * kVG * 2;
  static constexpr uint32_t kQuantBytes = kVMin + kK4V2MaxTile * kVG * 2;
  // 16-bit stage: K rows kRowK apart (an odd number of 16-byte units: lane = row reads
  // without conflicts), then V rows packed (lane = channels reads whole rows).
  static constexpr uint32_t kRowK = k4v2_odd_stride(D * 2);
  static constexpr uint32_t kRowV = kK4V2RowTile * kRowK;
  static constexpr uint32_t kRowBytes = kRowV + kK4V2RowTile * D * 2;
  static constexpr uint32_t kStageBytes = k4v2_align(kQuantBytes > kRowBytes ? kQuantBytes : kRowBytes, 128);
  // P·V's B: [span][value group of the span][k position] fp16.
  static constexpr uint32_t kBpvStride = k4v2_odd_stride(kK4V2MaxTile * 2);
  static constexpr uint32_t kBpvSpan = 2 * kBpvStride;
  static constexpr uint32_t kBpv = kMhaStages * kStageBytes;
  static constexpr uint32_t kQ2 = kBpv + D / 64 * kBpvSpan;  // [quarter][D / 8] q' pairs (fp16x2)
  static constexpr uint32_t kQn = kQ2 + 4 * (D / 8) * 4;      // [D] dtype: q
  static constexpr uint32_t kQf = kQn + D * 2;                // [D] fp32: q, at the end the 16-bit rows' P·V
  static constexpr uint32_t kMbar = k4v2_align(kQf + D * 4, 8);
  static constexpr uint32_t kTotal = kMbar + kMhaStages * 8;
};
static_assert(K4V2MhaLayout<128>::kRowBytes <= K4V2MhaLayout<128>::kQuantBytes &&
                  K4V2MhaLayout<64>::kRowBytes <= K4V2MhaLayout<64>::kQuantBytes,
              "a 16-bit tile must fit a quantized stage");
template <uint32_t D> constexpr bool k4v2_mha_aligned() {
  using L = K4V2MhaLayout<D>;
  return L::kVCodes % 16 == 0 && L::kKScale % 16 == 0 && L::kKMin % 16 == 0 && L::kVScale % 16 == 0 &&
         L::kVMin % 16 == 0 && L::kRowV % 16 == 0 && L::kStageBytes % 16 == 0 && L::kBpv % 16 == 0 &&
         L::kQ2 % 16 == 0 && L::kQn % 16 == 0 && L::kQf % 16 == 0 && L::kMbar % 8 == 0;
}
static_assert(k4v2_mha_aligned<64>() && k4v2_mha_aligned<128>(), "decode_k4v2_mha's regions must stay 16-byte aligned");

// Staging tile `tr` into the stage at shared address dst, completed on barrier `bar` (one
// arrival per phase, lane 0's): six bulk copies for a quantized tile (key codes, value codes,
// key scales and minima, value scales and minima), two per row for a 16-bit tile, the row of
// the token appended in this launch from the caller's buffer.
template <int D>
__device__ __forceinline__ void k4v2_mha_stage(const K4V2Args &a, const TileRef &tr, const uint8_t *block,
                                               const uint8_t *res_slot, uint32_t kvh, const HeadRegions &hr,
                                               uint32_t dst, uint32_t bar, uint32_t lane) {
  using L = K4V2MhaLayout<D>;
  const DecodeParams &p = a.p;
  constexpr uint32_t VG = D / kK4V2Group;
  if (tr.segment == kSegQuantized) {
    if (lane != 0) return;
    const uint32_t row0 = tr.first - a.block_tokens.div(tr.first) * p.st.block.tokens;
    const uint32_t n = tr.count;  // a multiple of G; the tile lies in one block
    const uint32_t kc = n * D / 2, vc = n * D / 4, ks = n / kK4V2Group * D * 2, vs = n * VG * 2;
    const uint32_t kat = row0 / kK4V2Group * D * 2, vat = row0 * VG * 2;
    bulk::mbar_arrive_expect_tx(bar, kc + vc + 2 * ks + 2 * vs);
    bulk::copy(dst + L::kKCodes, block + hr.k_codes + row0 * (D / 2), kc, bar);
    bulk::copy(dst + L::kVCodes, block + hr.v_codes + row0 * (D / 4), vc, bar);
    bulk::copy(dst + L::kKScale, block + hr.k_scale + kat, ks, bar);
    bulk::copy(dst + L::kKMin, block + hr.k_min + kat, ks, bar);
    bulk::copy(dst + L::kVScale, block + hr.v_scale + vat, vs, bar);
    bulk::copy(dst + L::kVMin, block + hr.v_min + vat, vs, bar);
  } else {
    const RowTileSource src = row_tile_source(p, tr, res_slot, kvh);
    constexpr uint32_t kRow = D * 2;
    if (lane == 0) bulk::mbar_arrive_expect_tx(bar, 2 * tr.count * kRow);
    __syncwarp();
    const uint32_t r = lane;
    if (r < tr.count) {
      const bool sub = r == src.sub;
      bulk::copy(dst + r * L::kRowK, sub ? src.sub_k : src.k + r * kRow, kRow, bar);
      bulk::copy(dst + L::kRowV + r * kRow, sub ? src.sub_v : src.v + r * kRow, kRow, bar);
    }
  }
}

/// \tparam T dtype of q/out, scales and 16-bit rows (__half or __nv_bfloat16)
/// \tparam D head_dim (64 or 128)
template <typename T, int D>
__global__ void __launch_bounds__(32) decode_k4v2_mha_kernel(const __grid_constant__ K4V2Args a) {
#if __CUDA_ARCH__ >= 900
  using KP = KeyPairs<4>;
  using L = K4V2MhaLayout<D>;
  constexpr int KS = D / 16;          // 16-channel k-steps of a key row
  constexpr int S = D / 64;           // 64-channel spans of a value row
  constexpr int VG = D / kK4V2Group;  // value groups of a token
  constexpr int QP = D / 8;           // key pairs in a quarter of a key row
  constexpr int CL = D / 32;          // channels per lane in the 16-bit rows' P·V
  constexpr int kMTiles = kK4V2MaxTile / 16;
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");

  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t smem_s = smem_addr(smem);
  const DecodeParams &p = a.p;
  const uint32_t lane = threadIdx.x, gq = lane >> 2, qi = lane & 3;
  // n_rep = 1: the KV head is the query head.
  const uint32_t split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const uint64_t head = uint64_t(seq) * p.num_heads + kvh;

  T *qn = reinterpret_cast<T *>(smem + L::kQn);
  float *qf = reinterpret_cast<float *>(smem + L::kQf);
  uint32_t *q2s = reinterpret_cast<uint32_t *>(smem + L::kQ2);
  uint8_t *bpv = smem + L::kBpv;
  const uint32_t bar0 = smem_s + L::kMbar;

  // q as the dtype (the bias mma's B) and as fp32 (the 16-bit rows); the stages' barriers.
  const T *qg = static_cast<const T *>(p.q) + head * D;
  for (uint32_t c8 = lane; c8 < D / 8; c8 += 32) {
    const uint4 v = reinterpret_cast<const uint4 *>(qg)[c8];
    reinterpret_cast<uint4 *>(qn)[c8] = v;
    float f[8];
    unpack8<T>(v, f);
    reinterpret_cast<float4 *>(qf)[2 * c8] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4 *>(qf)[2 * c8 + 1] = make_float4(f[4], f[5], f[6], f[7]);
  }
  if (lane == 0) {
    for (uint32_t s = 0; s < kMhaStages; ++s) bulk::mbar_init(bar0 + 8 * s, 1);
    bulk::fence_mbar_init();
  }
  __syncwarp();
  // q' = q · 2^(kq − offset) in key-pair order, fp16 pairs: the offset is the pair's code
  // position (decode_operands.cuh: 0 for even channels of a word, 4 for odd ones), kq puts
  // max |q · 2^-offset| into [2^6, 2^7).
  float mx = 0.0f;
#pragma unroll
  for (int c = 0; c < D / 32; ++c) {
    const uint32_t ch = lane + 32 * c;  // lane's parity is the channel's
    mx = fmaxf(mx, fabsf(qf[ch]) * (ch & 1 ? 1.0f / 16 : 1.0f));
  }
  mx = warp_max(mx);
  const int kq = mx > 0.0f ? clamp_exp(6 - exponent_of(mx), 100) : 0;
  const float uq = pow2i(12 - kq);
#pragma unroll
  for (int j = 0; j < D / 64; ++j) {
    const uint32_t idx = lane + 32 * j, quarter = idx / QP, P = idx % QP;
    const uint32_t lo = quarter * (D / 4) + KP::lo(P), hi = quarter * (D / 4) + KP::hi(P);
    const float f = pow2i(kq - int(4 * (lo & 1)));
    q2s[idx] = pack_f16(qf[lo] * f, qf[hi] * f);
  }
  __syncwarp();

  const SequenceTiles<K4V2Tiles> tiles(p.sinks[seq], p.quantized[seq], p.residual[seq], a.tiles);
  const SplitTiles range(tiles.total, p.splits, split);
  const uint32_t t_begin = range.begin, t_end = range.end;
  const SequenceSlot sslot(p, seq);
  const int32_t *table = sslot.table;
  const uint8_t *res_slot = sslot.residual;
  const HeadRegions regions(p.st.block, kvh);

  // Quantized values: acc[span][j] is the C fragment of channels 64s + 8g + 2j (row g) and
  // + 1 (row g + 8), columns = the span's value groups, units 2^(off − 24 − Sv) (off: the
  // code's bit offset, 4 (j mod 2) + 2 · row half). 16-bit rows: acc16, channels CL · lane + c.
  float acc[S][4][4], acc16[CL], vb[VG];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[s][j][c] = 0.0f;
#pragma unroll
  for (int c = 0; c < CL; ++c) acc16[c] = 0.0f;
#pragma unroll
  for (int j = 0; j < VG; ++j) vb[j] = 0.0f;
  float m_run = -INFINITY, l_part = 0.0f;
  int Sv = 0;
  bool sv_set = false;

  if (split == 0) store_appended_row(p, seq, kvh, lane, 32);

  // Rescales the running state to the max m_new (and, for quantized values, to 2^Sv' / 2^Sv);
  // returns the subtrahend of the new probabilities' exponent.
  auto rescale_to = [&](float m_new, float rescale) {
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    const float corr = ex2(m_run - base);  // 0 while m_run is -inf
    m_run = m_new;
    l_part *= corr;
    const float cq = corr * rescale;
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[s][j][c] *= cq;
#pragma unroll
    for (int c = 0; c < CL; ++c) acc16[c] *= corr;
#pragma unroll
    for (int j = 0; j < VG; ++j) vb[j] *= corr;
    return base;
  };

  for (uint32_t s = 0; s < kMhaStages; ++s)
    if (t_begin + s < t_end) {
      const TileRef tr = tiles.tile(t_begin + s, a.tiles);
      k4v2_mha_stage<D>(a, tr, k4v2_block_of(a, tr, table), res_slot, kvh, regions,
                        smem_s + s * L::kStageBytes, bar0 + 8 * s, lane);
    }
  const uint8_t *next_block =
      t_begin + kMhaStages < t_end ? k4v2_block_of(a, tiles.tile(t_begin + kMhaStages, a.tiles), table) : nullptr;
  uint32_t phases = 0, buf = 0;
  for (uint32_t ti = t_begin; ti < t_end; ++ti) {
    bulk::mbar_wait(bar0 + 8 * buf, (phases >> buf) & 1u);
    phases ^= 1u << buf;
    const uint8_t *stage = smem + buf * L::kStageBytes;
    const TileRef tr = tiles.tile(ti, a.tiles);
    const uint32_t count = tr.count;

    if (tr.segment == kSegQuantized) {
      const uint32_t groups = count / kK4V2Group;
      // 1. QK's B: lane (g, i) owns column g = (key group g / 2, piece g % 2) at the k
      //    positions of quarter i's pairs; the group's largest scale sets its 2^ks.
      const uint32_t kg = gq >> 1;
      const bool kg_live = kg < groups;
      uint32_t bq[KS][2];
      float us;
      {
        uint32_t sw[D / 8];  // quarter i of the group's key scales (dtype pairs)
        load_words(stage + L::kKScale + (kg_live ? kg : 0) * D * 2 + qi * (D / 4) * 2, sw);
        // Lanes 8kg .. 8kg + 7 hold the group's four quarters (twice).
        const int ks = key_scale_exponent<T, 4>(sw);
        us = pow2i(12 - ks);
        uint32_t q2[QP], s2[QP];
        load_words(q2s + qi * QP, q2);
        scaled_key_scales<T, 4>(sw, ks, s2);
        const bool lo_piece = gq & 1;
#pragma unroll
        for (int P = 0; P < QP; ++P) {
          const uint32_t h = hmul2_bits(q2[P], s2[P]);
          const uint32_t piece = lo_piece ? hfms2_bits(q2[P], s2[P], h) : h;
          bq[P / 2][P & 1] = kg_live ? piece : 0u;
        }
      }
      // 2. The bias q · m_k of every key group: A rows = the groups' minima, B = q.
      float bias;
      {
        float cb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const bool live = gq < groups;
        const uint8_t *mrow = stage + L::kKMin + (live ? gq : 0) * D * 2;
        const uint8_t *qb = reinterpret_cast<const uint8_t *>(qn);
#pragma unroll
        for (int k = 0; k < KS; ++k) {
          const uint32_t c = 16 * k + 2 * qi;
          const uint32_t av[4] = {live ? lds32(mrow + 2 * c) : 0u, 0u, live ? lds32(mrow + 2 * (c + 8)) : 0u, 0u};
          mma_16816<T>(cb, av, lds32(qb + 2 * c), lds32(qb + 2 * (c + 8)));
        }
        bias = __shfl_sync(kFull, cb[0], 4 * qi);  // row qi: key group qi, the lane's own
      }
      us = __shfl_sync(kFull, us, 8 * qi);  // lanes 8i .. 8i + 7 built group i's columns
      const float un = uq * us * p.scale_log2, bl2 = bias * p.scale_log2;

      // 3. Logits: M-tile m holds tokens 16m .. 16m + 15 (key group m / 2); lane (g, i) keeps
      //    rows g and g + 8 of M-tiles 2i and 2i + 1.
      float lg[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        if (uint32_t(m) >= 2 * groups) break;
        uint32_t w0[D / 32], w1[D / 32];
        load_key_quarter<D>(stage + L::kKCodes + (16 * m + gq) * (D / 2) + qi * (D / 8), w0);
        load_key_quarter<D>(stage + L::kKCodes + (16 * m + gq + 8) * (D / 2) + qi * (D / 8), w1);
        float d[2][4] = {};  // k-step parity: two independent chains
#pragma unroll
        for (int k = 0; k < KS; ++k) {
          const uint32_t av[4] = {KP::code_pair(w0[(2 * k) / 4], 2 * k), KP::code_pair(w1[(2 * k) / 4], 2 * k),
                                  KP::code_pair(w0[(2 * k + 1) / 4], 2 * k + 1),
                                  KP::code_pair(w1[(2 * k + 1) / 4], 2 * k + 1)};
          mma_16816<__half>(d[k & 1], av, bq[k][0], bq[k][1]);
        }
        if (uint32_t(m >> 1) == qi) {  // columns 2i, 2i + 1: this M-tile's group, hi + lo
          lg[m & 1][0] = fmaf((d[0][0] + d[0][1]) + (d[1][0] + d[1][1]), un, bl2);
          lg[m & 1][1] = fmaf((d[0][2] + d[0][3]) + (d[1][2] + d[1][3]), un, bl2);
        }
      }

      // 4. The value scales and minima of the lane's four tokens; the tile's largest scale.
      const bool mine = qi < groups;
      uint32_t svw[2][2][(VG + 1) / 2], mvw[2][2][(VG + 1) / 2];
      uint32_t vmx_bits = 0;
#pragma unroll
      for (int mm = 0; mm < 2; ++mm)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t t = mine ? 16 * (2 * qi + mm) + gq + 8 * r : 0;
          load_value_scales<VG>(stage + L::kVScale + t * VG * 2, stage + L::kVMin + t * VG * 2, svw[mm][r], mvw[mm][r]);
#pragma unroll
          for (int j = 0; j < VG / 2; ++j) vmx_bits = __vmaxu2(vmx_bits, mine ? svw[mm][r][j] & 0x7fff7fffu : 0u);
        }

      // 5. Softmax: the warp's max; Sv lowered where this tile's scales need it.
      float tmax = fmaxf(fmaxf(lg[0][0], lg[0][1]), fmaxf(lg[1][0], lg[1][1]));
      tmax = warp_max(tmax);
      const float vt = warp_max(elem_to_float<T>(max(vmx_bits & 0xffffu, vmx_bits >> 16), 0));
      float rescale = 1.0f;
      if (vt > 0.0f) {
        const int want = clamp_exp(14 - exponent_of(vt), 60);
        const int sv_new = sv_set ? min(Sv, want) : want;
        sv_set = true;
        rescale = pow2i(sv_new - Sv);
        Sv = sv_new;
      }
      const float base = rescale_to(fmaxf(m_run, tmax), rescale);
      float pr[2][2];
#pragma unroll
      for (int mm = 0; mm < 2; ++mm)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          pr[mm][r] = ex2(lg[mm][r] - base);  // 0 where masked
          l_part += pr[mm][r];
        }

      // 6. P·V's B (k positions 2g, 2g + 1 of k-step m are tokens g, g + 8 of M-tile m) and
      //    Σ p · m_v, by the lanes that hold p.
      if (mine) {
        const float unit = pow2i(Sv);
#pragma unroll
        for (int mm = 0; mm < 2; ++mm) {
          const uint32_t kpos = 16 * (2 * qi + mm) + 2 * gq;
          const float p0 = pr[mm][0], p1 = pr[mm][1];
#pragma unroll
          for (int j = 0; j < VG; ++j) {
            const float s0 = elem_to_float<T>(svw[mm][0][j / 2], j & 1) * unit;
            const float s1 = elem_to_float<T>(svw[mm][1][j / 2], j & 1) * unit;
            sts32(bpv + (j / 2) * L::kBpvSpan + (j & 1) * L::kBpvStride + 2 * kpos, pack_f16(p0 * s0, p1 * s1));
            vb[j] = fmaf(p0, elem_to_float<T>(mvw[mm][0][j / 2], j & 1),
                         fmaf(p1, elem_to_float<T>(mvw[mm][1][j / 2], j & 1), vb[j]));
          }
        }
      }
      __syncwarp();

      // 7. P·V over the tile's k-steps: channel subsets j = 0 .. 3 of each span in turn.
      {
        const uint8_t *vc = stage + L::kVCodes;
        // ldmatrix.trans row addresses: matrix mi = (K half, span), row = K position → token.
        const uint32_t mi = lane >> 3, pp = (mi & 1) * 8 + (lane & 7);
        const uint32_t tok = (pp & 1) ? pp / 2 + 8 : pp / 2;
        const uint8_t *vaddr = vc + tok * (D / 4) + (S > 1 ? (mi >> 1) * 16 : 0);
        // B rows n = 0 .. 7 read the span's two value-group rows alternately: column n is
        // value group n % 2 of the span, so C holds both in every lane.
        const uint8_t *baddr = bpv + (lane & 1) * L::kBpvStride + 8 * (lane >> 3) * 2;
        for (uint32_t kk = 0; kk < count / 16; kk += 2) {
          uint32_t b[S][4];
#pragma unroll
          for (int s = 0; s < S; ++s) ldmatrix_x4(b[s], baddr + s * L::kBpvSpan + 16 * kk * 2);
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            uint32_t R[4];
            ldmatrix_x4_trans(R, vaddr + (16 * (kk + h2)) * (D / 4));
#pragma unroll
            for (int s = 0; s < S; ++s) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const uint32_t lo = j >= 2 ? R[2 * s] >> 8 : R[2 * s], hi = j >= 2 ? R[2 * s + 1] >> 8 : R[2 * s + 1];
                const uint32_t m0 = (3u << (4 * (j & 1))) * 0x00010001u, m1 = m0 << 2;
                const uint32_t av[4] = {lo & m0, lo & m1, hi & m0, hi & m1};
                mma_16816<__half>(acc[s][j], av, b[s][2 * h2], b[s][2 * h2 + 1]);
              }
            }
          }
        }
      }
    } else {
      // 16-bit rows: lane = row for the logits, fp32 products of q and the K row.
      float lgt = -INFINITY;
      if (lane < count) {
        const uint4 *krow = reinterpret_cast<const uint4 *>(stage + lane * L::kRowK);
        const float4 *q4 = reinterpret_cast<const float4 *>(qf);
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int v = 0; v < D / 8; ++v) {
          float kf[8];
          unpack8<T>(krow[v], kf);
          const float4 qa = q4[2 * v], qb = q4[2 * v + 1];
          part[v & 3] = fmaf(qa.x, kf[0], part[v & 3]);
          part[v & 3] = fmaf(qa.y, kf[1], part[v & 3]);
          part[v & 3] = fmaf(qa.z, kf[2], part[v & 3]);
          part[v & 3] = fmaf(qa.w, kf[3], part[v & 3]);
          part[v & 3] = fmaf(qb.x, kf[4], part[v & 3]);
          part[v & 3] = fmaf(qb.y, kf[5], part[v & 3]);
          part[v & 3] = fmaf(qb.z, kf[6], part[v & 3]);
          part[v & 3] = fmaf(qb.w, kf[7], part[v & 3]);
        }
        lgt = ((part[0] + part[1]) + (part[2] + part[3])) * p.scale_log2;
      }
      const float base = rescale_to(fmaxf(m_run, warp_max(lgt)), 1.0f);
      const float pt = ex2(lgt - base);  // 0 past the tile
      l_part += pt;
      const uint8_t *vcol = stage + L::kRowV + lane * CL * 2;
      for (uint32_t t = 0; t < count; ++t) {
        const float pb = __shfl_sync(kFull, pt, t);
        float vf[CL];
        if constexpr (CL == 4) {
          const uint2 u = *reinterpret_cast<const uint2 *>(vcol + t * D * 2);
          const float2 a0 = word_to_float2(u.x, T{}), a1 = word_to_float2(u.y, T{});
          vf[0] = a0.x; vf[1] = a0.y; vf[2] = a1.x; vf[3] = a1.y;
        } else {
          const float2 a0 = word_to_float2(lds32(vcol + t * D * 2), T{});
          vf[0] = a0.x; vf[1] = a0.y;
        }
#pragma unroll
        for (int c = 0; c < CL; ++c) acc16[c] = fmaf(pb, vf[c], acc16[c]);
      }
    }

    __syncwarp();  // every lane is done with the stage and with P·V's B
    if (ti + kMhaStages < t_end) {
      k4v2_mha_stage<D>(a, tiles.tile(ti + kMhaStages, a.tiles), next_block, res_slot, kvh, regions,
                        smem_s + buf * L::kStageBytes, bar0 + 8 * buf, lane);
      next_block = ti + kMhaStages + 1 < t_end
                       ? k4v2_block_of(a, tiles.tile(ti + kMhaStages + 1, a.tiles), table)
                       : nullptr;
    }
    buf ^= 1u;
  }

  // The sum and Σ p · m_v over the lanes; the 16-bit rows' output through shared memory (q
  // is no longer read), to the lanes that hold the quantized output of the same channels.
  const float l = warp_sum(l_part);
  float VB[VG];
#pragma unroll
  for (int j = 0; j < VG; ++j) VB[j] = warp_sum(vb[j]);
  __syncwarp();
#pragma unroll
  for (int c = 0; c < CL; ++c) qf[CL * lane + c] = acc16[c];
  __syncwarp();
  // Lane (g, i) writes channel subset j = i: channels 64s + 8g + 2i + r, value group 2s + g / 4
  // (column parity g / 4 of its C fragment).
  const uint32_t col = gq >> 2;
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float q = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (uint32_t(j) == qi) q = col ? acc[s][j][2 * r + 1] : acc[s][j][2 * r];
      const uint32_t ch = 64 * s + 8 * gq + 2 * qi + r;
      const int off = int(4 * (qi & 1) + 2 * r);  // the code's bit offset in its fp16 half
      const float o = fmaf(q, pow2i(24 - off - Sv), (col ? VB[2 * s + 1] : VB[2 * s]) + qf[ch]);
      store_decode_result<T, D>(p, head, split, ch, m_run, o, l);
    }
#endif
}

template <typename Fn> void dispatch_k4v2_mha(minikv_dtype dtype, uint32_t head_dim, Fn &&fn) {
  dispatch_dtype_head_dim<K4V2DecodeHeadDims>(dtype, head_dim, "minikv_decode", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    fn(decode_k4v2_mha_kernel<T, D>, K4V2MhaLayout<D>::kTotal);
  });
}

}  // namespace

bool decode_k4v2_mha_path(const BlockLayout &bl, uint32_t n_rep) {
  return n_rep == 1 && decode_k4v2_path(bl, n_rep);
}

uint32_t configure_decode_k4v2_mha(minikv_dtype dtype, const BlockLayout &bl) {
  int blocks = 0;
  bool sm90 = false;
  dispatch_k4v2_mha(dtype, bl.head_dim, [&](auto kernel, uint32_t smem) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || attr.binaryVersion < 90) return;
    sm90 = true;
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
    MINIKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 32, smem));
  });
  (void)cudaGetLastError();  // a failed attribute query leaves no sticky error
  return sm90 ? static_cast<uint32_t>(blocks > 0 ? blocks : 1) : 0u;
}

void launch_decode_k4v2_mha(minikv_dtype dtype, const DecodeParams &p, const K4V2LaunchPlan &plan,
                            cudaStream_t stream) {
  const K4V2Args args{p, plan.tiles, plan.block_tokens};
  dispatch_k4v2_mha(dtype, p.st.block.head_dim, [&](auto kernel, uint32_t smem) {
    kernel<<<dim3(p.splits, p.num_kv_heads, p.n), 32, smem, stream>>>(args);
    check_launch_error("decode_k4v2_mha_kernel");
  });
  if (p.splits > 1) launch_decode_merge(dtype, p.st.block.head_dim, p, stream);
}

}  // namespace kernels
}  // namespace minikv

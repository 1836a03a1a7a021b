// Decode attention for the default storage (4-bit keys, 2-bit values, G = 32; attention
// sinks and the 16-bit residual), and for storage of KB-bit keys, VB-bit values and group G
// (k4v2_warp_storage), sm_90: one warp per CTA, one CTA per (split, KV head × chunk of NH query
// heads, sequence), walking whole tiles (128 tokens, 64 above 6 bits of key + value) with no CTA
// barrier. NH = 1 for MHA, 2 for groups of two, 4 for larger groups (in chunks of four heads).
//
// decode_k4v2.cu fills the mma's N columns with (head slot, hi / lo piece) of 4 or 8 head
// slots, and its four warps pay three CTA barriers per tile to share the work; under MHA
// three of its four slots are padding. Here the columns hold (key group, head slot, piece),
// so none is padding for any NH:
//
// QK (M = 16 tokens of one key group, N = 8 columns, K = channels in the key-pair order of
//   decode_operands.cuh, mma.sync m16n8k16 f16): A = the codes as fp16 subnormals (one LOP3
//   per pair, the rows as the block stores them). Column n of a B operand is q ⊙ s_k of head
//   slot (n / 2) mod NH and key group n / (2 NH) of the operand's 4 / NH groups, in the exact
//   hi + lo fp16 pieces of decode_mma.cuh (piece n mod 2); lane (g, i) builds column g, NH
//   operands per tile. A logit is the sum of a column pair: lane (g, i) keeps head slot
//   i mod NH's logits of tokens g, g + 8 of the M-tiles of the operand's group i / NH. The
//   bias q · m_k of every (group, head) is one mma<T> of exact products per k-step (A = the
//   tile's key minima, one group per row; B column n = q of head slot n mod NH).
// Softmax: a running max per head slot, over the lanes i ≡ slot (mod NH).
// PV (M = channels, N = (head slot, value group of the span), K = tokens): decode_k4v2.cu's
//   P·V with the four channel subsets of its four warps (at 2-bit values 8g + 2j, 8g + 2j + 1
//   of a 64-channel span, j < 4; step 5 for the others) taken by this warp in turn, A = the
//   codes as fp16 subnormals (one LOP3 per pair); B = fp16(p · s_v · 2^Sv) (the one rounding
//   MINIKV.md allows), written by the lanes that hold p; Σ p · m_v on the CUDA cores. Every
//   lane's C columns 2i, 2i + 1 are its head slot's two value groups.
// G = 16: keys walk 16-token units (one M-tile and key group each), and a span's four value
//   groups make P·V's N 4 · NH columns: B rows laid out so that a lane's columns stay its
//   head slot's, two n-tiles at four slots (their B rows unpadded and swizzled: bpv_offset).
// 16-bit rows (sinks, residual; tiles of kK4V2RowTile ≤ 32 rows) on the tensor cores too: QK
//   an mma<T> of the K rows (M = rows) against q (column n = head slot (n / 2) mod NH), exact
//   products, so each lane's logits are the quantized tiles' (head slot hh, rows g and g + 8);
//   P·V an mma<T> of the V rows (M = channels, ldmatrix.trans) against p (ProbOperand: fp16 ·
//   2^12, or bf16 in two pieces), accumulated apart from the quantized values.
// Tiles are staged by bulk copies (cp.async.bulk + an mbarrier) issued by the warp itself,
// one stage (kWarpStages). Error against the CPU backend's fp32 decode: decode_mma.cuh's bounds
// (the same operands and roundings: p · s_v for quantized rows, p for 16-bit rows, each
// rounded once).
#include <type_traits>

#include "bulk_copy.cuh"
#include "common.cuh"
#include "decode_common.cuh"
#include "decode_k4v2.cuh"
#include "decode_operands.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "programmatic_launch.h"

namespace minikv {
namespace kernels {
namespace {

// One stage: a CTA waits for its tile's copies, and the other CTAs of the SM hide the wait.
// That fits 11-12 CTAs per SM (shared memory) instead of the 5-6 of two stages, and
// measured faster at every shape of the decode matrix (MHA 75% of cuDNN's bytes/s against
// 63%, GQA 32/8 37% against 32%: B 8, L 32K, H200, bench/results).
constexpr uint32_t kWarpStages = 1;

// Shared memory of one CTA (one warp) at head_dim D with NH head slots, KB-bit keys and
// VB-bit values, 16-bit dtypes; byte offsets. Kept to the stage and the queries so that 11-12
// CTAs fit an SM at the default storage: the warp waits for each tile's copies, and the other
// CTAs hide the wait (registers allow 12 and more).
template <uint32_t D, uint32_t NH, uint32_t KB = 4, uint32_t VB = 2, uint32_t G = kK4V2Group> struct K4V2WarpLayout {
  static_assert(D % G == 0, "value groups divide head_dim");
  static constexpr uint32_t kVG = D / G;
  static constexpr uint32_t kKRow = D * KB / 8, kVRow = D * VB / 8;  // code bytes of a token
  static constexpr uint32_t kMaxTile = k4v2_max_tile(KB, VB, G);      // quantized tokens per tile
  // Quantized stage: the tile's rows as the block stores them (one bulk copy per region), the
  // key regions first: P·V's B lies over them.
  static constexpr uint32_t kKCodes = 0;
  static constexpr uint32_t kKScale = kKCodes + kMaxTile * kKRow;
  static constexpr uint32_t kKMin = kKScale + kMaxTile / G * D * 2;
  static constexpr uint32_t kVCodes = kKMin + kMaxTile / G * D * 2;
  static constexpr uint32_t kVScale = kVCodes + kMaxTile * kVRow;
  static constexpr uint32_t kVMin = kVScale + kMaxTile * kVG * 2;
  static constexpr uint32_t kQuantBytes = kVMin + kMaxTile * kVG * 2;
  // 16-bit stage: K rows, then V rows, kRowK apart (an odd number of 16-byte units:
  // ldmatrix of eight rows reads without conflicts).
  static constexpr uint32_t kRowK = k4v2_odd_stride(D * 2);
  static constexpr uint32_t kRowV = kK4V2RowTile * kRowK;
  static constexpr uint32_t kRowBytes = 2 * kRowV;
  static constexpr uint32_t kStageBytes = k4v2_align(kQuantBytes > kRowBytes ? kQuantBytes : kRowBytes, 128);
  // The 16-bit rows' P·V B: [piece (hi, and lo for bf16)][head slot][32 k positions] fp16 or
  // bf16, over the K rows (the logits are done with them when it is written).
  static constexpr uint32_t kRowPStride = k4v2_odd_stride(32 * 2);
  static constexpr uint32_t kRowP = 0;
  // P·V's B: [span][(head slot, value group of the span) rows][k position] fp16, over the key
  // codes, scales and minima of the stage (the logits are done with them when it is written).
  // Rows of an odd number of 16-byte units (ldmatrix without conflicts), except at G = 16 with
  // four head slots: 16 rows a span, whose padding would outgrow the key regions at 2-bit keys,
  // are unpadded with their units swizzled instead (bpv_offset).
  static constexpr bool kBpvSwizzled = G == 16 && NH == 4;
  static constexpr uint32_t kBpvStride = kBpvSwizzled ? kMaxTile * 2 : k4v2_odd_stride(kMaxTile * 2);
  static constexpr uint32_t kBpvRows = G == 16 ? 4 : 2;  // B rows per head slot: value groups of a span, ≥ 2
  static constexpr uint32_t kBpvSpan = kBpvRows * NH * kBpvStride;
  static constexpr uint32_t kBpv = kKCodes;
  // At the end, the 16-bit rows' P·V ([slot][D] fp32) and then each slot's (max, sum), over
  // the stage.
  static constexpr uint32_t kOut16 = 0;
  static constexpr uint32_t kQ2 = kWarpStages * kStageBytes;  // [slot][quarter][D / 8] q' pairs (fp16x2)
  static constexpr uint32_t kQn = kQ2 + NH * 4 * (D / 8) * 4;   // [slot][D] dtype: q
  static constexpr uint32_t kMbar = k4v2_align(kQn + NH * D * 2, 8);
  static constexpr uint32_t kTotal = kMbar + kWarpStages * 8;
};
// Every region 16-byte aligned (bulk copies, ldmatrix; the mbarrier 8), and what lies over the
// stage fits it.
template <uint32_t D, uint32_t NH, uint32_t KB = 4, uint32_t VB = 2, uint32_t G = kK4V2Group>
constexpr bool k4v2_warp_layout_ok() {
  using L = K4V2WarpLayout<D, NH, KB, VB, G>;
  return L::kVCodes % 16 == 0 && L::kKScale % 16 == 0 && L::kKMin % 16 == 0 && L::kVScale % 16 == 0 &&
         L::kVMin % 16 == 0 && L::kRowV % 16 == 0 && L::kStageBytes % 16 == 0 && L::kBpv % 16 == 0 &&
         L::kQ2 % 16 == 0 && L::kQn % 16 == 0 && L::kMbar % 8 == 0 && L::kTotal % 8 == 0 &&
         L::kRowP + 2 * NH * L::kRowPStride <= L::kRowV && L::kBpv + D / 64 * L::kBpvSpan <= L::kVCodes &&
         L::kOut16 + NH * (D + 2) * 4 <= L::kStageBytes;
}
static_assert(kK4V2RowTile <= 32, "a 16-bit tile is at most two 16-row M-tiles");
template <uint32_t KB, uint32_t VB, uint32_t G> constexpr bool k4v2_warp_layouts_ok() {
  bool ok = k4v2_warp_layout_ok<128, 1, KB, VB, G>() && k4v2_warp_layout_ok<128, 2, KB, VB, G>() &&
            k4v2_warp_layout_ok<128, 4, KB, VB, G>() && k4v2_warp_layout_ok<256, 1, KB, VB, G>() &&
            k4v2_warp_layout_ok<256, 2, KB, VB, G>() && k4v2_warp_layout_ok<256, 4, KB, VB, G>();
  if constexpr (64 % G == 0)
    ok = ok && k4v2_warp_layout_ok<64, 1, KB, VB, G>() && k4v2_warp_layout_ok<64, 2, KB, VB, G>() &&
         k4v2_warp_layout_ok<64, 4, KB, VB, G>();
  return ok;
}
template <uint32_t KB, uint32_t VB> constexpr bool k4v2_warp_layouts_g16_ok() {  // head_dim 64 and 128 only
  return k4v2_warp_layout_ok<128, 1, KB, VB, 16>() && k4v2_warp_layout_ok<128, 2, KB, VB, 16>() &&
         k4v2_warp_layout_ok<128, 4, KB, VB, 16>() && k4v2_warp_layout_ok<64, 1, KB, VB, 16>() &&
         k4v2_warp_layout_ok<64, 2, KB, VB, 16>() && k4v2_warp_layout_ok<64, 4, KB, VB, 16>();
}
static_assert(k4v2_warp_layouts_g16_ok<2, 2>() && k4v2_warp_layouts_g16_ok<4, 4>(),
              "decode_k4v2_warp's shared-memory layout at G = 16");
static_assert(k4v2_warp_layouts_ok<4, 2, 32>() && k4v2_warp_layouts_ok<2, 2, 32>() &&
                  k4v2_warp_layouts_ok<4, 4, 32>() && k4v2_warp_layouts_ok<8, 8, 32>() &&
                  k4v2_warp_layouts_ok<8, 4, 32>() && k4v2_warp_layouts_ok<8, 2, 32>() &&
                  k4v2_warp_layouts_ok<4, 2, 64>() && k4v2_warp_layouts_ok<2, 2, 64>() &&
                  k4v2_warp_layouts_ok<4, 2, 128>() && k4v2_warp_layouts_ok<2, 2, 128>(),
              "decode_k4v2_warp's shared-memory layout");
// CTAs per SM at head_dim 128 as shared memory allows: 228 KB, allocated in 128-byte units, plus
// the 1 KB the runtime reserves per CTA (ncu's theoretical occupancy agrees).
constexpr uint32_t k4v2_warp_smem_ctas(uint32_t bytes) { return 228 * 1024 / (k4v2_align(bytes, 128) + 1024); }
// (8/8-bit storage's 64-token stage is 18 KB: one CTA fewer.)
template <uint32_t KB, uint32_t VB, uint32_t G = kK4V2Group>
constexpr bool k4v2_warp_fits(uint32_t ctas_1_2, uint32_t ctas_4) {
  return k4v2_warp_smem_ctas(K4V2WarpLayout<128, 1, KB, VB, G>::kTotal) >= ctas_1_2 &&
         k4v2_warp_smem_ctas(K4V2WarpLayout<128, 2, KB, VB, G>::kTotal) >= ctas_1_2 &&
         k4v2_warp_smem_ctas(K4V2WarpLayout<128, 4, KB, VB, G>::kTotal) >= ctas_4;
}
static_assert(k4v2_warp_fits<4, 2>(12, 11) && k4v2_warp_fits<2, 2>(12, 11) && k4v2_warp_fits<4, 4>(12, 11) &&
                  k4v2_warp_fits<8, 8>(11, 10) && k4v2_warp_fits<8, 4>(12, 11) && k4v2_warp_fits<8, 2>(12, 11) &&
                  k4v2_warp_fits<4, 2, 64>(12, 11) &&
                  k4v2_warp_fits<2, 2, 64>(12, 11) && k4v2_warp_fits<4, 2, 128>(12, 11) &&
                  k4v2_warp_fits<2, 2, 128>(12, 11) && k4v2_warp_fits<2, 2, 16>(12, 11) &&
                  k4v2_warp_fits<4, 4, 16>(12, 11),
              "decode_k4v2_warp's shared memory grew");

// The head slots of a CTA for a GQA group of n_rep.
constexpr uint32_t k4v2_warp_slots(uint32_t n_rep) { return n_rep == 1 ? 1 : n_rep == 2 ? 2 : 4; }

// Staging tile `tr` into the stage at shared address dst, completed on barrier `bar` (one
// arrival per phase, lane 0's): six bulk copies for a quantized tile (key codes, value codes,
// key scales and minima, value scales and minima), two per row for a 16-bit tile, the row of
// the token appended in this launch from the caller's buffer.
template <int D, int NH, int KB, int VB, int G>
__device__ __forceinline__ void k4v2_warp_stage(const K4V2Args &a, const TileRef &tr, const uint8_t *block,
                                                const uint8_t *res_slot, uint32_t kvh, const HeadRegions &hr,
                                                uint32_t dst, uint32_t bar, uint32_t lane) {
  using L = K4V2WarpLayout<D, NH, KB, VB, G>;
  const DecodeParams &p = a.p;
  constexpr uint32_t VG = D / G;
  if (tr.segment == kSegQuantized) {
    if (lane != 0) return;
    const uint32_t row0 = tr.first - a.block_tokens.div(tr.first) * p.st.block.tokens;
    const uint32_t n = tr.count;  // a multiple of G; the tile lies in one block
    const uint32_t kc = n * L::kKRow, vc = n * L::kVRow, ks = n / G * D * 2, vs = n * VG * 2;
    const uint32_t kat = row0 / G * D * 2, vat = row0 * VG * 2;
    bulk::mbar_arrive_expect_tx(bar, kc + vc + 2 * ks + 2 * vs);
    bulk::copy(dst + L::kKCodes, block + hr.k_codes + row0 * L::kKRow, kc, bar);
    bulk::copy(dst + L::kVCodes, block + hr.v_codes + row0 * L::kVRow, vc, bar);
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
      bulk::copy(dst + L::kRowV + r * L::kRowK, sub ? src.sub_v : src.v + r * kRow, kRow, bar);
    }
  }
}

// The split merge in the kernel: the CTA that writes the last partials of a (sequence, KV
// head) merges its head slots, where one warp's reads stay small (splits × slots ≤ 64) and
// the KV head's heads are one chunk (the split counters are per (sequence, KV head)). At
// batch 1 under MHA (37 splits per head at 32K) this replaces decode_merge's launch.
constexpr uint32_t kWarpFusedMergeMax = 64;
__host__ __device__ constexpr bool k4v2_warp_fused_merge(uint32_t splits, uint32_t slots, uint32_t n_rep) {
  return splits > 1 && splits * slots <= kWarpFusedMergeMax && n_rep <= slots;
}
static_assert(K4V2WarpLayout<64, 1>::kStageBytes >= kWarpFusedMergeMax * 4, "the fused merge's weights fit the stage");

// Profiling builds (MINIKV_DECODE_STAGE_CLOCK): lane 0 of each of the first kStageClockCtas
// CTAs of a launch (x fastest) stamps %globaltimer (ns) at the kernel's stages; a later launch
// overwrites them. The stages, in order (0 where a CTA does not reach one):
enum : uint32_t {
  kStageEntry,       // the kernel starts
  kStageCopies,      // the first tile's copies issued (before the wait when launched early)
  kStageWaited,      // past pdl_wait: the previous kernel's writes are visible
  kStageQuery,       // q' prepared, the tile loop starts
  kStageTiles,       // the tile loop done
  kStagePartials,    // the partial outputs stored
  kStageLast,        // arrived last at the split counter (the merging CTA only)
  kStageMerged,      // the merged output stored (the merging CTA only)
  kStageClockStamps
};
#ifdef MINIKV_DECODE_STAGE_CLOCK
constexpr uint32_t kStageClockCtas = 4096;
__device__ unsigned long long decode_stage_clock[kStageClockCtas][kStageClockStamps];
// (Unused in an sm_80 pass, where the kernel's body is compiled out.)
[[maybe_unused]] __device__ __forceinline__ void stage_clock(uint32_t stage, uint32_t lane) {
  const uint64_t cta = blockIdx.x + uint64_t(gridDim.x) * (blockIdx.y + uint64_t(gridDim.y) * blockIdx.z);
  if (lane != 0 || cta >= kStageClockCtas) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  decode_stage_clock[cta][stage] = t;
}
#else
[[maybe_unused]] __device__ __forceinline__ void stage_clock(uint32_t, uint32_t) {}
#endif

// decode_merge's combine for heads head0 .. head0 + nh − 1, run by the CTA that arrives last
// at `counter` (arrive_last_split); w_s: 64 floats of shared memory.
template <typename T, int D>
__device__ __forceinline__ void k4v2_warp_merge_if_last(const DecodeParams &p, uint32_t *counter, uint64_t head0,
                                                        uint32_t nh, uint32_t lane, float *w_s) {
  if (!arrive_last_split(counter, p.splits, lane)) return;
  stage_clock(kStageLast, lane);
  const uint32_t S = p.splits;  // ≤ kWarpFusedMergeMax: splits lane and lane + 32
  for (uint32_t r = 0; r < nh; ++r) {
    const uint64_t part0 = (head0 + r) * S;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    if (lane < S) {
      m0 = __ldcg(p.part_ml + (part0 + lane) * 2);
      l0 = __ldcg(p.part_ml + (part0 + lane) * 2 + 1);
    }
    if (lane + 32 < S) {
      m1 = __ldcg(p.part_ml + (part0 + lane + 32) * 2);
      l1 = __ldcg(p.part_ml + (part0 + lane + 32) * 2 + 1);
    }
    const float m = warp_max(fmaxf(m0, m1));
    const float w0 = m0 == -INFINITY ? 0.0f : exp2f(m0 - m);  // empty split (or none): 0
    const float w1 = m1 == -INFINITY ? 0.0f : exp2f(m1 - m);
    if (lane < S) w_s[lane] = w0;
    if (lane + 32 < S) w_s[lane + 32] = w1;
    const float l = warp_sum(w0 * l0 + w1 * l1);
    __syncwarp();
    store_merged_head<T, D>(p, head0 + r, w_s, l, lane);
  }
  stage_clock(kStageMerged, lane);
}

/// \tparam T  dtype of q/out, scales and 16-bit rows (__half or __nv_bfloat16)
/// \tparam D  head_dim (64, 128 or 256)
/// \tparam NH query-head slots of the CTA (1, 2 or 4): lane (g, i) owns slot i % NH
/// \tparam KB key bits (2, 4 or 8); VB value bits (2, 4 or 8)
/// \tparam G  the group: key groups of G tokens, value groups of G channels (16 at head_dim ≤ 128;
///            32, 64, 128)
template <typename T, int D, int NH, int KB = 4, int VB = 2, int G = int(kK4V2Group)>
__global__ void __launch_bounds__(32, 1) decode_k4v2_warp_kernel(const __grid_constant__ K4V2Args a) {
#if __CUDA_ARCH__ >= 900 || defined(MINIKV_WARP_EMULATION)
  using KP = KeyPairs<KB>;
  using L = K4V2WarpLayout<D, NH, KB, VB, G>;
  constexpr int KS = D / 16;          // 16-channel k-steps of a key row
  constexpr int S = D / 64;           // 64-channel spans of a value row
  constexpr int VG = D / G;           // value groups of a token
  constexpr int QP = D / 8;           // key pairs in a quarter of a key row
  constexpr int MR = D / 16;          // 16-channel M-tiles of the 16-bit rows' P·V
  constexpr int kBatch = 4 / NH;      // key units per QK B operand
  constexpr int E = 16 / VB;          // value channels in an fp16 half of a code word
  // Value groups of a 64-channel span: B rows per head slot (4 at G = 16, 2 at 32, else 1).
  constexpr int RP = G <= 32 ? 64 / G : 1;
  // The tile walks keys in units of KU tokens (32, or G = 16: one M-tile per key group): unit
  // v's scales and minima are those of key group v · KU / G (a larger G repeats them), so
  // that every lane keeps logits. MPU M-tiles a unit; NB B operands a tile.
  constexpr int KU = G < 32 ? G : 32, MPU = KU / 16;
  constexpr int NB = (int(L::kMaxTile) / KU + kBatch - 1) / kBatch;
  auto key_group = [](uint32_t v) { return v * KU / G; };
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static_assert(NH == 1 || NH == 2 || NH == 4, "1, 2 or 4 head slots");
  static_assert((KB == 2 || KB == 4 || KB == 8) && (VB == 2 || VB == 4 || VB == 8), "2-, 4- or 8-bit codes");
  static_assert((G == 16 || G == 32 || G == 64 || G == 128) && D % G == 0, "G of 16 to 128 dividing head_dim");
  // P·V's n-tiles: N = (head slot, value group of the span) is 4 · NH columns at G = 16, two
  // n-tiles at four head slots (n-tile t: the span's value groups 2t, 2t + 1); else one.
  constexpr int NT = L::kBpvSwizzled ? 2 : 1;
  // Byte offset of P·V's B element (row, k position kp) from its span. Swizzled, 16-byte unit u
  // of row r lies at u ^ f(r), f(r) = r mod 2 + 2 (r / 4 mod 4): the eight rows 4 slot + 2t + b
  // that one ldmatrix reads have distinct f, and so do the lanes of one store (distinct slots
  // and units): no bank conflicts, as with the padded rows.
  auto bpv_offset = [](uint32_t row, uint32_t kp) {
    const uint32_t byte = 2 * kp;
    if constexpr (L::kBpvSwizzled) {
      const uint32_t f = (row & 1u) | ((row >> 1) & 6u);
      return row * L::kBpvStride + ((((byte >> 4) ^ f) << 4) | (byte & 15u));
    } else {
      return row * L::kBpvStride + byte;
    }
  };

  MINIKV_DYNAMIC_SMEM(smem, 128);
  const uint32_t smem_s = smem_addr(smem);
  const DecodeParams &p = a.p;
  const uint32_t lane = threadIdx.x, gq = lane >> 2, qi = lane & 3;
  const uint32_t hh = qi % NH;   // the lane's head slot: its logits, probabilities, P·V columns
  const uint32_t kgl = qi / NH;  // the key group of a B operand whose logits the lane keeps
  const DecodeCta cta(p);
  const uint32_t split = cta.split, seq = cta.seq, kvh = cta.kvh, h0 = cta.h0, nh = cta.nh;
  const uint32_t bar0 = smem_s + L::kMbar;
  stage_clock(kStageEntry, lane);

  // The first tiles' copies go out before the query work below, so that their memory
  // latency overlaps it (at batch 1 a CTA often walks a single tile).
  if (lane == 0) {
    for (uint32_t s = 0; s < kWarpStages; ++s) bulk::mbar_init(bar0 + 8 * s, 1);
    bulk::fence_mbar_init();
  }
  __syncwarp();
  const SequenceTiles<K4V2Tiles> tiles(p.sinks[seq], p.quantized[seq], p.residual[seq], a.tiles);
  const SplitTiles range(tiles.total, p.splits, split);
  const uint32_t t_begin = range.begin, t_end = range.end;
  const SequenceSlot sslot(p, seq);
  const int32_t *table = sslot.table;
  const uint8_t *res_slot = sslot.residual;
  const HeadRegions regions(p.st.block, kvh);
  // Launched early (launch_decode_k4v2_warp), the kernel before may still run: quantized
  // tiles (the block table, the pool's blocks) are what no running launch writes, so their
  // copies go out first; the 16-bit rows, q, the appended row and the counters wait.
  bool waited = false;
  for (uint32_t s = 0; s < kWarpStages; ++s)
    if (t_begin + s < t_end) {
      const TileRef tr = tiles.tile(t_begin + s, a.tiles);
      if (tr.segment != kSegQuantized && !waited) {
        pdl_wait();
        waited = true;
      }
      k4v2_warp_stage<D, NH, KB, VB, G>(a, tr, k4v2_block_of(a, tr, table), res_slot, kvh, regions,
                             smem_s + s * L::kStageBytes, bar0 + 8 * s, lane);
    }
  stage_clock(kStageCopies, lane);
  if (!waited) pdl_wait();
  stage_clock(kStageWaited, lane);

  T *qn = reinterpret_cast<T *>(smem + L::kQn);
  uint32_t *q2s = reinterpret_cast<uint32_t *>(smem + L::kQ2);
  // q[h][c] of the CTA's slot h as fp32.
  auto q_at = [&](uint32_t h, uint32_t c) {
    return elem_to_float<T>(reinterpret_cast<const uint16_t *>(qn)[h * D + c], 0);
  };

  // The CTA's queries (zeros past its heads) as the dtype: the B operand of the bias mma and of
  // the 16-bit rows' QK.
  for (uint32_t x = lane; x < NH * D / 8; x += 32) {
    const uint32_t h = x / (D / 8), c8 = x % (D / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (h < nh) v = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.q) + (uint64_t(seq) * p.num_heads + h0 + h) * D)[c8];
    reinterpret_cast<uint4 *>(qn)[x] = v;
  }
  __syncwarp();
  // q' = q · 2^(kq − offset) per head in key-pair order, fp16 pairs: the offset is the pair's
  // code position in its fp16 half (KeyPairs<KB>::offset), kq puts the head's max
  // |q · 2^-offset| into [2^6, 2^7).
  float uq = 1.0f;  // 2^(12 − kq) of the lane's head
  // 2^-offset of the lane's channels lane + 32c (a word's channels repeat their offsets every 32).
  const float lane_unit = pow2i(-key_channel_offset<KB>(lane));
#pragma unroll
  for (int h = 0; h < NH; ++h) {
    float mx = 0.0f;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) mx = fmaxf(mx, fabsf(q_at(h, lane + 32 * c)) * lane_unit);
    mx = warp_max(mx);
    const int kq = mx > 0.0f ? clamp_exp(6 - exponent_of(mx), 100) : 0;
    if (uint32_t(h) == hh) uq = pow2i(12 - kq);
#pragma unroll
    for (int j = 0; j < D / 64; ++j) {
      const uint32_t idx = lane + 32 * j, quarter = idx / QP, P = idx % QP;
      const uint32_t lo = quarter * (D / 4) + KP::lo(P), hi = quarter * (D / 4) + KP::hi(P);
      const float f = pow2i(kq - KP::offset(P));
      q2s[h * (D / 2) + idx] = pack_f16(q_at(h, lo) * f, q_at(h, hi) * f);
    }
  }
  __syncwarp();


  // Quantized values, head slot hh: acc[span][j] is the C fragment of channels 64s + 8g + 2j
  // (row g) and + 1 (row g + 8), columns = the span's value groups, units 2^(off − 24 − Sv)
  // (off: the code's bit offset, 4 (j mod 2) + 2 · row half); vb = Σ p · m_v per value group;
  // l_q the sum of head slot hh's probabilities (quantized and 16-bit rows) over the lane's
  // tokens. 16-bit rows' values, head slot hh: acc16[m][r] = channel 16m + g + 8r in units of
  // 1 / ProbOperand<T>::kScale.
  float acc[S][4][NT][4], acc16[MR][2], vb[VG];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[s][j][t][c] = 0.0f;
#pragma unroll
  for (int m = 0; m < MR; ++m) acc16[m][0] = acc16[m][1] = 0.0f;
#pragma unroll
  for (int j = 0; j < VG; ++j) vb[j] = 0.0f;
  float m_run = -INFINITY, l_q = 0.0f;  // of head slot hh
  int Sv = 0;
  bool sv_set = false;

  if (split == 0 && cta.chunk == 0) store_appended_row(p, seq, kvh, lane, 32);

  // The max over the lanes of the same head slot (lanes i, i + NH, ... and every g).
  auto head_max = [](float x) {
#pragma unroll
    for (int o = NH; o < 32; o <<= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
    return x;
  };
  // Rescales the running state to the lane's head's max m_new (and the quantized values to
  // 2^Sv' / 2^Sv). Returns the subtrahend of the head's new probabilities' exponent.
  auto rescale_to = [&](float m_new, float rescale) {
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    const float corr = ex2(m_run - base);  // 0 while m_run is -inf
    m_run = m_new;
    l_q *= corr;
    const float cq = corr * rescale;
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[s][j][t][c] *= cq;
#pragma unroll
    for (int j = 0; j < VG; ++j) vb[j] *= corr;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      acc16[m][0] *= corr;
      acc16[m][1] *= corr;
    }
    return base;
  };

  const uint8_t *next_block =
      t_begin + kWarpStages < t_end ? k4v2_block_of(a, tiles.tile(t_begin + kWarpStages, a.tiles), table) : nullptr;
  uint32_t phases = 0, buf = 0;
  stage_clock(kStageQuery, lane);
  for (uint32_t ti = t_begin; ti < t_end; ++ti) {
    bulk::mbar_wait(bar0 + 8 * buf, (phases >> buf) & 1u);
    phases ^= 1u << buf;
    uint8_t *const stage = smem + buf * L::kStageBytes;
    const TileRef tr = tiles.tile(ti, a.tiles);
    const uint32_t count = tr.count;

    if (tr.segment == kSegQuantized) {
      const uint32_t groups = count / KU;  // key units of the tile
      // 1. The bias q · m_k of every (key group, head): A rows = the groups' minima, B
      //    column n = q of head slot n % NH; C[g][n] lands in lane (g, n / 2).
      float cb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      {
        const bool live = gq < groups;
        const uint8_t *mrow = stage + L::kKMin + (live ? key_group(gq) : 0) * D * 2;
        const uint8_t *qb = reinterpret_cast<const uint8_t *>(qn + (gq % NH) * D);
#pragma unroll
        for (int k = 0; k < KS; ++k) {
          const uint32_t c = 16 * k + 2 * qi;
          const uint32_t av[4] = {live ? lds32(mrow + 2 * c) : 0u, 0u, live ? lds32(mrow + 2 * (c + 8)) : 0u, 0u};
          mma_16816<T>(cb, av, lds32(qb + 2 * c), lds32(qb + 2 * (c + 8)));
        }
      }
      // 2a. With more than one batch (NH > 1), each key group's scaled key scales s' and
      //     2^(12 − ks) once per tile rather than once per batch: lane (g, i) prepares
      //     quarter i of group g / 2 and the even g write s' over the scales they read.
      [[maybe_unused]] float us_tile = 1.0f;  // 2^(12 − ks) of group g / 2
      if constexpr (NH > 1) {
        const uint32_t kg = gq / MPU;  // unit kg's quarter i: lanes (MPU kg .. MPU kg + MPU − 1, i)
        const bool kg_live = kg < groups;
        uint8_t *sp = stage + L::kKScale + (kg_live ? key_group(kg) : 0) * D * 2 + qi * (D / 4) * 2;
        uint32_t sw[D / 8], s2[QP];  // quarter i of the group's key scales (dtype pairs); s'
        load_words(sp, sw);
        const int ks = key_scale_exponent<T, 4>(sw);  // lanes 4g .. 4g + 3 hold the quarters
        us_tile = pow2i(12 - ks);
        scaled_key_scales<T, KB>(sw, ks, s2);
        __syncwarp();  // the odd g (and at G > 32 other groups' lanes) have read the same words
        if (kg_live && gq % MPU == 0) store_words(sp, s2);
        __syncwarp();
      }
      // 2. Logits, one B operand per batch of kBatch key groups: lane (g, i) builds column g
      //    = (key group g / (2 NH) of the batch, head slot (g / 2) mod NH, piece g mod 2) at
      //    the k positions of quarter i's pairs, and keeps the logits of its head in the
      //    columns 2i, 2i + 1: rows g and g + 8 of the batch's M-tiles of key group i / NH.
      //    A batch whose 32-token groups lie in the key groups of the batch before (G > 32,
      //    more than one batch) has that batch's operand: it is built once per key group.
      float lg[NB][MPU][2];
      uint32_t bq[KS][2];
#pragma unroll
      for (int bt = 0; bt < NB; ++bt) {
#pragma unroll
        for (int mm = 0; mm < MPU; ++mm) lg[bt][mm][0] = lg[bt][mm][1] = -INFINITY;
        const uint32_t kg0 = bt * kBatch;
        if (kg0 >= groups) continue;
        float us = 1.0f;
        if ((bt * kBatch * KU) % G == 0) {
          // Four slots: a batch is one group, live past the guard above.
          const uint32_t kg = NH == 4 ? kg0 : kg0 + gq / (2 * NH), hc = (gq >> 1) % NH;
          const bool kg_live = NH == 4 || kg < groups;
          const uint8_t *sp = stage + L::kKScale + (kg_live ? key_group(kg) : 0) * D * 2 + qi * (D / 4) * 2;
          uint32_t q2[QP], s2[QP];
          load_words(q2s + hc * (D / 2) + qi * QP, q2);
          if constexpr (NH > 1) {
            load_words(sp, s2);  // step 2a's s'
          } else {
            uint32_t sw[D / 8];  // quarter i of the group's key scales (dtype pairs)
            load_words(sp, sw);
            const int ks = key_scale_exponent<T, 4>(sw);  // lanes 4g .. 4g + 3 hold the quarters
            us = pow2i(12 - ks);
            scaled_key_scales<T, KB>(sw, ks, s2);
          }
          const bool lo_piece = gq & 1;
#pragma unroll
          for (int P = 0; P < QP; ++P) {
            const uint32_t h = hmul2_bits(q2[P], s2[P]);
            const uint32_t piece = lo_piece ? hfms2_bits(q2[P], s2[P], h) : h;
            bq[P / 2][P & 1] = kg_live ? piece : 0u;
          }
        }
        const uint32_t kg = kg0 + kgl;  // the key group of the lane's logits
        // A lane that prepared that group's s' (NH > 1) or built its columns.
        if constexpr (NH > 1) us = __shfl_sync(kFull, us_tile, 4 * MPU * kg);
        else us = __shfl_sync(kFull, us, 8 * NH * kgl);
        // Its bias: C[kg][2 (hh / 2) + hh % 2] of step 1.
        const float b0 = __shfl_sync(kFull, cb[0], 4 * (kg & 7) + (hh >> 1));
        const float b1 = __shfl_sync(kFull, cb[1], 4 * (kg & 7) + (hh >> 1));
        const float un = uq * us * p.scale_log2, bl2 = (hh & 1 ? b1 : b0) * p.scale_log2;
#pragma unroll
        for (int x = 0; x < MPU * kBatch; ++x) {
          const uint32_t m = MPU * kg0 + x;  // M-tile: tokens 16m .. 16m + 15, key unit m / MPU
          if (m >= MPU * groups) break;
          constexpr int PW = KP::kPerWord;  // key pairs per word
          uint32_t w0[D * KB / 128], w1[D * KB / 128];
          load_key_quarter<D, KB>(stage + L::kKCodes + (16 * m + gq) * L::kKRow + qi * (L::kKRow / 4), w0);
          load_key_quarter<D, KB>(stage + L::kKCodes + (16 * m + gq + 8) * L::kKRow + qi * (L::kKRow / 4), w1);
          float d[2][4] = {};  // k-step parity: two independent chains
#pragma unroll
          for (int k = 0; k < KS; ++k) {
            const uint32_t av[4] = {KP::code_pair(w0[(2 * k) / PW], 2 * k), KP::code_pair(w1[(2 * k) / PW], 2 * k),
                                    KP::code_pair(w0[(2 * k + 1) / PW], 2 * k + 1),
                                    KP::code_pair(w1[(2 * k + 1) / PW], 2 * k + 1)};
            mma_16816<__half>(d[k & 1], av, bq[k][0], bq[k][1]);
          }
          if (uint32_t(x / MPU) == kgl) {  // columns 2i, 2i + 1: the lane's head, hi + lo
            lg[bt][x % MPU][0] = fmaf((d[0][0] + d[0][1]) + (d[1][0] + d[1][1]), un, bl2);
            lg[bt][x % MPU][1] = fmaf((d[0][2] + d[0][3]) + (d[1][2] + d[1][3]), un, bl2);
          }
        }
      }

      // 3. The tile's largest value scale (the lanes scan the region), Sv lowered where it
      //    needs; the softmax of each head over its lanes.
      //    The scan reads 16 bytes a lane (the region, count · VG · 2 bytes, is a multiple of 64).
      uint32_t vmx_bits = 0;
      for (uint32_t x = lane; x < count * VG / 8; x += 32) {
        uint32_t w[4];
        load_words(stage + L::kVScale + 16 * x, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) vmx_bits = __vmaxu2(vmx_bits, w[i] & 0x7fff7fffu);
      }
      const float vt = warp_max(elem_to_float<T>(max(vmx_bits & 0xffffu, vmx_bits >> 16), 0));
      float rescale = 1.0f;
      if (vt > 0.0f) {
        const int want = clamp_exp(14 - exponent_of(vt), 60);
        const int sv_new = sv_set ? min(Sv, want) : want;
        sv_set = true;
        rescale = pow2i(sv_new - Sv);
        Sv = sv_new;
      }
      float tmax = -INFINITY;
#pragma unroll
      for (int bt = 0; bt < NB; ++bt)
#pragma unroll
        for (int mm = 0; mm < MPU; ++mm) tmax = fmaxf(tmax, fmaxf(lg[bt][mm][0], lg[bt][mm][1]));
      const float base = rescale_to(fmaxf(m_run, head_max(tmax)), rescale);

      // 4. P·V's B (k positions 2g, 2g + 1 of k-step m are tokens g, g + 8 of M-tile m), rows
      //    (head slot, value group of the span), and Σ p · m_v, by the lanes that hold p. B
      //    lies over the key codes: every lane is past its reads of them (step 2) first.
      __syncwarp();
      uint8_t *bpv = smem + buf * L::kStageBytes + L::kBpv;
      const float unit = pow2i(Sv);
#pragma unroll
      for (int bt = 0; bt < NB; ++bt) {
        const uint32_t kg = bt * kBatch + kgl;
        if (kg >= groups) continue;
#pragma unroll
        for (int mm = 0; mm < MPU; ++mm) {
          const uint32_t t0 = 16 * (MPU * kg + mm) + gq;
          const float p0 = ex2(lg[bt][mm][0] - base), p1 = ex2(lg[bt][mm][1] - base);
          l_q += p0 + p1;
          // p · 2^Sv once for all value groups: (p · 2^Sv) · s_v = p · (s_v · 2^Sv) exactly,
          // unless p · 2^Sv is subnormal (Sv < 0), where the product is below 2^-51
          // (s_v · 2^Sv < 2^15, Sv ≥ −60): 0 in fp16 either way.
          const float pu0 = p0 * unit, pu1 = p1 * unit;
          uint32_t sv0[(VG + 1) / 2], mv0[(VG + 1) / 2], sv1[(VG + 1) / 2], mv1[(VG + 1) / 2];
          load_value_scales<VG>(stage + L::kVScale + t0 * VG * 2, stage + L::kVMin + t0 * VG * 2, sv0, mv0);
          load_value_scales<VG>(stage + L::kVScale + (t0 + 8) * VG * 2, stage + L::kVMin + (t0 + 8) * VG * 2, sv1, mv1);
          // B row (head slot, r) of span s takes value group (64 s + 64 r / RP) / G: a group
          // of 128 channels serves both spans.
#pragma unroll
          for (int s = 0; s < S; ++s)
#pragma unroll
            for (int r = 0; r < RP; ++r) {
              const int j = (64 * s + 64 / RP * r) / G;
              const float s0 = elem_to_float<T>(sv0[j / 2], j & 1), s1 = elem_to_float<T>(sv1[j / 2], j & 1);
              sts32(bpv + s * L::kBpvSpan + bpv_offset(L::kBpvRows * hh + r, 16 * (MPU * kg + mm) + 2 * gq),
                    pack_f16(pu0 * s0, pu1 * s1));
            }
#pragma unroll
          for (int j = 0; j < VG; ++j)
            vb[j] = fmaf(p0, elem_to_float<T>(mv0[j / 2], j & 1), fmaf(p1, elem_to_float<T>(mv1[j / 2], j & 1), vb[j]));
        }
      }
      if constexpr (G == 16) {
        // An odd number of M-tiles (count a multiple of 16, not 32): step 5's last k-step pair
        // reads one M-tile more, whose probabilities must be 0.
        if (count % 32 != 0)
          for (uint32_t x = lane; x < S * L::kBpvRows * NH * 8; x += 32) {
            const uint32_t row = x / 8 % (L::kBpvRows * NH);
            sts32(bpv + x / 8 / (L::kBpvRows * NH) * L::kBpvSpan + bpv_offset(row, count + 2 * (x % 8)), 0u);
          }
      }
      __syncwarp();

      // 5. P·V over the tile's k-steps: channel subsets j = 0 .. 3 of each span in turn. A
      //    value row is NC 16-byte chunks of 8 fp16 halves, each half E channels; subset j of
      //    span s is the channel pair (2jj, 2jj + 1) of every half of chunk s · VB / 2 + j / (E / 2),
      //    jj = j mod (E / 2) (M rows g and g + 8: half g's two channels).
      constexpr int NC = D * VB / 128, NX = NC > 1 ? NC / 2 : 1;
      {
        const uint8_t *vc = stage + L::kVCodes;
        // ldmatrix.trans row addresses: matrix mi = (K half, chunk 2x + mi / 2 of load x), row
        // = K position → token.
        const uint32_t mi = lane >> 3, pp = (mi & 1) * 8 + (lane & 7);
        const uint32_t tok = (pp & 1) ? pp / 2 + 8 : pp / 2;
        const uint8_t *vaddr = vc + tok * L::kVRow + (NC > 1 ? (mi >> 1) * 16 : 0);
        // B row n of n-tile t: every lane's C columns 2i, 2i + 1 are two value groups of its own
        // head slot i mod NH: (slot (n / 2) mod NH, group n mod 2) of a span's two groups, or
        // at G = 16 (four groups a span) groups 2 ((n / 2) / NH mod 2) + n mod 2, and with four
        // slots (two n-tiles) groups 2t + n mod 2.
        const uint32_t n = lane & 7, slot = (n >> 1) % NH;
        uint32_t brow[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t)
          brow[t] = G == 16 ? 4 * slot + 2 * ((n >> 1) / NH % 2 + t) + (n & 1) : 2 * slot + (n & 1);
        for (uint32_t kk = 0; kk < count / 16; kk += 2) {
          uint32_t b[S][NT][4];
#pragma unroll
          for (int s = 0; s < S; ++s)
#pragma unroll
            for (int t = 0; t < NT; ++t)
              ldmatrix_x4(b[s][t], bpv + s * L::kBpvSpan + bpv_offset(brow[t], 16 * kk + 8 * (lane >> 3)));
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            uint32_t R[NX][4];
#pragma unroll
            for (int x = 0; x < NX; ++x) ldmatrix_x4_trans(R[x], vaddr + (16 * (kk + h2)) * L::kVRow + 32 * x);
#pragma unroll
            for (int s = 0; s < S; ++s) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const int chunk = s * (VB / 2) + j / (E / 2), jj = j % (E / 2);
                const uint32_t lo = R[chunk / 2][2 * (chunk & 1)], hi = R[chunk / 2][2 * (chunk & 1) + 1];
                const uint32_t av[4] = {value_codes<VB>(lo, 2 * jj), value_codes<VB>(lo, 2 * jj + 1),
                                        value_codes<VB>(hi, 2 * jj), value_codes<VB>(hi, 2 * jj + 1)};
#pragma unroll
                for (int t = 0; t < NT; ++t) mma_16816<__half>(acc[s][j][t], av, b[s][t][2 * h2], b[s][t][2 * h2 + 1]);
              }
            }
          }
        }
      }
      bulk::fence_proxy_async_shared();  // the next tile's copy lands on B
    } else {
      // 16-bit rows (count ≤ kK4V2RowTile: one or two 16-row M-tiles). QK: M = rows, N = 8
      // columns, column n = q of head slot (n / 2) mod NH, K = channels, exact products: lane
      // (g, i) gets head slot hh's logits of rows g and g + 8 (columns 2i and 2i + 1 repeat
      // each other) and keeps those of M-tile mt where mt mod (4 / NH) = i / NH, so that
      // each (head, row) is kept by one lane. Rows past the tile read row count − 1 (finite
      // bytes; their logits are masked, their probabilities 0).
      const bool two = count > 16;
      const uint32_t arow = (lane & 7) + 8 * ((lane >> 3) & 1);
      const uint8_t *ka0 = stage + min(arow, count - 1) * L::kRowK + 16 * (lane >> 4);
      const uint8_t *ka1 = stage + min(16 + arow, count - 1) * L::kRowK + 16 * (lane >> 4);
      const uint8_t *qb = reinterpret_cast<const uint8_t *>(qn + ((gq >> 1) % NH) * D) + 4 * qi;
      float d0[2] = {0.0f, 0.0f}, d1[2] = {0.0f, 0.0f};  // rows g, g + 8 of M-tiles 0 and 1
#pragma unroll
      for (int k = 0; k < KS; ++k) {
        const uint32_t b0 = lds32(qb + 32 * k), b1 = lds32(qb + 32 * k + 16);
        uint32_t av[4];
        ldmatrix_x4(av, ka0 + 32 * k);
        mma_16816_even<T>(d0[0], d0[1], av, b0, b1);
        if (two) {
          ldmatrix_x4(av, ka1 + 32 * k);
          mma_16816_even<T>(d1[0], d1[1], av, b0, b1);
        }
      }
      float lg16[2][2], tmax = -INFINITY;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t t = 16 * mt + gq + 8 * r;
          const bool mine = uint32_t(mt % (4 / NH)) == kgl && t < count;
          lg16[mt][r] = mine ? (mt ? d1[r] : d0[r]) * p.scale_log2 : -INFINITY;
          tmax = fmaxf(tmax, lg16[mt][r]);
        }
      const float base = rescale_to(fmaxf(m_run, head_max(tmax)), 1.0f);
      // P·V: M = channels, N = the QK columns' heads, K = rows; k positions 2g, 2g + 1 of
      // k-step mt are rows 16 mt + g, 16 mt + g + 8, so a lane's two probabilities are one
      // word of B (p rounded once, ProbOperand). B lies over the K rows: every lane is past
      // its ldmatrix of them first.
      __syncwarp();
      uint8_t *prow = stage + L::kRowP;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float p0 = ex2(lg16[mt][0] - base), p1 = ex2(lg16[mt][1] - base);
        l_q += p0 + p1;
        if (uint32_t(mt % (4 / NH)) == kgl && (mt == 0 || two)) {
          const ProbOperand<T> pb(p0, p1, 0.0f, 0.0f);
          uint8_t *dst = prow + hh * L::kRowPStride + 4 * (8 * mt + gq);
          sts32(dst, pb.hi[0]);
          if constexpr (!std::is_same<T, __half>::value) sts32(dst + NH * L::kRowPStride, pb.lo[0]);
        }
      }
      __syncwarp();
      {
        // ldmatrix.trans row addresses: matrix mi = (k half, channel half), k position →
        // row (2m → m, 2m + 1 → m + 8).
        const uint32_t mi = lane >> 3, kp = 8 * (mi >> 1) + (lane & 7);
        const uint32_t row = (kp & 1) ? kp / 2 + 8 : kp / 2;
        const uint8_t *va0 = stage + L::kRowV + min(row, count - 1) * L::kRowK + 16 * (mi & 1);
        const uint8_t *va1 = stage + L::kRowV + min(16 + row, count - 1) * L::kRowK + 16 * (mi & 1);
        const uint8_t *pb = prow + ((gq >> 1) % NH) * L::kRowPStride + 4 * qi;
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          if (kk == 1 && !two) break;
          const uint32_t bh0 = lds32(pb + 32 * kk), bh1 = lds32(pb + 32 * kk + 16);
          uint32_t bl0 = 0, bl1 = 0;
          if constexpr (!std::is_same<T, __half>::value) {
            bl0 = lds32(pb + NH * L::kRowPStride + 32 * kk);
            bl1 = lds32(pb + NH * L::kRowPStride + 32 * kk + 16);
          }
#pragma unroll
          for (int m = 0; m < MR; ++m) {
            uint32_t av[4];
            ldmatrix_x4_trans(av, (kk ? va1 : va0) + 32 * m);
            mma_16816_even<T>(acc16[m][0], acc16[m][1], av, bh0, bh1);
            if constexpr (!std::is_same<T, __half>::value) mma_16816_even<T>(acc16[m][0], acc16[m][1], av, bl0, bl1);
          }
        }
      }
      bulk::fence_proxy_async_shared();  // the next tile's copy lands on B
    }

    __syncwarp();  // every lane is done with the stage and with P·V's B
    if (ti + kWarpStages < t_end) {
      k4v2_warp_stage<D, NH, KB, VB, G>(a, tiles.tile(ti + kWarpStages, a.tiles), next_block, res_slot, kvh, regions,
                             smem_s + buf * L::kStageBytes, bar0 + 8 * buf, lane);
      next_block = ti + kWarpStages + 1 < t_end
                       ? k4v2_block_of(a, tiles.tile(ti + kWarpStages + 1, a.tiles), table)
                       : nullptr;
    }
    buf = buf + 1 == kWarpStages ? 0 : buf + 1;
  }
  pdl_launch_dependents();  // the merge may start once every CTA is past its tiles
  stage_clock(kStageTiles, lane);

  // The sums and Σ p · m_v of the lane's head over its lanes; the 16-bit rows' outputs
  // through shared memory (over the stage: no copy is in flight and every lane is done with
  // the last tile), to the lanes that hold the quantized output of the same (head, channel).
  float Lh = l_q;
#pragma unroll
  for (int o = NH; o < 32; o <<= 1) Lh += __shfl_xor_sync(kFull, Lh, o);
  float vb_sum[VG];
#pragma unroll
  for (int j = 0; j < VG; ++j) {
    vb_sum[j] = vb[j];
#pragma unroll
    for (int o = NH; o < 32; o <<= 1) vb_sum[j] += __shfl_xor_sync(kFull, vb_sum[j], o);
  }
  float *out16 = reinterpret_cast<float *>(smem + L::kOut16);
  __syncwarp();
  if (kgl == 0) {  // lanes i and i + NH hold the same values
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
      for (int r = 0; r < 2; ++r) out16[hh * D + 16 * m + gq + 8 * r] = acc16[m][r] * (1.0f / ProbOperand<T>::kScale);
  }
  __syncwarp();
  // Lane (g, i) completes head slot hh's channel subsets j with j mod kBatch = i / NH:
  // channels 64s + (128 / VB) · chunk + E g + 2 jj + r (step 5), value group 2s + (g / 4 for
  // 2-bit values, else j / 2: the column parity of its C fragment), in out16 (each element
  // read and written by the lane that owns it); lane
  // h < NH (slot h) adds its head's max and sum. Then whole rows go out with 16-byte stores:
  // the owners' channels lie 8 apart, so stored from the fragments every 4 bytes took a
  // 32-byte sector of its own.
  if constexpr (G == 16) {
    // Four value groups a span: lane (g, i) holds value groups 2 pair + {0, 1} of its head slot
    // (step 5's B rows), pair = (i / NH) mod 2 with one n-tile, both pairs (n-tile t = pair)
    // with two. The lanes that hold a channel's group (one at NH = 2 and 4, two at NH = 1,
    // which split the subsets j) complete it.
    if (hh < nh) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t pair = VB == 2 ? gq >> 2 : uint32_t(j) >> 1;  // of the channel's group
        const bool holds = NT == 2 || pair == ((qi / NH) & 1);
        const bool mine = NH >= 2 || (VB == 2 ? uint32_t(j) >> 1 : uint32_t(j) & 1) == (qi >> 1);
        if (!holds || !mine) continue;
        const uint32_t t = NT == 2 ? pair : 0;
        const uint32_t col = VB == 2 ? (gq >> 1) & 1 : VB == 4 ? gq >> 2 : uint32_t(j) & 1;
        const int chunk = j / (E / 2), jj = j % (E / 2);
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // n-tile t selected, not indexed (t follows the lane at 2-bit values: an index would
            // put acc in local memory).
            float q = col ? acc[s][j][0][2 * r + 1] : acc[s][j][0][2 * r];
            if constexpr (NT == 2) q = t ? (col ? acc[s][j][NT - 1][2 * r + 1] : acc[s][j][NT - 1][2 * r]) : q;
            const uint32_t ch = 64 * s + (128 / VB) * chunk + E * gq + 2 * jj + r;
            const int off = (2 * jj + r) * VB % 8;
            float &o = out16[hh * D + ch];
            // Value group 4 s + 2 pair + col, selected (an index by lane would put vb_sum in
            // local memory).
            const float bias = pair ? (col ? vb_sum[4 * s + 3] : vb_sum[4 * s + 2])
                                    : (col ? vb_sum[4 * s + 1] : vb_sum[4 * s]);
            o = fmaf(q, pow2i(24 - off - Sv), bias + o);
          }
      }
    }
  } else if (hh < nh) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (uint32_t(j % kBatch) != kgl) continue;
      // The C column parity: the channel's value group within its span (0 from G = 64 up).
      const uint32_t col = G > 32 ? 0u : VB == 2 ? gq >> 2 : uint32_t(j) >> 1;
      const int chunk = j / (E / 2), jj = j % (E / 2);
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float q = col ? acc[s][j][0][2 * r + 1] : acc[s][j][0][2 * r];
          const uint32_t ch = 64 * s + (128 / VB) * chunk + E * gq + 2 * jj + r;
          const int off = (2 * jj + r) * VB % 8;  // the code's bit offset in its fp16 half
          float &o = out16[hh * D + ch];
          const float bias = G == 32 ? (col ? vb_sum[2 * s + 1] : vb_sum[2 * s]) : vb_sum[64 * s / G];
          o = fmaf(q, pow2i(24 - off - Sv), bias + o);
        }
    }
  }
  float *ml_s = out16 + NH * D;
  if (lane < uint32_t(NH)) {
    ml_s[2 * lane] = m_run;
    ml_s[2 * lane + 1] = Lh;
  }
  __syncwarp();
  store_decode_rows<T, D>(p, uint64_t(seq) * p.num_heads + h0, nh, split, out16, ml_s, lane, 32);
  stage_clock(kStagePartials, lane);
  __syncwarp();  // every lane's reads of out16 before the fused merge writes its weights there
  if (k4v2_warp_fused_merge(p.splits, NH, p.num_heads / p.num_kv_heads))
    k4v2_warp_merge_if_last<T, D>(p, p.counters + uint64_t(seq) * p.num_kv_heads + kvh,
                                  uint64_t(seq) * p.num_heads + h0, nh, lane, out16);
#endif
}

// The launchers; a CPU emulation (tests/emulation) runs the kernel itself.
#ifndef MINIKV_WARP_EMULATION
#ifdef MINIKV_DECODE_STAGE_CLOCK
// Profiling builds only (not part of the API): copies the stamps of the first `ctas` CTAs of
// the last one-warp decode launch on the current device to host[ctas][kStageClockStamps]
// after zeroing the device array for the next launch. Returns the stamps per CTA, or -1.
extern "C" __attribute__((visibility("default"))) int minikv_debug_decode_stage_clock(unsigned long long *host,
                                                                                      unsigned ctas) {
  if (ctas > kStageClockCtas) return -1;
  const size_t bytes = size_t(ctas) * kStageClockStamps * sizeof(unsigned long long);
  void *stamps = nullptr;
  if (cudaDeviceSynchronize() != cudaSuccess || cudaGetSymbolAddress(&stamps, decode_stage_clock) != cudaSuccess ||
      cudaMemcpy(host, stamps, bytes, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemset(stamps, 0, sizeof decode_stage_clock) != cudaSuccess)
    return -1;
  return int(kStageClockStamps);
}
#endif
// fn(kernel, its dynamic shared memory) of (dtype, head_dim, head slots, storage).
template <typename Fn>
void dispatch_k4v2_warp(minikv_dtype dtype, const BlockLayout &bl, uint32_t slots, Fn &&fn) {
  dispatch_dtype_head_dim<K4V2WarpHeadDims>(dtype, bl.head_dim, "minikv_decode", [&](auto tag, auto hd) {
    dispatch_k4v2_warp_storage(bl.key_bits, bl.value_bits, bl.group, [&](auto kb, auto vb, auto g) {
      using T = decltype(tag);
      constexpr int D = decltype(hd)::value, KB = decltype(kb)::value, VB = decltype(vb)::value,
                    G = decltype(g)::value;
      if constexpr (k4v2_warp_instance(KB, VB, G, D)) {
        if (slots == 1) fn(decode_k4v2_warp_kernel<T, D, 1, KB, VB, G>, K4V2WarpLayout<D, 1, KB, VB, G>::kTotal);
        else if (slots == 2) fn(decode_k4v2_warp_kernel<T, D, 2, KB, VB, G>, K4V2WarpLayout<D, 2, KB, VB, G>::kTotal);
        else fn(decode_k4v2_warp_kernel<T, D, 4, KB, VB, G>, K4V2WarpLayout<D, 4, KB, VB, G>::kTotal);
      }
    });
  });
}
#endif  // MINIKV_WARP_EMULATION

}  // namespace

#ifndef MINIKV_WARP_EMULATION
bool decode_k4v2_warp_path(const BlockLayout &bl, uint32_t n_rep) {
  return n_rep >= 1 && bl.elem_bytes == 2 && k4v2_warp_instance(bl.key_bits, bl.value_bits, bl.group, bl.head_dim) &&
         head_dim_compiled(bl.head_dim);
}

uint32_t decode_k4v2_warp_heads_per_cta(uint32_t n_rep) { return k4v2_warp_slots(n_rep); }

uint32_t configure_decode_k4v2_warp(minikv_dtype dtype, const BlockLayout &bl, uint32_t n_rep) {
  uint32_t ctas = 0;
  dispatch_k4v2_warp(dtype, bl, k4v2_warp_slots(n_rep), [&](auto kernel, uint32_t smem) {
    ctas = configure_sm90_kernel(kernel, 32, smem);
  });
  return ctas;
}

void launch_decode_k4v2_warp(minikv_dtype dtype, const DecodeParams &p, const K4V2LaunchPlan &plan,
                             cudaStream_t stream, bool early) {
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  const uint32_t chunks = (n_rep + p.heads_per_cta - 1) / p.heads_per_cta;
  const K4V2Args args{p, plan.tiles, plan.block_tokens};
  dispatch_k4v2_warp(dtype, p.st.block, p.heads_per_cta, [&](auto kernel, uint32_t smem) {
    launch_kernel(kernel, dim3(p.splits, p.num_kv_heads * chunks, p.n), dim3(32), smem, stream, early,
                  "decode_k4v2_warp_kernel", args);
  });
  if (p.splits > 1 && !k4v2_warp_fused_merge(p.splits, p.heads_per_cta, n_rep))
    launch_decode_merge(dtype, p.st.block.head_dim, p, stream, plan.programmatic_merge);
}

#endif  // MINIKV_WARP_EMULATION
}  // namespace kernels
}  // namespace minikv

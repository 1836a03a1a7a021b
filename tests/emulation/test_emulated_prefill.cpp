// minikv-test: white-box
// The prefill kernels run by the warp emulator on the CPU: prefill_attention.cu's (the
// FlashAttention-2 forward, the exact score pass and WINDOW mode's score pass, on mma.sync:
// sm_80, and on sm_90 every head_dim the wgmma kernels do not take) and the sm_90a score
// pass (prefill_scores_wgmma.cu: TMA query tiles, bulk-copied LSE, wgmma), against a float64
// attention on every element: the outputs (the GPU tests' tolerance), the row log-sum-exp
// the score passes read, and the score column sums (1e-3 relative, as the GPU storage test).
// A launch holds ragged whole prompts and a chunk of a prompt (rows at positions [q_pos,
// q_pos + n) over keys [0, q_pos + n), earlier chunks' sums added to), every head_dim, fp16
// and bf16, GQA groups of 1, 2 and 4; copies land when issued and when waited for.
#include "../../kernels/prefill_attention.cu"
#include "../../kernels/prefill_scores_wgmma.cu"
#include "../../kernels/prefill_wgmma.cu"
#include "decode_harness.hpp"
#include "reference/attention_ref.hpp"

namespace {

using namespace emu_test;

// One sequence of the launch: n query rows at prompt positions [q_pos, q_pos + n), keys
// [0, q_pos + n); the score passes sum the rows at positions >= row_begin into the columns
// [0, col_end), adding to the sums already there below col_done.
struct Seq {
  uint32_t n, q_pos, row_begin, col_end, col_done;
};

// The kernels under test: the mma.sync forward with prefill_scores_kernel or with
// prefill_window_scores_kernel, or the sm_90a forward and score pass (prefill_wgmma_kernel,
// prefill_scores_wgmma_kernel: head_dim 64, 128 and 256; TMA, wgmma and named barriers
// emulated); each score pass also with every key tile's items split over three CTAs
// (score_parts' split of short launches: uneven shares, and parts without items).
enum class Pass { kMma, kMmaParts, kWindow, kWgmma, kWgmmaParts };
const char *pass_name(Pass pass) {
  switch (pass) {
    case Pass::kMma: return "mma.sync";
    case Pass::kMmaParts: return "mma.sync, score parts";
    case Pass::kWindow: return "mma.sync, window scores";
    case Pass::kWgmma: return "sm_90a forward";
    default: return "sm_90a forward, score parts";
  }
}

// rows_tensor_map's map (kernels/prefill_wgmma.cu) in the emulation's encoding: [rows][heads][D]
// 16-bit elements, boxes of 64 elements x 1 head x box_rows rows, the 128-byte swizzle.
CUtensorMap emulated_rows_map(const void *base, uint32_t heads, uint32_t D, uint64_t rows, uint32_t box_rows) {
  CUtensorMap map;
  const uint64_t dims[3] = {D, heads, rows}, strides[2] = {uint64_t(D) * 2, uint64_t(heads) * D * 2};
  const uint32_t box[3] = {64, 1, box_rows};
  minikv::emulation::encode_tensor_map(&map, base, 2, dims, strides, box, true);
  return map;
}

struct PrefillShape {
  minikv_dtype dtype;
  uint32_t head_dim, n_rep;
};

template <typename T, int D>
void run_launch(const PrefillShape &sh, const std::vector<Seq> &seqs, Pass pass, CopyLanding landing, test::Rng &rng) {
  using Tl = k::PrefillTiling<D>;
  const uint32_t Hkv = 2, H = Hkv * sh.n_rep, B = uint32_t(seqs.size());
  // Each sequence's whole prompt (positions [0, q_pos + n)) drawn and its float64 attention
  // (tests/reference/attention_ref.hpp; its "window" sums are over the rows at positions >=
  // max(q_pos, row_begin), the rows this launch scores); the launch packs the query rows of
  // [q_pos, q_pos + n) back to back, and each sequence's keys in their own run (a chunk's
  // keys are the staging rows of its prompt so far).
  std::vector<int64_t> q_begin(B), kv_begin(B);
  int64_t rows = 0, kv_rows = 0;
  for (uint32_t b = 0; b < B; ++b) {
    q_begin[b] = rows;
    kv_begin[b] = kv_rows;
    rows += seqs[b].n;
    kv_rows += seqs[b].q_pos + seqs[b].n;
  }
  test::Buf q(sh.dtype, size_t(rows) * H * D), kb(sh.dtype, size_t(kv_rows) * Hkv * D),
      vb(sh.dtype, size_t(kv_rows) * Hkv * D), out(sh.dtype, size_t(rows) * H * D);
  out.fill(std::nan(""));
  std::vector<ref::PrefillResult> want;
  for (uint32_t b = 0; b < B; ++b) {
    const Seq &s = seqs[b];
    const uint32_t L = s.q_pos + s.n;
    test::Buf qp(sh.dtype, size_t(L) * H * D), kp(sh.dtype, size_t(L) * Hkv * D), vp(sh.dtype, size_t(L) * Hkv * D);
    qp.fill_normal(rng, 1.5);
    kp.fill_normal(rng);
    vp.fill_normal(rng);
    const size_t eb = sizeof(T);
    std::memcpy(q.row(size_t(q_begin[b]) * H * D), qp.row(size_t(s.q_pos) * H * D), size_t(s.n) * H * D * eb);
    std::memcpy(kb.row(size_t(kv_begin[b]) * Hkv * D), kp.data(), size_t(L) * Hkv * D * eb);
    std::memcpy(vb.row(size_t(kv_begin[b]) * Hkv * D), vp.data(), size_t(L) * Hkv * D * eb);
    want.push_back(ref::prefill(qp.doubles(), kp.doubles(), vp.doubles(), L, H, Hkv, D,
                                L - std::max(s.q_pos, s.row_begin)));
  }

  // Workspace rows of the launch: whole groups of four per sequence (cuda_backend.cpp).
  std::vector<uint32_t> ws_offset(B);
  uint32_t ws = 0;
  for (uint32_t b = 0; b < B; ++b) {
    ws_offset[b] = ws;
    ws += (seqs[b].n + 3) / 4 * 4;
  }
  // A tile of slack past the last row: the wgmma pass bulk-copies whole 64-row LSE tiles.
  std::vector<float> lse(size_t(H) * ws + 64, std::nanf(""));
  k::PrefillAttnParams attn{};
  attn.q = q.data();
  attn.k = kb.data();
  attn.v = vb.data();
  attn.out = out.data();
  attn.lse = lse.data();
  attn.num_heads = H;
  attn.num_kv_heads = Hkv;
  attn.ws_tokens = ws;
  attn.scale_log2 = k::kLog2e / std::sqrt(float(D));
  // The grids' order: one KV head per chunk, or both KV heads in one (head_chunk's choice for
  // short launches), so each forward and score pass runs under both mappings.
  attn.kv_heads_per_chunk = pass == Pass::kMmaParts || pass == Pass::kWgmmaParts ? Hkv : 1;
  // Score columns of each sequence (position j at score_offset + j), 5 apart.
  std::vector<uint32_t> score_offset(B);
  uint32_t cols = 0;
  for (uint32_t b = 0; b < B; ++b) {
    score_offset[b] = cols;
    cols += seqs[b].col_end + 5;
  }
  // Columns an earlier chunk summed hold a known value the pass must add to.
  const float kEarlier = 0.75f;
  std::vector<float> scores(size_t(Hkv) * cols, std::nanf(""));
  k::PrefillScoreParams sc{};
  sc.q = q.data();
  sc.k = kb.data();
  sc.lse = lse.data();
  sc.scores = scores.data();
  sc.num_heads = H;
  sc.num_kv_heads = Hkv;
  sc.ws_tokens = ws;
  sc.scores_stride = cols;
  sc.scale_log2 = attn.scale_log2;
  for (uint32_t b = 0; b < B; ++b) {
    const Seq &s = seqs[b];
    attn.seqs.n = b + 1;
    attn.seqs.token_begin[b] = q_begin[b];
    attn.seqs.len[b] = s.n;
    attn.seqs.ws_offset[b] = ws_offset[b];
    attn.seqs.tile_begin[b + 1] = attn.seqs.tile_begin[b] + (s.n + k::kPrefillQueryTile - 1) / k::kPrefillQueryTile;
    attn.keys.kv_begin[b] = kv_begin[b];
    attn.keys.q_pos[b] = s.q_pos;
    sc.seqs.n = b + 1;
    sc.seqs.token_begin[b] = q_begin[b];
    sc.seqs.len[b] = s.n;
    sc.seqs.ws_offset[b] = ws_offset[b];
    sc.seqs.tile_begin[b + 1] = sc.seqs.tile_begin[b] + (s.col_end + k::kPrefillKeyTile - 1) / k::kPrefillKeyTile;
    sc.keys = attn.keys;
    sc.row_begin[b] = s.row_begin;
    sc.col_end[b] = s.col_end;
    sc.col_done[b] = s.col_done;
    sc.score_offset[b] = score_offset[b];
    for (uint32_t h = 0; h < Hkv; ++h)
      for (uint32_t j = 0; j < s.col_done; ++j) scores[size_t(h) * cols + score_offset[b] + j] = kEarlier;
  }

  constexpr bool kSm90aHeadDim = k::in_list(k::WgmmaHeadDims{}, D);
  const bool wgmma = pass == Pass::kWgmma || pass == Pass::kWgmmaParts;
  if constexpr (kSm90aHeadDim) {
    if (wgmma) {  // launch_prefill_wgmma
      k::FaMaps maps;
      maps.q = emulated_rows_map(q.data(), H, D, k::launch_query_rows(attn.seqs), k::kFaRows);
      maps.k = emulated_rows_map(kb.data(), Hkv, D, uint64_t(kv_rows), k::FaSmem<D>::kKeys);
      maps.v = emulated_rows_map(vb.data(), Hkv, D, uint64_t(kv_rows), k::FaSmem<D>::kKeys);
      minikv::emulation::launch(dim3(attn.seqs.tile_begin[B] * H), dim3(k::kFaThreads), k::FaSmem<D>::kLaunchBytes,
                                landing, [&] { k::prefill_wgmma_kernel<T, D>(attn, maps); });
    }
  }
  if (!wgmma)
    minikv::emulation::launch(dim3(attn.seqs.tile_begin[B] * H), dim3(Tl::kThreads), k::attention_smem<T, D>(),
                              landing, [&] { k::prefill_attention_kernel<T, D>(attn); });
  if (pass == Pass::kWindow) {
    // launch_prefill_window_scores with one CTA per SM on 3 SMs: CTAs of several key tiles.
    const uint32_t num_sms = 3;
    uint32_t most_rows = 0, tiles = 0;
    for (uint32_t b = 0; b < B; ++b) {
      const uint32_t first = sc.row_begin[b] > sc.keys.q_pos[b] ? sc.row_begin[b] - sc.keys.q_pos[b] : 0;
      most_rows = std::max(most_rows, sc.seqs.len[b] - first);
      tiles += (sc.col_end[b] + k::kWinKeys - 1) / k::kWinKeys;
    }
    const uint32_t rows_cap = std::min<uint32_t>(
        k::win_rows_max(D), (sh.n_rep * most_rows + k::kWinChunk - 1) / k::kWinChunk * k::kWinChunk);
    REQUIRE(k::prefill_window_scores_fit(D, sh.n_rep, most_rows));
    const uint32_t per_cta = std::max<uint32_t>((tiles * Hkv + num_sms - 1) / num_sms, 1);
    uint32_t grid = 0;
    for (uint32_t b = 0; b < B; ++b) grid += ((sc.col_end[b] + k::kWinKeys - 1) / k::kWinKeys + per_cta - 1) / per_cta;
    const k::WindowScoreArgs args{sc, per_cta, rows_cap};
    minikv::emulation::launch(dim3(grid, Hkv), dim3(k::kWinThreads), k::window_scores_smem<T, D>(rows_cap), landing,
                              [&] { k::prefill_window_scores_kernel<T, D>(args); });
  } else {
    // launch_prefill_scores(_wgmma); with parts, scratch of two more pairs than the launch
    // has, counters at zero (cuda_backend.cpp), which the launch must leave at zero.
    const uint32_t parts = pass == Pass::kMmaParts || pass == Pass::kWgmmaParts ? 3 : 1;
    const uint32_t pairs = sc.seqs.tile_begin[B] * Hkv;
    std::vector<float> part_sums(size_t(parts) * (pairs + 2) * k::kPrefillKeyTile, std::nanf(""));
    std::vector<uint32_t> counters(pairs + 2, 0);
    sc.parts = parts;
    sc.kv_heads_per_chunk = attn.kv_heads_per_chunk;
    sc.part_stride = pairs + 2;
    sc.part_sums = part_sums.data();
    sc.part_counters = counters.data();
    if (wgmma) {
      if constexpr (kSm90aHeadDim) {
        k::ScMaps maps;
        maps.q = emulated_rows_map(q.data(), H, D, k::launch_query_rows(sc.seqs), k::kScQueries);
        minikv::emulation::launch(dim3(pairs * parts), dim3(k::kScThreads), k::ScSmem<T, D>::kLaunchBytes, landing,
                                  [&] { k::prefill_scores_wgmma_kernel<T, D>(sc, maps); });
      }
    } else {
      minikv::emulation::launch(dim3(pairs * parts), dim3(Tl::kThreads), k::scores_smem<T, D>(), landing,
                                [&] { k::prefill_scores_kernel<T, D>(sc); });
    }
    CHECK(std::count(counters.begin(), counters.end(), 0u) == std::ptrdiff_t(counters.size()));
  }

  // The GPU tests' output tolerance (gpu_util.h attention_tol): |got - ref| <= atol + rtol |ref|.
  const double atol = sh.dtype == MINIKV_DTYPE_BF16 ? 1.5e-2 : 2e-3, rtol = sh.dtype == MINIKV_DTYPE_BF16 ? 2e-2 : 5e-3;
  size_t bad_out = 0, bad_lse = 0, bad_score = 0;
  double worst_out = 0.0;
  for (uint32_t b = 0; b < B; ++b) {
    const Seq &s = seqs[b];
    const ref::PrefillResult &r = want[b];
    const uint32_t L = s.q_pos + s.n;
    for (uint32_t i = 0; i < s.n; ++i)
      for (uint32_t h = 0; h < H; ++h) {
        for (uint32_t c = 0; c < D; ++c) {
          const double g = out.get((size_t(q_begin[b] + i) * H + h) * D + c);
          const double x = r.out[(size_t(s.q_pos + i) * H + h) * D + c];
          if (!(std::fabs(g - x) <= atol + rtol * std::fabs(x))) ++bad_out;
          worst_out = std::max(worst_out, std::fabs(g - x));
        }
        // The forward's LSE is in log2 units.
        const double g = lse[size_t(h) * ws + ws_offset[b] + i], x = r.lse[size_t(s.q_pos + i) * H + h] / std::log(2.0);
        if (!(std::fabs(g - x) <= 1e-4 * std::max(1.0, std::fabs(x)))) ++bad_lse;
      }
    for (uint32_t h = 0; h < Hkv; ++h) {
      double max_ref = 0.0;
      for (uint32_t j = 0; j < s.col_end; ++j) max_ref = std::max(max_ref, r.window[size_t(h) * L + j]);
      for (uint32_t j = 0; j < s.col_end; ++j) {
        const double x = r.window[size_t(h) * L + j] + (j < s.col_done ? kEarlier : 0.0);
        const double g = scores[size_t(h) * cols + score_offset[b] + j];
        if (!(std::fabs(g - x) <= 1e-3 * (std::fabs(x) + 1e-6 * max_ref))) ++bad_score;
      }
      // Past col_end nothing is written.
      for (uint32_t j = s.col_end; j < s.col_end + 5; ++j)
        if (!std::isnan(scores[size_t(h) * cols + score_offset[b] + j])) ++bad_score;
    }
  }
  INFO("outputs: worst |diff| " << worst_out);
  CHECK(bad_out == 0);
  CHECK(bad_lse == 0);
  CHECK(bad_score == 0);
}

template <typename T> void run_shape(const PrefillShape &sh, const std::vector<Seq> &seqs, Pass pass, CopyLanding landing,
                                     test::Rng &rng) {
  switch (sh.head_dim) {
    case 64: run_launch<T, 64>(sh, seqs, pass, landing, rng); break;
    case 80: run_launch<T, 80>(sh, seqs, pass, landing, rng); break;
    case 96: run_launch<T, 96>(sh, seqs, pass, landing, rng); break;
    case 128: run_launch<T, 128>(sh, seqs, pass, landing, rng); break;
    default: run_launch<T, 256>(sh, seqs, pass, landing, rng); break;
  }
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the prefill kernels run by the warp emulator match a float64 attention") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const std::vector<PrefillShape> shapes = {{F16, 64, 1}, {BF16, 80, 2}, {F16, 96, 4}, {BF16, 128, 1}, {F16, 128, 4},
                                     {BF16, 256, 2}};
  // {n, q_pos, row_begin, col_end, col_done}: a one-row prompt; two query tiles whose scores
  // cover the candidates only; a chunk at positions 150-209 whose earlier chunks summed
  // columns below 150; rows scored from position 40 (WINDOW's rows on the general pass).
  const std::vector<Seq> cumulative = {{1, 0, 0, 1, 0}, {200, 0, 0, 170, 0}, {60, 150, 0, 210, 150}, {70, 0, 40, 70, 0}};
  // WINDOW's pass: the window's rows after every scored key (col_end <= row_begin), one of
  // them in a chunk; 100 rows of a group of 2 or 4 take two batches of rows.
  const std::vector<Seq> window = {{300, 0, 200, 200, 0}, {33, 0, 17, 17, 0}, {60, 150, 180, 180, 150}};
  test::Rng rng(0x9ef1);
  // Under AddressSanitizer (several times slower): every other shape, copies landing at issue.
  for (size_t i = 0; i < shapes.size(); i += kSanitized ? 2 : 1)
    for (Pass pass : {Pass::kMma, Pass::kMmaParts, Pass::kWindow, Pass::kWgmma, Pass::kWgmmaParts})
      for (CopyLanding landing : {CopyLanding::kAtIssue, CopyLanding::kAtWait}) {
        const PrefillShape &sh = shapes[i];
        if (kSanitized && landing == CopyLanding::kAtWait) continue;
        const bool wgmma = pass == Pass::kWgmma || pass == Pass::kWgmmaParts;
        if (wgmma && !k::in_list(k::WgmmaHeadDims{}, sh.head_dim)) continue;
        const std::string name = std::string(sh.dtype == F16 ? "f16" : "bf16") + " hd" + std::to_string(sh.head_dim) +
                                 " n_rep " + std::to_string(sh.n_rep) + ", " + pass_name(pass) +
                                 (landing == CopyLanding::kAtIssue ? ", at issue" : ", at wait");
        const std::vector<Seq> &seqs = pass == Pass::kWindow ? window : cumulative;
        SUBCASE(name.c_str()) {
          if (sh.dtype == F16) run_shape<__half>(sh, seqs, pass, landing, rng);
          else run_shape<__nv_bfloat16>(sh, seqs, pass, landing, rng);
        }
      }
}

TEST_CASE("the forward and score grids group KV heads in short launches only") {
  // A whole prompt of L rows, H = 32 query heads, D = 128, fp16: the forward's CTAs and
  // K/V bytes per KV head, and the score pass's query bytes per KV head.
  auto forward_ctas = [](uint32_t L, uint32_t Hkv) {
    return uint64_t((L + k::kPrefillQueryTile - 1) / k::kPrefillQueryTile) * (32 / Hkv);
  };
  auto kv_bytes = [](uint32_t L) { return uint64_t(L) * 128 * 2 * 2; };
  auto q_bytes = [](uint32_t L, uint32_t Hkv) { return uint64_t(L) * (32 / Hkv) * 128 * 2; };
  const uint64_t sms = 132;  // the sm_90a forward's one CTA an SM: 198 CTAs make 1.5 rounds
  // 4K MHA: 32 tiles a head, 8 heads (256 CTAs, 16 MiB of K/V) the fewest that divide 32.
  CHECK(k::head_chunk(32, forward_ctas(4096, 32), sms, kv_bytes(4096)) == 8);
  // 4K GQA 32/8: 128 CTAs a KV head, 2 of them.
  CHECK(k::head_chunk(8, forward_ctas(4096, 8), sms, kv_bytes(4096)) == 2);
  // 1K MHA: 8 tiles a head, every head in one chunk.
  CHECK(k::head_chunk(32, forward_ctas(1024, 32), sms, kv_bytes(1024)) == 32);
  // The score pass at 4K MHA (32 key tiles, two CTAs an SM): 16 heads.
  CHECK(k::head_chunk(32, 32, 2 * sms, q_bytes(4096, 32)) == 16);
  // 32K: 256 tiles a head, one KV head per chunk as before.
  CHECK(k::head_chunk(32, forward_ctas(32768, 32), sms, kv_bytes(32768)) == 1);
  CHECK(k::head_chunk(8, forward_ctas(32768, 8), sms, kv_bytes(32768)) == 1);
  // The 32K GQA score pass would want two KV heads, but one group's queries are 32 MiB.
  CHECK(k::head_chunk(8, 256, 2 * sms, q_bytes(32768, 8)) == 1);
  // 28 heads in groups of 7 (4 KV heads), 2K: only divisors of 4; 7 x 16 x 2 = 224 CTAs.
  CHECK(k::head_chunk(4, 7 * 16, sms, kv_bytes(2048)) == 2);
  // 16 MiB caps the chunk: 1K at head_dim 256 would take all 32 heads, 1 MiB each.
  CHECK(k::head_chunk(32, forward_ctas(1024, 32), sms, 2 * kv_bytes(1024)) == 16);
  // Every chunk divides the KV heads, and the mapping covers each (tile, head) once.
  for (uint32_t Hkv : {1u, 2u, 3u, 4u, 8u, 32u})
    for (uint32_t per : {1u, 3u, 4u})
      for (uint32_t tiles : {1u, 3u, 32u}) {
        const uint32_t heads = Hkv * per, c = k::head_chunk(Hkv, uint64_t(tiles) * per, sms, 1024);
        REQUIRE(Hkv % c == 0);
        std::vector<int> seen(size_t(tiles) * heads, 0);
        for (uint32_t b = 0; b < tiles * heads; ++b) {
          const k::CtaTileHead th = k::cta_tile_head(b, tiles, per, c);
          REQUIRE(th.tile < tiles);
          REQUIRE(th.head >= 0);
          REQUIRE(uint32_t(th.head) < heads);
          ++seen[size_t(th.tile) * heads + uint32_t(th.head)];
        }
        CHECK(std::count(seen.begin(), seen.end(), 1) == std::ptrdiff_t(seen.size()));
      }
}

TEST_CASE("the score passes split the key tiles of short launches only") {
  // One whole prompt of L rows, every row scored (CUMULATIVE), H = 32 query heads.
  auto params = [](uint32_t L, uint32_t Hkv) {
    k::PrefillScoreParams p{};
    p.num_heads = 32;
    p.num_kv_heads = Hkv;
    p.seqs.n = 1;
    p.seqs.len[0] = L;
    p.seqs.tile_begin[1] = (L + k::kPrefillKeyTile - 1) / k::kPrefillKeyTile;
    p.col_end[0] = L;
    static float scratch;
    p.part_sums = &scratch;
    return p;
  };
  const uint64_t slots = 132 * 2, max_pairs = k::prefill_score_part_ctas(132);
  // 4K under GQA 32/8: 256 CTAs in one wave, the longest twice the mean per slot.
  CHECK(k::score_parts(params(4096, 8), slots, max_pairs) == 2);
  // 2K: 128 CTAs, the longest walk ~3.9x the mean: 4 parts, the most there are.
  CHECK(k::score_parts(params(2048, 8), slots, max_pairs) == k::kScoreMaxParts);
  // 4K under MHA: 1,024 CTAs, the longest half the mean; 32K under GQA: 2,048.
  CHECK(k::score_parts(params(4096, 32), slots, max_pairs) == 1);
  CHECK(k::score_parts(params(32768, 8), slots, max_pairs) == 1);
  // Without scratch, or a launch of more pairs than it holds: not split.
  k::PrefillScoreParams p = params(4096, 8);
  p.part_sums = nullptr;
  CHECK(k::score_parts(p, slots, max_pairs) == 1);
  CHECK(k::score_parts(params(4096, 8), slots, 255) == 1);
}
}  // TEST_SUITE

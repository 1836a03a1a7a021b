// The tensor-core decode kernel's host-side arithmetic (kernels/decode_mma_plan.h), without a
// GPU: the divisor it gets for R, and the shared-memory plan of every storage configuration
// the kernel takes (key and value bits 2/4/8/16, G 16..128 with D / G <= 8, head_dim 64 and
// 128, R from G to 4096): tiles hold whole k-steps and divide R, every staged region of a
// tile fits its stage without overlap, and the whole plan fits one CTA of an H100/H200. And
// the decode split count (kernels/decode_splits.h) at the shapes its rules were measured on.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/decode_mma_plan.h"
#include "../kernels/decode_splits.h"

namespace {

using minikv::BlockLayout;
using minikv::make_block_layout;
using minikv::kernels::FastDivU32;
using minikv::kernels::make_mma_decode_plan;
using minikv::kernels::MmaDecodePlan;

struct Region {
  uint32_t at, bytes;
  const char *what;
};

// The byte ranges a quantized tile of t tokens stages (the kernel's stage_tile).
std::vector<Region> quantized_regions(const BlockLayout &bl, const MmaDecodePlan &g, uint32_t t) {
  const uint32_t D = bl.head_dim, e = bl.elem_bytes, G = bl.group;
  std::vector<Region> r = {{0, t * g.k_stride, "key rows"}, {g.q_vcodes, t * g.v_stride, "value rows"}};
  if (bl.key_bits != 16) {
    const uint32_t groups = (t + G - 1) / G;  // every key group the tile touches
    r.push_back({g.q_kscale, groups * D * e, "key scales"});
    r.push_back({g.q_kmin, groups * D * e, "key minima"});
  }
  if (bl.value_bits != 16) {
    const uint32_t bytes = (t * (D / G) * e + 15) / 16 * 16;
    r.push_back({g.q_vscale, bytes, "value scales"});
    r.push_back({g.q_vmin, bytes, "value minima"});
  }
  return r;
}

void check_disjoint_within(const std::vector<Region> &rs, uint32_t limit) {
  for (size_t i = 0; i < rs.size(); ++i) {
    INFO(rs[i].what);
    CHECK(rs[i].at % 16 == 0);
    CHECK(uint64_t(rs[i].at) + rs[i].bytes <= limit);
    for (size_t j = i + 1; j < rs.size(); ++j) {
      INFO(rs[j].what);
      const bool apart = rs[i].at + rs[i].bytes <= rs[j].at || rs[j].at + rs[j].bytes <= rs[i].at;
      CHECK(apart);
    }
  }
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("FastDivU32 divides like the hardware for every divisor the decode uses") {
  // R (residual_length) is a multiple of 16 up to 4096; the method holds for any d < 2^31.
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (uint32_t d : {6000u, 65535u, 65536u, 1000003u, (1u << 30) + 7u, (1u << 31) - 1u})
    divisors.push_back(d);
  std::vector<uint32_t> xs = {0, 1, 2, 15, 16, 17, 127, 128, 129, 4095, 4096, 4097,
                              65535, 65536, (1u << 24) + 1, (1u << 31) - 2, (1u << 31) - 1};
  for (uint32_t k = 1; k < 2000; ++k) xs.push_back(k * 2654435761u % (1u << 31));
  for (const uint32_t d : divisors) {
    const FastDivU32 f = FastDivU32::make(d);
    for (const uint32_t x : xs) {
      if (f.div(x) != x / d) {
        FAIL("FastDivU32(" << d << ").div(" << x << ") = " << f.div(x) << ", not " << x / d);
      }
      // Around each multiple of d, where a rounding error would show first.
      const uint64_t m = uint64_t(x / d) * d;
      for (const uint64_t y : {m, m + d - 1}) {
        if (y < (1u << 31)) CHECK(f.div(uint32_t(y)) == uint32_t(y / d));
      }
    }
  }
}

TEST_CASE("the tensor-core decode plan fits every storage configuration it takes") {
  const uint32_t bits[] = {2, 4, 8, 16};
  uint32_t plans = 0;
  for (const uint32_t D : {64u, 128u}) {
    for (const uint32_t G : {16u, 32u, 64u, 128u}) {
      if (D % G != 0 || D / G > minikv::kernels::kMmaMaxGroups) continue;
      for (const uint32_t kb : bits) {
        for (const uint32_t vb : bits) {
          for (const uint32_t R : {G, 2 * G, 3 * G, 128u, 256u, 384u, 4096u}) {
            if (R % G != 0) continue;
            const BlockLayout bl = make_block_layout(R, 2, D, G, kb, vb, 2);
            const MmaDecodePlan g = make_mma_decode_plan(bl);
            INFO("D " << D << " G " << G << " K" << kb << "V" << vb << " R " << R);
            ++plans;
            // Tiles: powers of two of whole 16-token k-steps; quantized ones divide R, so a
            // tile never crosses a block.
            CHECK((g.qtile & (g.qtile - 1)) == 0);
            CHECK(g.qtile >= 16);
            CHECK(g.qtile <= minikv::kernels::kMmaMaxTile);
            CHECK(R % g.qtile == 0);
            CHECK((g.ptile & (g.ptile - 1)) == 0);
            CHECK(g.ptile >= 16);
            CHECK(g.ptile <= 64);
            CHECK((g.stages == 2 || g.stages == 3));
            // Strides: the odd number of 16-byte units the kernel's compile-time strides use
            // (decode_mma.cuh, mma_row_stride), for rows of a whole number of units.
            CHECK(bl.k_row_bytes % 16 == 0);
            CHECK(bl.v_row_bytes % 16 == 0);
            CHECK(g.k_stride == ((bl.k_row_bytes / 16) | 1) * 16);
            CHECK(g.v_stride == ((bl.v_row_bytes / 16) | 1) * 16);
            CHECK(g.p_stride == ((D * 2 / 16) | 1) * 16);
            // Every staged region of the largest tiles inside one stage, apart.
            check_disjoint_within(quantized_regions(bl, g, g.qtile), g.stage_bytes);
            check_disjoint_within({{0, g.ptile * g.p_stride, "16-bit key rows"},
                                   {g.p_v, g.ptile * g.p_stride, "16-bit value rows"}},
                                  g.stage_bytes);
            // After the stages (and the merge area, which overlays them at the end): the
            // per-warp scales and minima, the query operands and the key-operand pieces.
            const uint32_t warps = minikv::kernels::kMmaWarps, heads = minikv::kernels::kMmaMaxHeads;
            const uint32_t merge_end = g.merge_ml + warps * heads * 2 * 4;
            CHECK(g.merge_o + warps * heads * D * 4 <= g.merge_ml);
            const uint32_t tail = g.stages * g.stage_bytes > merge_end ? g.stages * g.stage_bytes : merge_end;
            const uint32_t wt = minikv::kernels::kMmaWarpTokens, mg = minikv::kernels::kMmaMaxGroups;
            check_disjoint_within({{g.sv, warps * mg * wt * 4, "value scales"},
                                   {g.mv, warps * mg * wt * 2, "value minima"},
                                   {g.qp, D / 8 * 32 * 4, "query pairs"},
                                   {g.q2, D / 8 * 32 * 4, "query pairs, key order"},
                                   {g.xs, warps * D / 16 * 32 * 16, "key-operand pieces"}},
                                  g.total);
            CHECK(g.sv >= tail);
            CHECK(g.total <= 227u * 1024u);  // one CTA's dynamic shared memory on sm_90
          }
        }
      }
    }
  }
  CHECK(plans > 300);
}

TEST_CASE("the decode split count makes the choices measured on the H200") {
  using minikv::kernels::choose_decode_splits;
  // Resident one-warp CTAs on an H200's 132 SMs: 12 per SM with one head slot, 11 with four.
  const uint64_t mha = 12 * 132, gqa = 11 * 132;
  // MHA, whole rounds: B = 8 at 32K (256 CTAs a split, 131 tiles) fills one wave with 6
  // splits; 7 (1.13 waves) measured 1.31x slower.
  CHECK(choose_decode_splits(256, 131, 13, mha, false) == 6);
  // B = 73 at 2K (2,336 CTAs, 11 tiles): 2 splits measured 1.07x faster than 1.
  CHECK(choose_decode_splits(2336, 11, 128, mha, false) == 2);
  // GQA groups of four, partial waves by their share: the Llama-3-8B engine step (2,112 CTAs,
  // 14-22 tiles over its run) measured 4.5% faster with 1 split than with the 2 that whole
  // rounds choose.
  for (uint64_t tiles : {14, 18, 22}) {
    CAPTURE(tiles);
    CHECK(choose_decode_splits(2112, tiles, 128, gqa, true) == 1);
    CHECK(choose_decode_splits(2112, tiles, 128, gqa, false) == 2);
  }
  // B = 128 at 2K (1,024 CTAs, 0.71 waves): 1 split, 1.4x faster than 2.
  CHECK(choose_decode_splits(1024, 11, 128, gqa, true) == 1);
  // Few CTAs, long caches: both rules fill one wave the same way (B = 8 and B = 1 at 32K).
  for (bool share : {false, true}) {
    CHECK(choose_decode_splits(64, 131, 46, gqa, share) == 22);
    CHECK(choose_decode_splits(8, 131, 128, gqa, share) == 66);
  }
  CHECK(choose_decode_splits(32, 131, 128, mha, false) == 44);
  // Always within [1, min(max_splits, tiles)], tiles of 0 included.
  for (uint64_t ctas : {1, 7, 100, 1000, 5000})
    for (uint64_t tiles : {0, 1, 2, 9, 130, 1000})
      for (uint64_t max_splits : {1, 5, 128})
        for (bool share : {false, true}) {
          const uint64_t s = choose_decode_splits(ctas, tiles, max_splits, gqa, share);
          CHECK(s >= 1);
          CHECK(s <= std::max<uint64_t>(std::min<uint64_t>(max_splits, tiles), 1));
        }
}

}  // TEST_SUITE

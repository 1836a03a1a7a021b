// minikv-test: white-box
// The fused split merge's combine (store_merged_head, decode_common.cuh: what the fast decode
// kernel's last CTA runs) by the warp emulator: for every head_dim, fp16 and
// bf16, and split counts from 1 to 64 (the decode tests' emulated launches take at most 7;
// the loop over splits is unrolled by 8), every output element equals the in-order fp32 sum
// Σ_s w_s · o_s / l rounded to the dtype (bit for bit: no split skipped, doubled or
// reordered) and the float64 sum within that rounding; the other heads' rows stay untouched.
// The same for store_merged_heads_staged (the one-warp kernel's: several heads, the partial
// rows staged in shared memory in batches), whose weights and sums it computes itself.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "../../kernels/decode_common.cuh"
#include "../../kernels/params.h"
#include "support.hpp"
#include "warp_emulator.h"

namespace {

namespace k = minikv::kernels;
namespace emu = minikv::emulation;

template <typename T, int D> void check_merge(uint32_t splits, minikv_dtype dtype, test::Rng &rng) {
  const uint32_t heads = 3, head = 1;  // the merged head sits between two others
  std::vector<float> part_o(size_t(heads) * splits * D), w(64, std::nanf(""));  // w past S: never read
  for (float &x : part_o) x = float(rng.normal() * 4.0);
  double l = 0.0;
  for (uint32_t s = 0; s < splits; ++s) {
    w[s] = s % 5 == 3 ? 0.0f : float(std::exp2(-rng.uniform() * 8.0));  // an empty split weighs 0
    l += w[s] * (0.5 + rng.uniform());
  }
  test::Buf out(dtype, size_t(heads) * D);
  k::DecodeParams p{};
  p.out = out.data();
  p.part_o = part_o.data();
  p.splits = splits;
  emu::launch(dim3(1), dim3(32), 0, emu::CopyLanding::kAtIssue, [&] {
    k::store_merged_head<T, D>(p, head, w.data(), float(l), emu::thread_idx().x);
  });
  for (uint32_t c = 0; c < D; ++c) {
    float in_order = 0.0f;
    double exact = 0.0, magnitude = 0.0;
    for (uint32_t s = 0; s < splits; ++s) {
      const float o = part_o[(size_t(head) * splits + s) * D + c];
      in_order = std::fmaf(w[s], o, in_order);
      exact += double(w[s]) * o;
      magnitude += std::fabs(double(w[s]) * o);
    }
    const double got = out.get(size_t(head) * D + c), mean = double(in_order / float(l));
    const double want = dtype == MINIKV_DTYPE_F16 ? ref::f16_value(ref::f16_bits(mean)) : ref::bf16_value(ref::bf16_bits(mean));
    INFO("D " << D << ", " << splits << " splits, channel " << c);
    CHECK(got == want);
    // fp32 sums of `splits` terms and a division, then the dtype's rounding.
    const double fp32 = (splits + 1) * 0x1p-24 * magnitude / l, eps = ref::dtype_eps(dtype);
    CHECK(std::fabs(got - exact / l) <= fp32 * (1 + eps) + eps * std::fabs(exact / l) + 0x1p-24);
  }
  for (uint32_t c = 0; c < D; ++c) {  // the other heads' rows are not written
    CHECK(out.get(c) == 0.0);
    CHECK(out.get(size_t(2) * D + c) == 0.0);
  }
}

// store_merged_heads_staged (the one-warp kernel's last CTA) for nh heads of `splits` partials
// each, with room for `room` rows in shared memory (1, 3 or all: one batch or several) and
// the copies landing at issue or at their wait: every output element equals the in-order
// fp32 sum Σ_s w_s · o_s / l, with w_s = exp2(m_s − max) and l = Σ_s w_s · l_s in split order
// (bit for bit), and the float64 sum within its rounding; the heads before and after stay
// untouched.
template <typename T, int D>
void check_staged_merge(uint32_t nh, uint32_t splits, uint32_t room, emu::CopyLanding landing, minikv_dtype dtype,
                        test::Rng &rng) {
  const uint32_t heads = nh + 2, head0 = 1;
  std::vector<float> part_o(size_t(heads) * splits * D), part_ml(size_t(heads) * splits * 2);
  for (float &x : part_o) x = float(rng.normal() * 4.0);
  for (uint32_t i = 0; i < heads * splits; ++i) {
    const bool empty = i % 5 == 3;  // a split with no tokens: max −inf, sum 0
    part_ml[2 * i] = empty ? -INFINITY : float(rng.normal() * 6.0);
    part_ml[2 * i + 1] = empty ? 0.0f : float(1.0 + rng.uniform() * 30.0);
  }
  if (splits > 1) part_ml[2 * (head0 * splits + 1)] = part_ml[2 * (head0 * splits)];  // a tied max
  test::Buf out(dtype, size_t(heads) * D);
  k::DecodeParams p{};
  p.out = out.data();
  p.part_o = part_o.data();
  p.part_ml = part_ml.data();
  p.splits = splits;
  const uint32_t smem = k::kStagedMergeRows + room * D * 4;
  emu::launch(dim3(1), dim3(32), smem, landing, [&] {
    MINIKV_DYNAMIC_SMEM(s, 128);
    k::store_merged_heads_staged<T, D>(p, head0, nh, s, smem, emu::thread_idx().x);
  });
  for (uint32_t r = 0; r < nh; ++r) {
    const size_t part0 = size_t(head0 + r) * splits;
    float m = -INFINITY;
    for (uint32_t s = 0; s < splits; ++s) m = std::fmax(m, part_ml[2 * (part0 + s)]);
    std::vector<float> w(splits);
    float l = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) {
      const float ms = part_ml[2 * (part0 + s)];
      w[s] = ms == -INFINITY ? 0.0f : std::exp2(ms - m);
      l = std::fmaf(w[s], part_ml[2 * (part0 + s) + 1], l);
    }
    for (uint32_t c = 0; c < D; ++c) {
      float in_order = 0.0f;
      double exact = 0.0, magnitude = 0.0;
      for (uint32_t s = 0; s < splits; ++s) {
        const float o = part_o[(part0 + s) * D + c];
        in_order = std::fmaf(w[s], o, in_order);
        exact += double(w[s]) * o;
        magnitude += std::fabs(double(w[s]) * o);
      }
      const double got = out.get(size_t(head0 + r) * D + c), mean = double(in_order / l);
      const double want = dtype == MINIKV_DTYPE_F16 ? ref::f16_value(ref::f16_bits(mean)) : ref::bf16_value(ref::bf16_bits(mean));
      INFO("D " << D << ", " << nh << " heads, " << splits << " splits, room " << room << ", head " << r
                << ", channel " << c);
      CHECK(got == want);
      const double fp32 = (splits + 1) * 0x1p-24 * magnitude / l, eps = ref::dtype_eps(dtype);
      CHECK(std::fabs(got - exact / l) <= fp32 * (1 + eps) + eps * std::fabs(exact / l) + 0x1p-24);
    }
  }
  for (uint32_t c = 0; c < D; ++c) {  // the heads around them are not written
    CHECK(out.get(c) == 0.0);
    CHECK(out.get(size_t(heads - 1) * D + c) == 0.0);
  }
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the staged split merge sums every split of every head in order") {
  test::Rng rng(0x57a6ed);
  const auto at_issue = emu::CopyLanding::kAtIssue, at_wait = emu::CopyLanding::kAtWait;
  for (uint32_t nh : {1u, 2u, 3u, 4u})
    for (uint32_t splits : {2u, 3u, 7u, 11u, 16u, 17u, 32u, 64u}) {
      if (nh * splits > 64) continue;
      const uint32_t all = nh * splits;
      for (uint32_t room : {1u, 3u, all}) {
        const auto landing = room == 3 ? at_wait : at_issue;
        check_staged_merge<__half, 64>(nh, splits, room, landing, MINIKV_DTYPE_F16, rng);
        check_staged_merge<__half, 128>(nh, splits, room, at_wait, MINIKV_DTYPE_F16, rng);
        check_staged_merge<__nv_bfloat16, 128>(nh, splits, room, landing, MINIKV_DTYPE_BF16, rng);
        check_staged_merge<__nv_bfloat16, 256>(nh, splits, room, at_wait, MINIKV_DTYPE_BF16, rng);
      }
    }
}


TEST_CASE("the fused split merge sums every split in order") {
  test::Rng rng(0x3e26e);
  for (uint32_t splits : {1u, 2u, 7u, 8u, 9u, 15u, 16u, 17u, 33u, 35u, 64u}) {
    check_merge<__half, 64>(splits, MINIKV_DTYPE_F16, rng);
    check_merge<__half, 128>(splits, MINIKV_DTYPE_F16, rng);
    check_merge<__nv_bfloat16, 128>(splits, MINIKV_DTYPE_BF16, rng);
    check_merge<__nv_bfloat16, 256>(splits, MINIKV_DTYPE_BF16, rng);
  }
}
}  // TEST_SUITE

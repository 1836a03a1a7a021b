// minikv-test: white-box
// The fused split merge's combine (store_merged_head, decode_common.cuh: what the one-warp and
// the fast decode kernels' last CTA runs) by the warp emulator: for every head_dim, fp16 and
// bf16, and split counts from 1 to 64 (the decode tests' emulated launches take at most 7;
// the loop over splits is unrolled by 8), every output element equals the in-order fp32 sum
// Σ_s w_s · o_s / l rounded to the dtype (bit for bit: no split skipped, doubled or
// reordered) and the float64 sum within that rounding; the other heads' rows stay untouched.
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

}  // namespace

TEST_SUITE("cpu") {
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

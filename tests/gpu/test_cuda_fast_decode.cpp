// The fast decode path (2-bit keys and values, G = 16, head_dim 64/128, GQA 1/2/4/8) in fp16
// and bf16 against the CPU backend through the public C API: prefill outputs, kept positions
// and decode outputs at every step across residual flushes (R from 32 to 256), ragged batches
// including 1-token prompts, both score modes; bf16 and fp16 at head_dim 64 and 128 with GQA
// groups 1, 2, 4 and 8; fp16 decode queries of extreme magnitude (std 2^-12: a fifth of them
// fp16 subnormals, the largest per-column prescale of the fp16 QK pieces; std 8: logits in the
// hundreds). The fast kernel is forced; where the plan takes the one-warp kernel for this
// storage (groups of 2 to 4 heads) the plan runs too. Skipped when no CUDA device is present.
#include <doctest/doctest.h>

#include <cstdio>
#include <memory>
#include <numeric>
#include <string>

#include "../../kernels/decode_k4v2_plan.h"
#include "cpu_gpu_pair.h"

namespace {

using gt::Case;
using gt::run_case;

const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
const minikv_score_mode CUM = MINIKV_SCORE_CUMULATIVE, WIN = MINIKV_SCORE_WINDOW;
const minikv_budget_policy UNI = MINIKV_BUDGET_UNIFORM, PYR = MINIKV_BUDGET_PYRAMID;

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("fast decode path matches the CPU backend in bf16 and fp16 across residual chunks") {
  GPU_OR_CHECK_CONFIGS();
  const std::vector<Case> cases = {
      {"bf16 hd128 mha 2/2 G16 R128 long", BF16, 128, 4, 4, CUM, 2, 2, 16, 128, UNI, 0.25f, 0.25f,
       {2100, 700}, 12},
      {"bf16 hd128 gqa4 2/2 G16 R64", BF16, 128, 8, 2, CUM, 2, 2, 16, 64, UNI, 0.25f, 0.25f,
       {1, 64, 65, 1500}, 70},
      {"bf16 hd64 gqa8 2/2 G16 R32 window", BF16, 64, 16, 2, WIN, 2, 2, 16, 32, UNI, 0.25f, 0.25f,
       {500, 90}, 40},
      {"f16 hd64 mha 2/2 G16 R128", F16, 64, 4, 4, CUM, 2, 2, 16, 128, UNI, 0.3f, 0.2f, {3000}, 20},
      {"bf16 hd128 gqa2 R256 (two residual chunks)", BF16, 128, 4, 2, CUM, 2, 2, 16, 256, UNI, 0.25f,
       0.25f, {1200}, 300},
      // bf16 over every compiled head_dim and the GQA groups 1/4/8 of both head_dims, with a
      // residual spanning many 16-row chunks and splits ending inside a tile.
      {"bf16 hd64 mha R256 long", BF16, 64, 4, 4, CUM, 2, 2, 16, 256, UNI, 0.25f, 0.25f, {3000, 47},
       280},
      {"bf16 hd64 gqa4 R128 pyramid", BF16, 64, 8, 2, CUM, 2, 2, 16, 128, PYR, 0.25f, 0.25f,
       {1900, 16, 300}, 140},
      {"bf16 hd128 gqa8 R128", BF16, 128, 16, 2, CUM, 2, 2, 16, 128, UNI, 0.25f, 0.25f, {2500, 33},
       140},
      {"f16 hd128 mha R64", F16, 128, 4, 4, CUM, 2, 2, 16, 64, UNI, 0.25f, 0.25f, {2100, 129}, 70},
      {"f16 hd128 gqa4 R128 window", F16, 128, 8, 2, WIN, 2, 2, 16, 128, UNI, 0.25f, 0.25f, {1800},
       140},
      // fp16 QK as fp16 mma with prescaled pieces (kernels/qk_pieces.h): every compiled GQA
      // group at head_dim 128 and 64, and queries far from unit scale.
      {"f16 hd128 gqa2 R128", F16, 128, 8, 4, CUM, 2, 2, 16, 128, UNI, 0.25f, 0.25f, {1500, 300}, 30},
      {"f16 hd128 gqa8 R64", F16, 128, 16, 2, CUM, 2, 2, 16, 64, UNI, 0.25f, 0.25f, {1300, 33}, 70},
      {"f16 hd64 gqa8 R32 window", F16, 64, 16, 2, WIN, 2, 2, 16, 32, UNI, 0.25f, 0.25f, {700, 90}, 40},
      {"f16 hd64 gqa2 R128", F16, 64, 4, 2, CUM, 2, 2, 16, 128, PYR, 0.25f, 0.25f, {1100}, 20},
      {"f16 hd128 mha tiny queries (subnormal q)", F16, 128, 4, 4, CUM, 2, 2, 16, 128, UNI, 0.25f,
       0.25f, {1600, 200}, 20, 0x1.0p-12f},
      {"f16 hd128 gqa4 large queries", F16, 128, 8, 2, CUM, 2, 2, 16, 128, UNI, 0.25f, 0.25f,
       {1600, 200}, 20, 8.0f},
  };
  // The fast kernel forced in every case, and the plan's where it takes the one-warp kernel
  // for this storage instead (k4v2_warp_before_fast).
  for (const Case &c : cases) {
    const uint32_t n_rep = c.heads / c.kv_heads;
    for (const char *kernel : {"fast", static_cast<const char *>(nullptr)}) {
      if (!kernel && !minikv::kernels::k4v2_warp_before_fast(n_rep, c.head_dim)) continue;
      const std::string name = std::string(c.name) + (kernel ? " (fast)" : " (plan)");
      SUBCASE(name.c_str()) {
        const gt::DecodeKernelChoice choice(kernel);
        run_case(c);
      }
    }
  }
}

}  // TEST_SUITE

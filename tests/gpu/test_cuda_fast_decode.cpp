// The fast decode path (2-bit keys and values, G = 16, head_dim 64/128, GQA 1/2/4/8) in fp16
// and bf16 against the CPU backend through the public C API: prefill outputs, kept positions
// and decode outputs at every step across residual flushes (R from 32 to 256), ragged batches
// including 1-token prompts, both score modes. Skipped when no CUDA device is present.
#include <doctest/doctest.h>

#include <cstdio>
#include <memory>
#include <numeric>

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
  GPU_OR_SKIP();
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
  };
  for (const Case &c : cases) {
    SUBCASE(c.name) { run_case(c); }
  }
}

}  // TEST_SUITE

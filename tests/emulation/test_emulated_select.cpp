// minikv-test: white-box
// The prefill's selection kernel (select_quantize.cu select_kernel: a radix select of the
// heavy hitters and a compaction in position order) run by the warp emulator on the CPU, on
// the GPU storage test's cases (tests/selection_cases.hpp): the kept positions of every
// (sequence, KV head) must equal select_kept's, ties, NaN and signed zeros included.
#include "../../kernels/select_quantize.cu"
#include "../../kernels/select_plan.h"
#include "../selection_cases.hpp"
#include "warp_emulator.h"

namespace {

namespace k = minikv::kernels;

// cuda_debug_select (kernels/cuda_backend.cpp) with host buffers and the emulated kernel.
std::vector<std::vector<int32_t>> emulated_select(const std::vector<minikv::SelectionPlan> &plans,
                                                  const std::vector<std::vector<float>> &scores, uint32_t kv_heads,
                                                  uint32_t pool_kernel) {
  REQUIRE(plans.size() <= k::kMaxPrefillSeqs);
  REQUIRE(scores.size() == plans.size() * kv_heads);
  k::SelectionRun run(plans, scores, kv_heads, pool_kernel);
  std::vector<int32_t> all(run.scores.size(), -7);
  run.params.scores = run.scores.data();
  run.params.kept = all.data();
  minikv::emulation::launch(dim3(uint32_t(plans.size()), kv_heads), dim3(k::kSelectThreads), 0,
                            minikv::emulation::CopyLanding::kAtIssue, [&] { k::select_kernel(run.params); });
  return run.kept(all, plans, kv_heads);
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the selection kernel run by the warp emulator keeps select_kept's positions") {
  // Under AddressSanitizer (~20x slower here: 1,024 fibers a CTA) the prompts up to two sweeps.
  if (minikv::emulation::kAddressSanitizer) selection_cases::check_all(emulated_select, {37, 1000, 8192 + 41});
  else selection_cases::check_all(emulated_select, {37, 1000, 8192 + 41, 30001});
}
}  // TEST_SUITE

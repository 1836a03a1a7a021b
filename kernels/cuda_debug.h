// Test hooks of the CUDA backend, for the white-box suites in tests/gpu (not library API).
#pragma once

#include <cstdint>
#include <vector>

#include "../src/backend.h"
#include "../src/policy.h"

namespace minikv {

// The importance scores of KV head `kv_head` that the last prefill launch left in the
// workspace, columns [0, count) before max-pooling: the launch's sequences back to back,
// each at a multiple of four columns (after a sequence of L rows the next starts
// (L + 3) / 4 * 4 columns on). Synchronizes the device. Throws INVALID_ARGUMENT when
// `backend` is not the CUDA backend.
std::vector<float> cuda_debug_scores(const Backend &backend, uint32_t kv_head, uint32_t count);

// The selection kernel alone, one launch over every (sequence, KV head): sequence s has
// plans[s] and the scores scores[s * kv_heads + h] (indexed by position, at least
// prompt_len of them), pooled with width pool_kernel over [0, scored_prefix) when
// pool_kernel > 1 and the plan needs scores. Returns the kept positions of each (sequence,
// KV head) in the same order, n_keep of them, as select_kept writes them after the CPU
// backend's pooling. Runs on the current device and synchronizes it.
std::vector<std::vector<int32_t>> cuda_debug_select(const std::vector<SelectionPlan> &plans,
                                                    const std::vector<std::vector<float>> &scores,
                                                    uint32_t kv_heads, uint32_t pool_kernel);

}  // namespace minikv

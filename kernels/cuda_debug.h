// Test hooks of the CUDA backend, for the white-box suites in tests/gpu (not library API).
#pragma once

#include <cstdint>
#include <vector>

#include "../src/backend.h"

namespace minikv {

// The importance scores of KV head `kv_head` that the last prefill launch left in the
// workspace (the launch's sequences packed back to back; one sequence: its columns
// [0, count), before max-pooling). Synchronizes the device. Throws INVALID_ARGUMENT when
// `backend` is not the CUDA backend.
std::vector<float> cuda_debug_scores(const Backend &backend, uint32_t kv_head, uint32_t count);

}  // namespace minikv

// A sequence's entry of select_kernel's parameters from its SelectionPlan: shared by the CUDA
// backend's prefill and by the runs of the kernel alone (cuda_debug_select and its CPU
// emulation in tests/emulation).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../src/backend.h"  // plan_needs_scores
#include "params.h"

namespace minikv {
namespace kernels {

// Sequence b's kept indices whose positions are known before select_kernel runs, as it
// writes them: the sinks, then (mode 2 only) the n_heavy chosen, then the protected suffix
// from `candidates` (keep all: every position in order).
inline void set_store_positions(StoreParams &st, uint32_t b, const SelectionPlan &plan) {
  st.chosen_end[b] = plan.n_sink + (plan_needs_scores(plan) ? plan.n_heavy : 0);
  st.suffix_begin[b] = plan.keep_all ? plan.n_sink : plan.candidates;
}

// Sequence b's selection from its plan (its seqs entry is the caller's); pooled: WINDOW
// scores max-pooled over the scored prefix (pool_kernel > 1).
inline void set_selection(SelectParams &sel, uint32_t b, const SelectionPlan &plan, bool pooled) {
  const bool scored = plan_needs_scores(plan);
  sel.mode[b] = plan.keep_all ? 0 : scored ? 2 : 1;
  sel.candidates[b] = plan.keep_all ? plan.prompt_len : plan.candidates;
  sel.n_sink[b] = plan.n_sink;
  sel.n_heavy[b] = plan.keep_all ? 0 : plan.n_heavy;
  sel.n_keep[b] = plan.n_keep;
  sel.scored_prefix[b] = scored && pooled ? plan.scored_prefix : 0;
}

// One launch of select_kernel alone over sequences with `plans` and score rows scores[s *
// kv_heads + h] (at least prompt_len each): the parameters (the caller sets scores and kept),
// the packed scores [kv_heads][ws_tokens] and the kept positions read back. Each sequence's
// workspace rows start 3 rows after the previous one's end: offsets that are not a multiple
// of a vector width.
struct SelectionRun {
  SelectParams params{};
  std::vector<float> scores;

  SelectionRun(const std::vector<SelectionPlan> &plans, const std::vector<std::vector<float>> &rows,
               uint32_t kv_heads, uint32_t pool_kernel) {
    params.pool_kernel = pool_kernel;
    uint32_t ws = 0;
    for (uint32_t s = 0; s < plans.size(); ++s) {
      params.seqs.n = s + 1;
      params.seqs.len[s] = plans[s].prompt_len;
      params.seqs.ws_offset[s] = ws;
      set_selection(params, s, plans[s], pool_kernel > 1);
      ws += plans[s].prompt_len + 3;
    }
    params.ws_tokens = ws;
    scores.assign(size_t(kv_heads) * ws, 0.0f);
    for (uint32_t s = 0; s < plans.size(); ++s)
      for (uint32_t h = 0; h < kv_heads; ++h)
        std::copy_n(rows[size_t(s) * kv_heads + h].begin(), plans[s].prompt_len,
                    scores.begin() + size_t(h) * ws + params.seqs.ws_offset[s]);
  }
  // The kept positions of each (sequence, KV head), in the order of the score rows, from the
  // kernel's kept array ([kv_heads][ws_tokens]).
  std::vector<std::vector<int32_t>> kept(const std::vector<int32_t> &all, const std::vector<SelectionPlan> &plans,
                                         uint32_t kv_heads) const {
    std::vector<std::vector<int32_t>> out;
    for (uint32_t s = 0; s < plans.size(); ++s)
      for (uint32_t h = 0; h < kv_heads; ++h) {
        const auto at = all.begin() + size_t(h) * params.ws_tokens + params.seqs.ws_offset[s];
        out.emplace_back(at, at + plans[s].n_keep);
      }
    return out;
  }
};

}  // namespace kernels
}  // namespace minikv

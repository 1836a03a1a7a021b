// The selection kernel's cases, shared by the GPU storage test (the kernel on a device) and
// the emulated one (the kernel on the CPU, tests/emulation): scores made to stress the radix
// select and the compaction, against the CPU backend's path (max_pool_1d over the scored
// prefix, then select_kept).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "minikv.h"
#include "backend.h"  // plan_needs_scores
#include "policy.h"

namespace selection_cases {

// select(plans, scores, kv_heads, pool_kernel) -> the kept positions of each (sequence, KV
// head), as cuda_debug_select (kernels/cuda_debug.h) returns them.
using Select = std::function<std::vector<std::vector<int32_t>>(
    const std::vector<minikv::SelectionPlan> &, const std::vector<std::vector<float>> &, uint32_t, uint32_t)>;

// Continuous values, a few distinct values (long runs of exact ties at the threshold), signed
// zeros, infinities and NaN, all equal, all NaN, values within 4,096 ulps of 1 (only the low
// 12 bits differ: the radix select's last digits decide, with ties); prompts shorter than, equal to and several
// times the kernel's 8,192-key sweep (`lens`); 0, 3 and 4 sinks (the candidates then start
// at an odd or an even position); CUMULATIVE (no pooling) and WINDOW with pool widths 3, 7
// and 17.
inline void check_all(const Select &select, const std::vector<uint32_t> &lens) {
  enum Kind { kContinuous, kFewValues, kSpecials, kAllEqual, kAllNaN, kNearOne };
  constexpr uint32_t kKinds = kNearOne + 1;
  auto make_scores = [](Kind kind, uint32_t L, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    std::vector<float> s(L);
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 0.5f, 0.25f, -1.0f};
    for (uint32_t j = 0; j < L; ++j) {
      switch (kind) {
        case kContinuous: s[j] = u(rng) * u(rng); break;
        case kFewValues: s[j] = 0.25f * static_cast<float>(rng() % 4); break;
        case kSpecials: s[j] = rng() % 3 == 0 ? specials[rng() % 8] : 0.25f * static_cast<float>(rng() % 3); break;
        case kAllEqual: s[j] = 0.125f; break;
        case kAllNaN: s[j] = NAN; break;
        case kNearOne: {
          const uint32_t bits = 0x3f800000u + static_cast<uint32_t>(rng() % 4096);
          std::memcpy(&s[j], &bits, sizeof bits);
          break;
        }
      }
    }
    return s;
  };
  for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
    for (uint32_t pool : mode == MINIKV_SCORE_WINDOW ? std::vector<uint32_t>{3, 7, 17} : std::vector<uint32_t>{1}) {
      for (uint32_t sinks : {0u, 3u, 4u}) {
        for (float heavy : {0.25f, 0.01f}) {
          minikv_config cfg;
          minikv_config_default(&cfg);
          cfg.score_mode = mode;
          cfg.pool_kernel = pool;
          cfg.sink_tokens = sinks;
          cfg.heavy_ratio = heavy;
          cfg.recent_ratio = 0.25f;
          std::vector<minikv::SelectionPlan> plans;
          std::vector<std::vector<float>> scores;
          const uint32_t kv_heads = 2;
          uint32_t seed = 1;
          for (uint32_t L : lens)
            for (Kind kind : {kContinuous, kFewValues, kSpecials, kAllEqual, kAllNaN, kNearOne}) {
              plans.push_back(minikv::plan_selection(cfg, heavy, L));
              for (uint32_t h = 0; h < kv_heads; ++h) scores.push_back(make_scores(kind, L, seed++));
            }
          INFO("mode " << int(mode) << " pool " << pool << " sinks " << sinks << " heavy " << heavy);
          const auto got = select(plans, scores, kv_heads, pool);
          REQUIRE(got.size() == scores.size());
          for (size_t i = 0; i < scores.size(); ++i) {
            const minikv::SelectionPlan &plan = plans[i / kv_heads];
            std::vector<float> pooled = scores[i];
            if (minikv::plan_needs_scores(plan) && pool > 1)
              minikv::max_pool_1d(scores[i].data(), pooled.data(), plan.scored_prefix, pool);
            std::vector<int32_t> want(plan.n_keep);
            std::vector<uint32_t> scratch(plan.prompt_len);
            minikv::select_kept(plan, pooled.data(), want.data(), scratch.data());
            INFO("row " << i << " (L " << plan.prompt_len << ", kind " << (i / kv_heads) % kKinds
                        << ", heavy " << plan.n_heavy << " of " << plan.candidates << ")");
            CHECK(got[i] == want);
          }
        }
      }
    }
  }
}

}  // namespace selection_cases

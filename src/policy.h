// Budget policies and token selection: host-side, backend-agnostic, deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "minikv.h"

namespace minikv {

// Heavy-hitter ratio h_l of every layer (UNIFORM: h, unclipped, so h = 1 keeps every
// prompt; PYRAMID: linear from h*(2-1/depth) at layer 0 to h/depth at the top, clipped so
// h_l + recent_ratio <= 1).
std::vector<double> layer_heavy_ratios(const minikv_config &cfg);

// What one (sequence, layer) keeps of an L-token prompt. Sizes only, so every backend and
// the host bookkeeping agree without looking at data.
struct SelectionPlan {
  uint32_t prompt_len = 0;   // L
  uint32_t n_heavy = 0;      // heavy hitters chosen among [0, candidates)
  uint32_t candidates = 0;   // L - protected suffix; 0 when everything is kept
  uint32_t n_keep = 0;       // kept per KV head
  bool keep_all = false;
  uint32_t scored_prefix = 0;  // WINDOW mode: keys [0, scored_prefix) get window scores
};

// n_hh = floor(h_l * L), n_rw = floor(r * L); WINDOW mode also protects the last
// min(window_size, L) tokens. Keeps everything when n_hh + protected >= L.
SelectionPlan plan_selection(const minikv_config &cfg, double heavy_ratio, uint32_t prompt_len);

// Picks the n_heavy best of scores[0, candidates) (higher score first, ties to the lower
// position, NaN lowest), appends the protected suffix [candidates, L) and writes the
// n_keep kept positions in ascending order. `scratch` must hold `candidates` entries.
void select_kept(const SelectionPlan &plan, const float *scores, int32_t *kept,
                 uint32_t *scratch);

// out[j] = max(in[j - k/2 .. j + k/2] ∩ [0, n)): SnapKV's max-pool, stride 1, same padding.
void max_pool_1d(const float *in, float *out, uint32_t n, uint32_t kernel);

}  // namespace minikv

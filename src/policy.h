// Budget policies and token selection: host-side, backend-agnostic, deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "minikv.h"

namespace minikv {

// The decimal a caller means by a float field: the shortest decimal that rounds to it (0.7f
// = 0.699999988 is read as 0.7), so budgets of decimal ratios are their decimal products
// (0.7 x 1000 keeps 700 tokens, not 699).
double decimal_value(float x);

// Heavy-hitter ratio h_l of every layer (UNIFORM: h, unclipped, so h = 1 keeps every
// prompt; PYRAMID: linear from h*(2-1/depth) at layer 0 to h/depth at the top, clipped so
// h_l + recent_ratio <= 1).
std::vector<double> layer_heavy_ratios(const minikv_config &cfg);

// What one (sequence, layer) keeps of an L-token prompt. Sizes only, so every backend and
// the host bookkeeping agree without looking at data. Kept positions, ascending: the sinks
// [0, n_sink), the n_heavy heavy hitters of [n_sink, candidates), the protected suffix
// [candidates, L) (keep_all: every position, the first n_sink of them sinks).
struct SelectionPlan {
  uint32_t prompt_len = 0;   // L
  uint32_t n_sink = 0;       // min(sink_tokens, L): stored unquantized, in the sink region
  uint32_t n_heavy = 0;      // heavy hitters chosen among [n_sink, candidates)
  uint32_t candidates = 0;   // end of the candidate range: L - protected suffix; 0 when
                             // everything is kept
  uint32_t n_keep = 0;       // kept per KV head, sinks included
  bool keep_all = false;
  uint32_t scored_prefix = 0;  // WINDOW mode: keys [0, scored_prefix) get window scores
};

// n_sink = min(S, L), n_hh = floor(h_l * L), n_rw = floor(r * L) with r =
// decimal_value(recent_ratio); WINDOW mode also protects the last min(window_size, L)
// tokens. The sinks count inside the heavy-hitter budget: n_heavy = max(0, n_hh - n_sink). Keeps everything when n_hh + protected >= L or
// when the sinks and the protected suffix cover the prompt.
SelectionPlan plan_selection(const minikv_config &cfg, double heavy_ratio, uint32_t prompt_len);

// Whether any prefill of `cfg` can need importance scores: a layer with heavy hitters to
// choose and a budget below the whole prompt. Otherwise no score workspace is reserved.
bool scores_possible(const minikv_config &cfg);

// Writes the n_keep kept positions in ascending order: the sinks, the n_heavy best of
// scores[n_sink, candidates) (higher score first, ties to the lower position, NaN lowest)
// and the protected suffix [candidates, L). `scores` is indexed by position; `scratch`
// must hold `candidates` entries.
void select_kept(const SelectionPlan &plan, const float *scores, int32_t *kept,
                 uint32_t *scratch);

// out[j] = max(in[j - k/2 .. j + k/2] ∩ [0, n)): SnapKV's max-pool, stride 1, same padding.
void max_pool_1d(const float *in, float *out, uint32_t n, uint32_t kernel);

}  // namespace minikv

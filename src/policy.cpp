#include "policy.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace minikv {

namespace {
// floor(ratio * L). The slack of 1e-12 (1 + L) absorbs the rounding of the double arithmetic
// behind a ratio (PYRAMID's line: a few ulps of ratios <= 2), so a product that is an integer
// in exact arithmetic (h = 0.25, depth 7, 4 layers: h_1 * 84 = 27) keeps that integer;
// it is far below the distance of any other product of a decimal ratio from an integer.
uint32_t budget_tokens(double ratio, uint32_t prompt_len) {
  const double L = static_cast<double>(prompt_len);
  return static_cast<uint32_t>(std::floor(ratio * L + 1e-12 * (1.0 + L)));
}
}  // namespace

double decimal_value(float x) {
  char text[32];
  const std::to_chars_result shortest = std::to_chars(text, text + sizeof(text), x);
  double value = x;
  std::from_chars(text, shortest.ptr, value);
  return value;
}

std::vector<double> layer_heavy_ratios(const minikv_config &cfg) {
  const uint32_t m = cfg.num_layers;
  const double h = decimal_value(cfg.heavy_ratio), r = decimal_value(cfg.recent_ratio);
  std::vector<double> ratios(m, h);
  // A budget of the whole prompt (h + r >= 1, e.g. heavy_ratio = 1) keeps every layer whole
  // under either policy: the pyramid would take from the top layers what the bottom ones,
  // which already hold their whole prompt, cannot use.
  const bool whole = h + r >= 1.0 - 1e-12;
  if (cfg.budget_policy == MINIKV_BUDGET_PYRAMID && m > 1 && !whole) {
    const double delta = decimal_value(cfg.pyramid_depth);
    const double bottom = h * (2.0 - 1.0 / delta), top = h / delta;
    for (uint32_t l = 0; l < m; ++l)
      ratios[l] = bottom + (top - bottom) * static_cast<double>(l) / static_cast<double>(m - 1);
  }
  if (cfg.budget_policy == MINIKV_BUDGET_PYRAMID) {
    for (double &x : ratios) x = std::max(0.0, std::min(x, 1.0 - r));
  }
  return ratios;
}

SelectionPlan plan_selection(const minikv_config &cfg, double heavy_ratio, uint32_t prompt_len) {
  SelectionPlan p;
  p.prompt_len = prompt_len;
  p.n_sink = std::min(cfg.sink_tokens, prompt_len);
  const uint32_t n_heavy = budget_tokens(heavy_ratio, prompt_len);
  const double recent_ratio = decimal_value(cfg.recent_ratio);
  uint32_t n_protected = budget_tokens(recent_ratio, prompt_len);
  if (cfg.score_mode == MINIKV_SCORE_WINDOW) {
    const uint32_t window = std::min(cfg.window_size, prompt_len);
    n_protected = std::max(n_protected, window);
    p.scored_prefix = prompt_len - window;
  }
  // A budget of the whole prompt (h_l + r >= 1, e.g. heavy_ratio = 1, which the clip
  // h_l <= 1 - r turns into 1 - r) keeps everything, even where floor(h_l L) + floor(r L)
  // rounds down to L - 1.
  const bool whole = heavy_ratio + recent_ratio >= 1.0 - 1e-12;
  if (whole || static_cast<uint64_t>(std::max(n_heavy, p.n_sink)) + n_protected >= prompt_len) {
    p.keep_all = true;
    p.n_keep = prompt_len;
    return p;
  }
  p.n_heavy = n_heavy - std::min(n_heavy, p.n_sink);
  p.candidates = prompt_len - n_protected;
  p.n_keep = p.n_sink + p.n_heavy + n_protected;
  return p;
}

bool scores_possible(const minikv_config &cfg) {
  const double r = decimal_value(cfg.recent_ratio);
  for (double h : layer_heavy_ratios(cfg))
    if (h > 0.0 && h + r < 1.0 - 1e-12) return true;
  return false;
}

void select_kept(const SelectionPlan &plan, const float *scores, int32_t *kept,
                 uint32_t *scratch) {
  uint32_t n = 0;
  if (plan.keep_all) {
    for (uint32_t j = 0; j < plan.prompt_len; ++j) kept[n++] = static_cast<int32_t>(j);
    return;
  }
  for (uint32_t j = 0; j < plan.n_sink; ++j) kept[n++] = static_cast<int32_t>(j);
  if (plan.n_heavy > 0) {
    const uint32_t count = plan.candidates - plan.n_sink;
    for (uint32_t i = 0; i < count; ++i) scratch[i] = plan.n_sink + i;
    auto key = [&](uint32_t j) {
      const float s = scores[j];
      return std::isnan(s) ? -INFINITY : s;
    };
    auto better = [&](uint32_t a, uint32_t b) {
      const float sa = key(a), sb = key(b);
      return sa > sb || (sa == sb && a < b);
    };
    std::nth_element(scratch, scratch + (plan.n_heavy - 1), scratch + count, better);
    std::sort(scratch, scratch + plan.n_heavy);
    for (uint32_t i = 0; i < plan.n_heavy; ++i) kept[n++] = static_cast<int32_t>(scratch[i]);
  }
  for (uint32_t j = plan.candidates; j < plan.prompt_len; ++j) kept[n++] = static_cast<int32_t>(j);
}

void max_pool_1d(const float *in, float *out, uint32_t n, uint32_t kernel) {
  const int64_t half = kernel / 2;
  for (int64_t j = 0; j < static_cast<int64_t>(n); ++j) {
    const int64_t lo = std::max<int64_t>(0, j - half);
    const int64_t hi = std::min<int64_t>(n - 1, j + half);
    float m = in[lo];
    for (int64_t i = lo + 1; i <= hi; ++i) m = std::max(m, in[i]);
    out[j] = m;
  }
}

}  // namespace minikv

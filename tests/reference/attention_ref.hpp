// float64 oracles for prefill (causal attention with GQA, LSE, CUMULATIVE and WINDOW
// importance scores), token selection, budget policies, and decode attention. Written from
// ../shared/MINIKV.md, independently of src/: plain loops, max-subtracted softmax in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace ref {

// Result of the prefill oracle for one sequence of L tokens.
struct PrefillResult {
  std::vector<double> out;     // [L][H][D]
  std::vector<double> lse;     // [L][H] log-sum-exp of the scaled logits of each row
  std::vector<double> cumul;   // [Hkv][L] sum over all queries i >= j and the group's heads
  std::vector<double> window;  // [Hkv][L] the same over queries i >= L - w only (unpooled)
};

// q: [L][H][D], k, v: [L][Hkv][D] (one sequence). Query head h uses KV head h / (H / Hkv).
inline PrefillResult prefill(const std::vector<double> &q, const std::vector<double> &k,
                             const std::vector<double> &v, uint32_t L, uint32_t H,
                             uint32_t Hkv, uint32_t D, uint32_t window_size) {
  PrefillResult r;
  r.out.assign(size_t(L) * H * D, 0.0);
  r.lse.assign(size_t(L) * H, 0.0);
  r.cumul.assign(size_t(Hkv) * L, 0.0);
  r.window.assign(size_t(Hkv) * L, 0.0);
  const uint32_t group = H / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const uint32_t window_from = L - std::min(window_size, L);
  std::vector<double> p(L);
  for (uint32_t h = 0; h < H; ++h) {
    const uint32_t g = h / group;
    for (uint32_t i = 0; i < L; ++i) {
      const double *qi = &q[(size_t(i) * H + h) * D];
      double m = -INFINITY;
      for (uint32_t j = 0; j <= i; ++j) {
        const double *kj = &k[(size_t(j) * Hkv + g) * D];
        double s = 0.0;
        for (uint32_t c = 0; c < D; ++c) s += qi[c] * kj[c];
        p[j] = s * scale;
        m = std::max(m, p[j]);
      }
      double sum = 0.0;
      for (uint32_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - m));
      r.lse[size_t(i) * H + h] = m + std::log(sum);
      double *o = &r.out[(size_t(i) * H + h) * D];
      for (uint32_t j = 0; j <= i; ++j) {
        const double pj = p[j] / sum;
        const double *vj = &v[(size_t(j) * Hkv + g) * D];
        for (uint32_t c = 0; c < D; ++c) o[c] += pj * vj[c];
        r.cumul[size_t(g) * L + j] += pj;
        if (i >= window_from) r.window[size_t(g) * L + j] += pj;
      }
    }
  }
  return r;
}

// Same-padding, stride-1 max pool of odd width `kernel` (window clipped at the edges).
inline std::vector<double> max_pool(const std::vector<double> &x, uint32_t kernel) {
  const int64_t n = static_cast<int64_t>(x.size()), half = kernel / 2;
  std::vector<double> y(x.size());
  for (int64_t j = 0; j < n; ++j) {
    double m = -INFINITY;
    for (int64_t i = j - half; i <= j + half; ++i)
      if (i >= 0 && i < n) m = std::max(m, x[size_t(i)]);
    y[size_t(j)] = m;
  }
  return y;
}

// Heavy-hitter ratio of each layer (MINIKV.md §2): UNIFORM h_l = h; PYRAMID linear from
// h (2 - 1/depth) to h / depth, clipped so h_l + r <= 1; h in every layer (clipped) when
// h + r >= 1, the whole prompt everywhere.
inline std::vector<double> layer_ratios(bool pyramid, uint32_t layers, double h, double r,
                                        double depth) {
  std::vector<double> out(layers, h);
  if (!pyramid) return out;
  if (layers > 1 && h + r < 1.0 - 1e-12) {
    const double bottom = h * (2.0 - 1.0 / depth), top = h / depth;
    for (uint32_t l = 0; l < layers; ++l)
      out[l] = bottom - (bottom - top) * l / double(layers - 1);
  }
  for (double &x : out) x = std::min(std::max(x, 0.0), 1.0 - r);
  return out;
}

struct Budget {
  uint32_t n_sink = 0;       // the first positions, always kept (unquantized)
  uint32_t n_heavy = 0;      // chosen by score among [n_sink, L - n_protected)
  uint32_t n_protected = 0;  // always-kept suffix
  bool keep_all = false;
  uint32_t kept() const { return n_sink + n_heavy + n_protected; }
};

// n_hh = floor(h L), n_rw = floor(r L); WINDOW mode protects at least the last w tokens.
// The first min(S, L) positions are sinks, counted inside the heavy-hitter budget: the
// heavy hitters are n_hh - n_sink (none when the sinks alone exceed it). Everything is
// kept when the budget, or the sinks and the protected suffix, cover the prompt. (The tiny
// slack absorbs ratios like 0.3f that sit a hair below an exact multiple.)
inline Budget budget(double heavy_ratio, double recent_ratio, uint32_t L, bool window_mode,
                     uint32_t window_size, uint32_t sink_tokens = 0) {
  auto fl = [](double x) { return static_cast<uint32_t>(std::floor(x + 1e-7)); };
  Budget b;
  b.n_sink = std::min(sink_tokens, L);
  const uint32_t n_hh = fl(heavy_ratio * L);
  b.n_protected = fl(recent_ratio * L);
  if (window_mode) b.n_protected = std::max(b.n_protected, std::min(window_size, L));
  // heavy_ratio + recent_ratio >= 1 is a budget of the whole prompt (floor() must not lose
  // a token of it).
  if (heavy_ratio + recent_ratio >= 1.0 - 1e-12 || uint64_t(n_hh) + b.n_protected >= L ||
      uint64_t(b.n_sink) + b.n_protected >= L) {
    b.keep_all = true;
    b.n_heavy = 0;
    b.n_protected = L - b.n_sink;
    return b;
  }
  b.n_heavy = n_hh > b.n_sink ? n_hh - b.n_sink : 0;
  return b;
}

// Kept positions, ascending: the sinks [0, n_sink), the suffix [L - n_protected, L) and
// the n_heavy best of the rest by score (higher first, then lower position; NaN ranks
// lowest).
inline std::vector<int32_t> select(const std::vector<double> &scores, uint32_t L,
                                   const Budget &b) {
  std::vector<int32_t> kept;
  for (uint32_t j = 0; j < b.n_sink; ++j) kept.push_back(static_cast<int32_t>(j));
  const uint32_t candidates = L - b.n_protected;
  std::vector<int32_t> order;
  for (uint32_t j = b.n_sink; j < candidates; ++j) order.push_back(static_cast<int32_t>(j));
  auto key = [&](int32_t j) { return std::isnan(scores[j]) ? -INFINITY : scores[j]; };
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t c) {
    return key(a) > key(c);  // stable: equal scores stay in position order
  });
  kept.insert(kept.end(), order.begin(), order.begin() + b.n_heavy);
  for (uint32_t j = candidates; j < L; ++j) kept.push_back(static_cast<int32_t>(j));
  std::sort(kept.begin(), kept.end());
  return kept;
}

// Decode attention of one token: q [H][D]; keys/values per KV head as rows [n][D]
// (n may differ per head). Returns [H][D].
inline std::vector<double> decode(const std::vector<double> &q,
                                  const std::vector<std::vector<double>> &keys,
                                  const std::vector<std::vector<double>> &values, uint32_t H,
                                  uint32_t Hkv, uint32_t D) {
  std::vector<double> out(size_t(H) * D, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (uint32_t h = 0; h < H; ++h) {
    const uint32_t g = h / (H / Hkv);
    const size_t n = keys[g].size() / D;
    std::vector<double> p(n);
    double m = -INFINITY;
    for (size_t t = 0; t < n; ++t) {
      double s = 0.0;
      for (uint32_t c = 0; c < D; ++c) s += q[size_t(h) * D + c] * keys[g][t * D + c];
      p[t] = s * scale;
      m = std::max(m, p[t]);
    }
    double sum = 0.0;
    for (size_t t = 0; t < n; ++t) sum += (p[t] = std::exp(p[t] - m));
    for (size_t t = 0; t < n; ++t)
      for (uint32_t c = 0; c < D; ++c) out[size_t(h) * D + c] += p[t] / sum * values[g][t * D + c];
  }
  return out;
}

}  // namespace ref

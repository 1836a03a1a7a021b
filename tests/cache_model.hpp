// The oracle's model of what one (sequence, layer) holds, per MINIKV.md §4: after prefill
// the kept prompt tokens in ascending position order, of which the first min(S, L) are
// 16-bit sinks (S = sink_tokens), the next (n_keep - sinks) rounded down to G are
// quantized and the tail stays 16-bit in the residual; every
// appended token goes to the residual, and when the residual reaches R tokens its oldest F
// (flush_tokens; R by default) are quantized as one flush (before that token's decode) and
// the other R - F stay 16-bit. Decode oracles in float64 over the
// exact rows or over the rows as the reference quantizer dequantizes them.
#pragma once

#include <algorithm>
#include <vector>

#include "reference/attention_ref.hpp"
#include "reference/quant_ref.hpp"
#include "support.hpp"

namespace test {

struct SeqModel {
  uint32_t Hkv = 0, D = 0, G = 16, R = 128, S = 0, F = 128;
  std::vector<std::vector<float>> k, v;  // [Hkv] -> rows [n][D], cache order, dtype values
  uint32_t n = 0, sinks = 0, quantized = 0, residual = 0;

  SeqModel() = default;
  // flush_tokens as in minikv_config: 0 is the whole residual, other values are rounded up
  // to whole groups, at most R.
  SeqModel(uint32_t hkv, uint32_t d, uint32_t g, uint32_t r, uint32_t sink_tokens = 0,
           uint32_t flush_tokens = 0)
      : Hkv(hkv), D(d), G(g), R(r), S(sink_tokens),
        F(flush_tokens == 0 ? r : uint32_t(std::min<uint64_t>(r, (uint64_t(flush_tokens) + g - 1) / g * g))),
        k(hkv), v(hkv) {}

  // kept[h]: kept prompt positions of KV head h (ascending, same count for every head);
  // k_in/v_in: the prompt's [L][Hkv][D] rows, starting at token `first`.
  void prefill(const std::vector<std::vector<int32_t>> &kept, const Buf &k_in, const Buf &v_in,
               size_t first) {
    n = static_cast<uint32_t>(kept[0].size());
    for (uint32_t h = 0; h < Hkv; ++h) {
      REQUIRE(kept[h].size() == n);
      for (uint32_t t = 0; t < std::min(S, n); ++t) REQUIRE(kept[h][t] == int32_t(t));
      k[h].clear();
      v[h].clear();
      for (int32_t p : kept[h]) push(h, k_in, v_in, (first + size_t(p)) * Hkv + h);
    }
    sinks = std::min(S, n);  // every prompt keeps its first min(S, L) positions
    quantized = (n - sinks) - (n - sinks) % G;
    residual = n - sinks - quantized;
  }

  // Rows [Hkv][D] of one appended token at element offset `row` * Hkv * D.
  void append(const Buf &k_in, const Buf &v_in, size_t row) {
    for (uint32_t h = 0; h < Hkv; ++h) push(h, k_in, v_in, row * Hkv + h);
    ++n;
    if (++residual == R) {
      quantized += F;
      residual = R - F;
    }
  }

  // Decode oracle for q [H][D] (doubles). dequantized = false: the exact rows.
  std::vector<double> decode(const std::vector<double> &q, uint32_t H, bool dequantized,
                             uint32_t key_bits, uint32_t value_bits, minikv_dtype dt) const {
    std::vector<std::vector<double>> keys(Hkv), values(Hkv);
    for (uint32_t h = 0; h < Hkv; ++h) {
      if (dequantized) {
        ref::dequantize_cache(k[h], v[h], n, quantized, D, G, key_bits, value_bits, dt, keys[h],
                              values[h], sinks);
      } else {
        keys[h].assign(k[h].begin(), k[h].end());
        values[h].assign(v[h].begin(), v[h].end());
      }
    }
    return ref::decode(q, keys, values, H, Hkv, D);
  }

 private:
  void push(uint32_t h, const Buf &k_in, const Buf &v_in, size_t row) {
    for (uint32_t c = 0; c < D; ++c) {
      k[h].push_back(static_cast<float>(k_in.get(row * D + c)));
      v[h].push_back(static_cast<float>(v_in.get(row * D + c)));
    }
  }
};

}  // namespace test

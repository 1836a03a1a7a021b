// Storage layout of the compressed cache, shared by the CPU backend and the CUDA kernels
// (POD, no allocation, usable in device code) so both read and write identical bytes.
//
// The pool is an array of equal blocks. A block holds `tokens` (= residual_length, R)
// consecutive cached tokens of one (sequence, layer), all KV heads, in the layout the
// decode kernels read, region by region, each region [kv_heads][...]:
//
//   k_codes   [Hkv][R][k_row_bytes]  keys; b-bit codes of one token packed 32/b per
//                                    uint32 along channels, channel 0 in the lowest bits
//                                    (b = 16: the dtype values themselves)
//   v_codes   [Hkv][R][v_row_bytes]  values, same packing
//   k_scale   [Hkv][R/G][D] dtype    keys are quantized per channel over G consecutive
//   k_min     [Hkv][R/G][D] dtype    tokens: one (scale, min) per channel and token group
//   v_scale   [Hkv][R][D/G] dtype    values per token over G consecutive channels
//   v_min     [Hkv][R][D/G] dtype
//   positions [Hkv][R] int32         prompt (or generation) position of each token
//
// Scale regions are absent (0 bytes) for 16-bit storage. Every region starts at a
// multiple of 16 bytes; the block size is a multiple of 256 bytes.
//
// Each (sequence, layer) also owns one residual slot: the 16-bit residual of R tokens and
// the attention sinks, the first S prompt positions (S = sink_tokens, 0 = none), kept
// 16-bit in every layer and KV head:
//   k [Hkv][R][D] dtype, v [Hkv][R][D] dtype, positions [Hkv][R] int32,
//   sink_k [Hkv][S][D] dtype, sink_v [Hkv][S][D] dtype (positions 0..S-1, implicit).
// Cache order of a (sequence, layer) holding `sinks` sink tokens and `quantized` tokens in
// blocks: sinks first (sink row t), then block table entry (t - sinks) / R at row
// (t - sinks) % R, then the residual. Positions ascend along that order.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MINIKV_HD __host__ __device__ __forceinline__
#else
#define MINIKV_HD inline
#endif

namespace minikv {

MINIKV_HD uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

struct BlockLayout {
  uint32_t tokens;     // R
  uint32_t kv_heads;   // Hkv
  uint32_t head_dim;   // D
  uint32_t group;      // G
  uint32_t key_bits;   // 2, 4, 8, 16
  uint32_t value_bits; // 2, 4, 8, 16
  uint32_t elem_bytes; // 2 (F16/BF16) or 4 (F32)
  uint32_t pad_;
  uint64_t k_row_bytes, v_row_bytes;  // one token, one head
  uint64_t k_codes, v_codes, k_scale, k_min, v_scale, v_min, positions;  // region offsets
  uint64_t bytes;                                                        // whole block

  // Per-head strides of each region, in bytes.
  MINIKV_HD uint64_t k_codes_head() const { return tokens * k_row_bytes; }
  MINIKV_HD uint64_t v_codes_head() const { return tokens * v_row_bytes; }
  MINIKV_HD uint64_t k_scale_head() const { return key_bits == 16 ? 0 : uint64_t(tokens / group) * head_dim * elem_bytes; }
  MINIKV_HD uint64_t v_scale_head() const { return value_bits == 16 ? 0 : uint64_t(tokens) * (head_dim / group) * elem_bytes; }
  MINIKV_HD uint64_t positions_head() const { return uint64_t(tokens) * 4; }
};

MINIKV_HD uint64_t row_bytes(uint32_t bits, uint32_t head_dim, uint32_t elem_bytes) {
  return bits == 16 ? uint64_t(head_dim) * elem_bytes : uint64_t(head_dim) * bits / 8;
}

inline BlockLayout make_block_layout(uint32_t tokens, uint32_t kv_heads, uint32_t head_dim,
                                     uint32_t group, uint32_t key_bits, uint32_t value_bits,
                                     uint32_t elem_bytes) {
  BlockLayout l{};
  l.tokens = tokens;
  l.kv_heads = kv_heads;
  l.head_dim = head_dim;
  l.group = group;
  l.key_bits = key_bits;
  l.value_bits = value_bits;
  l.elem_bytes = elem_bytes;
  l.k_row_bytes = row_bytes(key_bits, head_dim, elem_bytes);
  l.v_row_bytes = row_bytes(value_bits, head_dim, elem_bytes);
  uint64_t off = 0;
  auto region = [&](uint64_t per_head) {
    const uint64_t at = off;
    off = align_up(off + per_head * kv_heads, 16);
    return at;
  };
  l.k_codes = region(l.k_codes_head());
  l.v_codes = region(l.v_codes_head());
  l.k_scale = region(l.k_scale_head());
  l.k_min = region(l.k_scale_head());
  l.v_scale = region(l.v_scale_head());
  l.v_min = region(l.v_scale_head());
  l.positions = region(l.positions_head());
  l.bytes = align_up(off, 256);
  return l;
}

struct ResidualLayout {
  uint32_t tokens, kv_heads, head_dim, elem_bytes;
  uint32_t sink_tokens, pad_;
  uint64_t k, v, positions, sink_k, sink_v, bytes;  // region offsets and slot size
  MINIKV_HD uint64_t kv_head_stride() const { return uint64_t(tokens) * head_dim * elem_bytes; }
  MINIKV_HD uint64_t sink_head_stride() const {
    return uint64_t(sink_tokens) * head_dim * elem_bytes;
  }
};

inline ResidualLayout make_residual_layout(uint32_t tokens, uint32_t kv_heads, uint32_t head_dim,
                                           uint32_t elem_bytes, uint32_t sink_tokens) {
  ResidualLayout r{};
  r.tokens = tokens;
  r.kv_heads = kv_heads;
  r.head_dim = head_dim;
  r.elem_bytes = elem_bytes;
  r.sink_tokens = sink_tokens;
  const uint64_t kv = uint64_t(tokens) * kv_heads * head_dim * elem_bytes;
  const uint64_t sinks = uint64_t(sink_tokens) * kv_heads * head_dim * elem_bytes;
  r.k = 0;
  r.v = align_up(kv, 16);
  r.positions = align_up(r.v + kv, 16);
  r.sink_k = align_up(r.positions + uint64_t(tokens) * kv_heads * 4, 16);
  r.sink_v = align_up(r.sink_k + sinks, 16);
  r.bytes = align_up(r.sink_v + sinks, 256);
  return r;
}

// Bytes that `n` quantized tokens (a multiple of G) of all KV heads occupy in codes and
// scales (the positions index is bookkeeping, not counted).
inline uint64_t quantized_bytes(const BlockLayout &l, uint64_t n) {
  const uint64_t groups = n / l.group;
  uint64_t per_group = uint64_t(l.group) * (l.k_row_bytes + l.v_row_bytes);
  if (l.key_bits != 16) per_group += 2ull * l.head_dim * l.elem_bytes;
  if (l.value_bits != 16) per_group += 2ull * l.group * (l.head_dim / l.group) * l.elem_bytes;
  return groups * per_group * l.kv_heads;
}

}  // namespace minikv

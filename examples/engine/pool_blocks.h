/*
 * pool_blocks.h — how many of libminikv's pool blocks a sequence holds at its end, which is
 * what the engine reserves for it (engine.h) and what --bench sizes its pool by (bench.c).
 * Header-only and free of the engine's other parts: the library's tests check it against
 * the pool (tests/test_api_capacity.cpp).
 */
#ifndef ENGINE_POOL_BLOCKS_H
#define ENGINE_POOL_BLOCKS_H

#include <stdint.h>

#include "minikv.h"

/* Pool blocks one (sequence, layer) holds after `appends` more tokens, when its prefill of
   `prompt_len` tokens left it `cached` (minikv_sequence_length). As minikv.h describes the
   storage: min(sink_tokens, prompt_len) sinks sit apart from the blocks, the other kept
   tokens are stored in whole groups of group_size with the tail in the 16-bit residual, and
   each time the residual reaches residual_length tokens its oldest F go into the blocks,
   filling them in order: F is flush_tokens rounded up to whole groups, at most
   residual_length, or all of them for 0. */
static inline uint64_t engine_flush_tokens(const minikv_config *kv) {
  const uint64_t G = kv->group_size, R = kv->residual_length;
  const uint64_t F = (kv->flush_tokens + G - 1) / G * G;
  return kv->flush_tokens == 0 || F > R ? R : F;
}
static inline uint64_t engine_blocks_at_end(const minikv_config *kv, uint32_t prompt_len, uint64_t cached,
                                            uint64_t appends) {
  const uint64_t G = kv->group_size, R = kv->residual_length, F = engine_flush_tokens(kv);
  const uint64_t sinks = kv->sink_tokens < prompt_len ? kv->sink_tokens : prompt_len;
  const uint64_t rest = cached > sinks ? cached - sinks : 0, tail = rest % G;
  /* the first flush when the residual first holds R tokens, then one every F tokens */
  const uint64_t flushes = tail + appends < R ? 0 : 1 + (tail + appends - R) / F;
  const uint64_t in_blocks = rest - tail + F * flushes;
  return (in_blocks + R - 1) / R;
}

#endif

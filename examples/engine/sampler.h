/*
 * sampler.h — the next token from a row of logits: greedy (temperature 0: the first
 * largest logit, as torch.argmax), or a draw from softmax(logits / temperature)
 * restricted to the smallest set of most likely tokens whose probability reaches top_p.
 */
#ifndef ENGINE_SAMPLER_H
#define ENGINE_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util.h"

typedef struct sampler {
  float temperature; /* <= 0: greedy */
  float top_p;       /* in (0, 1]; 1 = the whole vocabulary */
  rng64 rng;
  size_t capacity;   /* scratch for top-p, grown on demand */
  struct sampler_candidate *scratch;
} sampler;

/* Greedy when temperature <= 0; the seed makes draws repeatable. */
void sampler_init(sampler *s, float temperature, float top_p, uint64_t seed);
void sampler_free(sampler *s);

/* The chosen token id, or -1 with a message when out of memory. */
int32_t sampler_pick(sampler *s, const float *logits, size_t n_vocab);

/* Index of the first largest value. */
int32_t argmax_f32(const float *x, size_t n);

#endif /* ENGINE_SAMPLER_H */

/* sampler.c — see sampler.h. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

typedef struct sampler_candidate {
  float p;
  int32_t id;
} sampler_candidate;

void sampler_init(sampler *s, float temperature, float top_p, uint64_t seed) {
  s->temperature = temperature;
  s->top_p = top_p > 0 && top_p < 1 ? top_p : 1.0f;
  rng_seed(&s->rng, seed);
  s->capacity = 0;
  s->scratch = NULL;
}

void sampler_free(sampler *s) {
  free(s->scratch);
  s->scratch = NULL;
  s->capacity = 0;
}

int32_t argmax_f32(const float *x, size_t n) {
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return (int32_t)best;
}

static int more_likely(const void *a, const void *b) {
  const sampler_candidate *x = a, *y = b;
  if (x->p != y->p) return x->p > y->p ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

int32_t sampler_pick(sampler *s, const float *logits, size_t n) {
  if (s->temperature <= 0) return argmax_f32(logits, n);
  if (s->capacity < n) {
    sampler_candidate *p = realloc(s->scratch, n * sizeof *p);
    if (!p) {
      fail("out of host memory (sampler, %zu candidates)", n);
      return -1;
    }
    s->scratch = p;
    s->capacity = n;
  }
  const float max = logits[argmax_f32(logits, n)];
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const float p = expf((logits[i] - max) / s->temperature);
    s->scratch[i].p = p;
    s->scratch[i].id = (int32_t)i;
    sum += p;
  }
  size_t keep = n;
  double kept_mass = sum;
  if (s->top_p < 1) {
    qsort(s->scratch, n, sizeof *s->scratch, more_likely);
    double acc = 0;
    for (keep = 0; keep < n;) {
      acc += s->scratch[keep++].p;
      if (acc >= s->top_p * sum) break;
    }
    kept_mass = acc;
  }
  double r = rng_uniform(&s->rng) * kept_mass;
  for (size_t i = 0; i < keep; ++i) {
    r -= s->scratch[i].p;
    if (r < 0) return s->scratch[i].id;
  }
  return s->scratch[keep - 1].id; /* rounding left a sliver of mass */
}

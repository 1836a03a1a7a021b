/* util.c — see util.h. */
#define _POSIX_C_SOURCE 200112L /* clock_gettime */

#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static char error_message[1024];

bool fail(const char *fmt, ...) {
  /* Format into a copy first: the arguments may point into error_message itself (a
     caller adding context to the message below it). */
  char buf[sizeof error_message];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  memcpy(error_message, buf, sizeof buf);
  return false;
}

const char *last_error(void) { return error_message; }

void *alloc_zeroed(size_t count, size_t size, const char *what) {
  if (size != 0 && count > SIZE_MAX / size) {
    fail("out of host memory (%zu x %zu bytes overflow, %s)", count, size, what);
    return NULL;
  }
  void *p = calloc(count ? count : 1, size ? size : 1);
  if (!p) fail("out of host memory (%zu bytes, %s)", count * size, what);
  return p;
}

double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, nan */
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
  /* zero or subnormal: man * 2^-24 */
  const float v = (float)man * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* nan */
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
  if (abs < 0x38800000u) {
    /* below the smallest normal half (2^-14): a subnormal, in units of 2^-24 */
    const float v = bits_f32(abs) * 16777216.0f; /* exact: a power-of-two scale */
    /* round half to even on the integer part */
    float r = (float)(uint32_t)v;
    const float frac = v - r;
    if (frac > 0.5f || (frac == 0.5f && ((uint32_t)r & 1u))) r += 1.0f;
    return (uint16_t)(sign | (uint16_t)(uint32_t)r);
  }
  /* normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even */
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1; /* may carry into exp */
  return (uint16_t)(sign | h);
}

float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet nan */
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)((u + rounding) >> 16);
}

void rng_seed(rng64 *r, uint64_t seed) {
  /* splitmix64 of the seed, so that small seeds give unrelated streams; never zero */
  uint64_t z = seed + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  r->state = z ? z : 1;
}

uint64_t rng_next(rng64 *r) {
  uint64_t x = r->state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  r->state = x;
  return x * 0x2545f4914f6cdd1dull;
}

double rng_uniform(rng64 *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

bool parse_flag_u32(const char *flag, const char *value, uint32_t lo, uint32_t *out) {
  char *end;
  const unsigned long long x = value ? strtoull(value, &end, 10) : 0;
  if (!value || *value < '0' || *value > '9' || *end != '\0' || x < lo || x > UINT32_MAX)
    return fail("%s needs an integer >= %u (got %s)", flag, lo, value ? value : "nothing");
  *out = (uint32_t)x;
  return true;
}

const char *format_bytes(double bytes, char *buf, size_t size) {
  if (bytes >= 1e9)
    snprintf(buf, size, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6)
    snprintf(buf, size, "%.1f MB", bytes / 1e6);
  else
    snprintf(buf, size, "%.1f kB", bytes / 1e3);
  return buf;
}

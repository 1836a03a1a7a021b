/*
 * util.h — what every file of the engine shares: the error message of the last failure,
 * host allocation that reports its size, a monotonic clock, 16-bit float conversions and a
 * small deterministic random generator.
 *
 * Errors. A function that can fail returns false (or NULL) after calling fail(), which
 * records a message naming the problem; the caller either adds context with fail() again
 * (the message is rewritten, so say everything in the outermost one) or prints
 * last_error(). Nothing in the engine exits the process except main().
 */
#ifndef ENGINE_UTIL_H
#define ENGINE_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define ENGINE_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define ENGINE_PRINTF(f, a)
#endif

/* Records a formatted message as the last error; always returns false. */
bool fail(const char *fmt, ...) ENGINE_PRINTF(1, 2);
/* The last recorded message ("" when none). */
const char *last_error(void);

/* calloc that records "out of host memory (N bytes, what)" on failure. */
void *alloc_zeroed(size_t count, size_t size, const char *what);

/* Seconds on a monotonic clock. */
double now_seconds(void);

/* IEEE binary16 and bfloat16 <-> binary32, round to nearest even (NaN stays NaN). */
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);

/* xorshift64* : the same stream for the same seed on every machine. */
typedef struct rng64 {
  uint64_t state;
} rng64;
void rng_seed(rng64 *r, uint64_t seed);
uint64_t rng_next(rng64 *r);
/* Uniform in [0, 1). */
double rng_uniform(rng64 *r);

/* A command-line value: an integer in [lo, UINT32_MAX] into *out, else false with a
   message naming the flag. */
bool parse_flag_u32(const char *flag, const char *value, uint32_t lo, uint32_t *out);

/* Formats a byte count as "12.3 GB" / "45.6 MB" into buf; returns buf. */
const char *format_bytes(double bytes, char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif /* ENGINE_UTIL_H */

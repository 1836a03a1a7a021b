/*
 * minikv_demo.c — libminikv on a synthetic, LLaMA-shaped workload.
 *
 * What it does. For every layer it generates one prompt's queries, keys and values with
 * the structure real LLaMA attention has (below), prefills two caches with them — a MiniKV
 * cache (2-bit, heavy hitters + recent window, pyramid budgets) and a keep-everything
 * 16-bit cache, the exact reference — then decodes `--gen` tokens through both and prints
 * how far MiniKV's attention output is from the exact one, which tokens MiniKV kept, how
 * much memory each cache holds, and how long each call took.
 *
 * The inputs (deterministic from --seed; a xorshift64* generator per (sequence, layer),
 * Box–Muller normals):
 *   - an attention sink: the key at position 0 is strongly aligned with the query
 *     direction of its KV head, so every query attends to it (as in real models);
 *   - heavy hitters: a few planted prompt positions per (sequence, layer, KV head) whose
 *     keys are also aligned with that direction, a little less strongly;
 *   - outlier key channels: a few channels per layer with a large offset (~10x the rest),
 *     like real LLaMA keys — the reason MiniKV quantizes keys per channel;
 *   - a smooth rest: keys and values follow a per-channel AR(1) process along positions,
 *     and each query carries a little of its own position's key, which gives attention
 *     the local, recent-token bias real models have.
 * Layers are independent here (a layer's output is not the next layer's input), so the
 * errors shown are per-layer attention errors, not end-to-end model errors.
 *
 * Only the public header is used. Build: it is the `minikv_demo` target of the project
 * (tools/CMakeLists.txt, with -DMINIKV_EXAMPLES=ON); run `minikv_demo --help` for the
 * flags. docs/demo.md explains its output. For the calls an engine makes, read
 * examples/c/decode_loop.c first.
 */
#define _POSIX_C_SOURCE 200112L /* clock_gettime */

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "minikv.h"

#ifdef MINIKV_DEMO_CUDA
#include <cuda_runtime.h>
#endif

#define DEMO_PI 3.14159265358979323846

/* ---- failure handling ------------------------------------------------------------- */

/* Any API failure ends the demo with the library's own explanation. */
#define CHECK(call)                                                                   \
  do {                                                                                \
    minikv_status st_ = (call);                                                       \
    if (st_ != MINIKV_OK) {                                                           \
      fprintf(stderr, "minikv_demo: %s failed\n  status: %s\n  detail: %s\n", #call,  \
              minikv_status_string(st_), minikv_last_error_message());                \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

#ifdef MINIKV_DEMO_CUDA
#define CUDA_CHECK(call)                                                              \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "minikv_demo: %s failed: %s\n", #call, cudaGetErrorString(e_)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)
#endif

static void *xmalloc(size_t bytes) {
  void *p = calloc(1, bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "minikv_demo: out of host memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

/* ---- options ---------------------------------------------------------------------- */

typedef struct options {
  uint32_t layers, heads, kv_heads, head_dim;
  uint32_t prompt, gen, batch;
  minikv_dtype dtype;
  minikv_budget_policy policy;
  float depth;
  minikv_score_mode mode;
  uint32_t bits, key_bits, value_bits, group, residual; /* key/value_bits 0 = --bits */
  uint32_t flush; /* flush_tokens: 0 = the whole residual */
  uint32_t sinks;
  float heavy, recent;
  int backend; /* 0 auto, 1 cpu, 2 cuda (as requested on the command line) */
  uint64_t seed;
  uint32_t every; /* print every Nth decode step; 0 = choose */
  int ablation;
} options;

static void usage(FILE *f) {
  fprintf(f,
          "usage: minikv_demo [flags]   (flags take a value: --flag V or --flag=V)\n"
          "\n"
          "Runs a synthetic LLaMA-shaped workload through a MiniKV cache and, side by side,\n"
          "through a keep-everything 16-bit cache (the exact reference), and reports the\n"
          "decode error, the kept tokens per layer, memory and timings.\n"
          "\n"
          "model shape\n"
          "  --layers N        layers                                   (4)\n"
          "  --heads N         query heads                              (8)\n"
          "  --kv-heads N      KV heads (GQA when < heads)              (2)\n"
          "  --head-dim N      head dimension                           (64)\n"
          "  --dtype T         f16 | bf16 | f32                         (f16)\n"
          "workload\n"
          "  --prompt N        prompt tokens per sequence               (1024)\n"
          "  --gen N           decoded tokens per sequence              (64)\n"
          "  --batch N         sequences, prefilled and decoded together (1)\n"
          "  --seed N          seed of every generated tensor           (42)\n"
          "MiniKV configuration\n"
          "  --policy P        uniform | pyramid (heavy budget per layer) (pyramid)\n"
          "  --depth X         pyramid depth delta                      (7)\n"
          "  --mode M          cumulative (H2O) | window (SnapKV) scores (cumulative)\n"
          "  --bits B          key and value bits: 2 | 4 | 8 | 16       (2)\n"
          "  --key-bits B      override --bits for keys\n"
          "  --value-bits B    override --bits for values\n"
          "  --group G         quantization group: 16 | 32 | 64 | 128   (16)\n"
          "  --residual R      16-bit residual tokens before a flush    (128)\n"
          "  --flush F         oldest residual tokens a flush quantizes (0 = all)\n"
          "  --sinks S         first prompt tokens always kept 16-bit   (0)\n"
          "  --heavy X         heavy-hitter ratio h                     (0.25)\n"
          "  --recent X        recent-window ratio r                    (0.25)\n"
          "run\n"
          "  --backend B       cpu | cuda | auto                        (cpu)\n"
          "  --every N         print every Nth decode step (0 = about 16 lines) (0)\n"
          "  --ablation 0|1    also run eviction-only (16-bit) and quantization-only\n"
          "                    (keep all) caches, to split MiniKV's error  (0)\n"
          "  --help            this text\n"
          "\n"
          "The CPU backend uses every hardware thread; MINIKV_NUM_THREADS=N overrides.\n"
          "Exit status: 0 ok, 1 an API call failed (its message is printed), 2 bad usage,\n"
          "3 the keep-everything cache disagreed with float64 attention (a library bug).\n");
}

static void bad_usage(const char *fmt, const char *a, const char *b) {
  fprintf(stderr, "minikv_demo: ");
  fprintf(stderr, fmt, a, b);
  fprintf(stderr, "\n(run minikv_demo --help for the flags)\n");
  exit(2);
}

static uint64_t parse_uint(const char *flag, const char *s, uint64_t max) {
  char *end = NULL;
  errno = 0;
  if (*s == '-' || *s == '\0') bad_usage("%s expects a non-negative integer, got '%s'", flag, s);
  unsigned long long x = strtoull(s, &end, 10);
  if (errno || *end != '\0' || x > max)
    bad_usage("%s expects a non-negative integer in range, got '%s'", flag, s);
  return (uint64_t)x;
}

static float parse_float(const char *flag, const char *s) {
  char *end = NULL;
  errno = 0;
  double x = strtod(s, &end);
  if (errno || *s == '\0' || *end != '\0' || !isfinite(x))
    bad_usage("%s expects a number, got '%s'", flag, s);
  return (float)x;
}

static void parse_options(int argc, char **argv, options *o) {
  memset(o, 0, sizeof(*o));
  o->layers = 4; o->heads = 8; o->kv_heads = 2; o->head_dim = 64;
  o->prompt = 1024; o->gen = 64; o->batch = 1;
  o->dtype = MINIKV_DTYPE_F16;
  o->policy = MINIKV_BUDGET_PYRAMID; o->depth = 7.0f;
  o->mode = MINIKV_SCORE_CUMULATIVE;
  o->bits = 2; o->group = 16; o->residual = 128;
  o->heavy = 0.25f; o->recent = 0.25f;
  o->backend = 1;
  o->seed = 42;

  for (int i = 1; i < argc; ++i) {
    const char *arg = argv[i];
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      usage(stdout);
      exit(0);
    }
    if (strncmp(arg, "--", 2) != 0) bad_usage("unexpected argument '%s'%s", arg, "");
    /* --flag=value or --flag value */
    char name[64];
    const char *value;
    const char *eq = strchr(arg, '=');
    if (eq) {
      size_t n = (size_t)(eq - arg);
      if (n >= sizeof(name)) bad_usage("unknown flag '%s'%s", arg, "");
      memcpy(name, arg, n);
      name[n] = '\0';
      value = eq + 1;
    } else {
      if (strlen(arg) >= sizeof(name)) bad_usage("unknown flag '%s'%s", arg, "");
      strcpy(name, arg);
      if (i + 1 >= argc) bad_usage("%s needs a value%s", arg, "");
      value = argv[++i];
    }
    const uint64_t u32 = 0xffffffffull;
    if (!strcmp(name, "--layers")) o->layers = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--heads")) o->heads = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--kv-heads")) o->kv_heads = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--head-dim")) o->head_dim = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--prompt")) o->prompt = (uint32_t)parse_uint(name, value, 0x7fffffffull);
    else if (!strcmp(name, "--gen")) o->gen = (uint32_t)parse_uint(name, value, 0x7fffffffull);
    else if (!strcmp(name, "--batch")) o->batch = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--seed")) o->seed = parse_uint(name, value, UINT64_MAX);
    else if (!strcmp(name, "--bits")) o->bits = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--key-bits")) o->key_bits = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--value-bits")) o->value_bits = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--group")) o->group = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--residual")) o->residual = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--flush")) o->flush = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--sinks")) o->sinks = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--every")) o->every = (uint32_t)parse_uint(name, value, u32);
    else if (!strcmp(name, "--ablation")) o->ablation = (int)parse_uint(name, value, 1);
    else if (!strcmp(name, "--heavy")) o->heavy = parse_float(name, value);
    else if (!strcmp(name, "--recent")) o->recent = parse_float(name, value);
    else if (!strcmp(name, "--depth")) o->depth = parse_float(name, value);
    else if (!strcmp(name, "--dtype")) {
      if (!strcmp(value, "f16")) o->dtype = MINIKV_DTYPE_F16;
      else if (!strcmp(value, "bf16")) o->dtype = MINIKV_DTYPE_BF16;
      else if (!strcmp(value, "f32")) o->dtype = MINIKV_DTYPE_F32;
      else bad_usage("--dtype expects f16, bf16 or f32, got '%s'%s", value, "");
    } else if (!strcmp(name, "--policy")) {
      if (!strcmp(value, "uniform")) o->policy = MINIKV_BUDGET_UNIFORM;
      else if (!strcmp(value, "pyramid")) o->policy = MINIKV_BUDGET_PYRAMID;
      else bad_usage("--policy expects uniform or pyramid, got '%s'%s", value, "");
    } else if (!strcmp(name, "--mode")) {
      if (!strcmp(value, "cumulative")) o->mode = MINIKV_SCORE_CUMULATIVE;
      else if (!strcmp(value, "window")) o->mode = MINIKV_SCORE_WINDOW;
      else bad_usage("--mode expects cumulative or window, got '%s'%s", value, "");
    } else if (!strcmp(name, "--backend")) {
      if (!strcmp(value, "auto")) o->backend = 0;
      else if (!strcmp(value, "cpu")) o->backend = 1;
      else if (!strcmp(value, "cuda")) o->backend = 2;
      else bad_usage("--backend expects cpu, cuda or auto, got '%s'%s", value, "");
    } else {
      bad_usage("unknown flag '%s'%s", name, "");
    }
  }
  /* The library validates the configuration (and says why a value is wrong); the demo
   * only needs non-zero sizes to lay out its own buffers. */
  if (o->layers == 0 || o->heads == 0 || o->kv_heads == 0 || o->head_dim == 0 ||
      o->prompt == 0 || o->batch == 0)
    bad_usage("--layers, --heads, --kv-heads, --head-dim, --prompt and --batch must be >= 1%s%s",
              "", "");
  if (o->key_bits == 0) o->key_bits = o->bits;
  if (o->value_bits == 0) o->value_bits = o->bits;
  if ((uint64_t)o->prompt + o->gen > 0x7fffffffull)
    bad_usage("--prompt + --gen is too large%s%s", "", "");
}

/* ---- 16-bit conversions (round to nearest even, as the library and CUDA do) -------- */

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static uint16_t float_to_half(float f) {
  /* F. Giesen's float_to_half_fast3_rtne (public domain). */
  const uint32_t f32_inf = 255u << 23, f16_overflow = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = f2u(f);
  const uint32_t sign = u & 0x80000000u;
  uint16_t out;
  u ^= sign;
  if (u >= f16_overflow) {
    out = u > f32_inf ? 0x7e00 : 0x7c00;
  } else if (u < (113u << 23)) {
    out = (uint16_t)(f2u(u2f(u) + u2f(denorm_magic)) - denorm_magic);
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += ((uint32_t)(15 - 127) << 23) + 0xfffu;
    u += mant_odd;
    out = (uint16_t)(u >> 13);
  }
  return (uint16_t)(out | (sign >> 16));
}

static float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float m = (float)mantissa * 5.9604644775390625e-8f;
    return sign ? -m : m;
  }
  if (exponent == 31) return u2f(sign | 0x7f800000u | (mantissa << 13));
  return u2f(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static uint16_t float_to_bf16(float f) {
  const uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float bf16_to_float(uint16_t b) { return u2f((uint32_t)b << 16); }

static size_t dtype_size(minikv_dtype t) { return t == MINIKV_DTYPE_F32 ? 4 : 2; }

static const char *dtype_name(minikv_dtype t) {
  return t == MINIKV_DTYPE_F16 ? "f16" : t == MINIKV_DTYPE_BF16 ? "bf16" : "f32";
}

/* Stores x at element i of a dtype buffer; returns the value actually stored. */
static float store_elem(void *buf, minikv_dtype t, size_t i, float x) {
  switch (t) {
    case MINIKV_DTYPE_F16: {
      const uint16_t h = float_to_half(x);
      ((uint16_t *)buf)[i] = h;
      return half_to_float(h);
    }
    case MINIKV_DTYPE_BF16: {
      const uint16_t b = float_to_bf16(x);
      ((uint16_t *)buf)[i] = b;
      return bf16_to_float(b);
    }
    default:
      ((float *)buf)[i] = x;
      return x;
  }
}

static float load_elem(const void *buf, minikv_dtype t, size_t i) {
  switch (t) {
    case MINIKV_DTYPE_F16: return half_to_float(((const uint16_t *)buf)[i]);
    case MINIKV_DTYPE_BF16: return bf16_to_float(((const uint16_t *)buf)[i]);
    default: return ((const float *)buf)[i];
  }
}

/* ---- deterministic random numbers ------------------------------------------------- */

typedef struct rng {
  uint64_t s;
  int has_spare;
  double spare;
} rng;

static uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* One independent stream per (seed, purpose, a, b). */
static void rng_init(rng *r, uint64_t seed, uint64_t purpose, uint64_t a, uint64_t b) {
  uint64_t x = splitmix64(seed);
  x = splitmix64(x ^ purpose);
  x = splitmix64(x ^ a);
  x = splitmix64(x ^ b);
  r->s = x ? x : 0x2545f4914f6cdd1dull; /* xorshift state must be non-zero */
  r->has_spare = 0;
}

static uint64_t rng_next(rng *r) { /* xorshift64* */
  r->s ^= r->s >> 12;
  r->s ^= r->s << 25;
  r->s ^= r->s >> 27;
  return r->s * 0x2545f4914f6cdd1dull;
}

static double rng_uniform(rng *r) { /* in (0, 1) */
  return ((double)(rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double rng_normal(rng *r) { /* Box–Muller */
  if (r->has_spare) {
    r->has_spare = 0;
    return r->spare;
  }
  const double u1 = rng_uniform(r), u2 = rng_uniform(r);
  const double radius = sqrt(-2.0 * log(u1));
  r->spare = radius * sin(2.0 * DEMO_PI * u2);
  r->has_spare = 1;
  return radius * cos(2.0 * DEMO_PI * u2);
}

/* ---- the synthetic workload ------------------------------------------------------- */

/* Shape of the attention (all logits are in units of 1/sqrt(head_dim)-scaled dot products). */
#define SINK_LOGIT 8.0        /* q·k/sqrt(D) of the sink key for an aligned query */
#define HEAVY_LOGIT_MIN 5.0   /* heavy keys: uniform in [5, 7] */
#define HEAVY_LOGIT_SPAN 2.0
#define LOCAL_LOGIT 4.0       /* bonus of a query for its own position's key, decays as RHO^d */
#define QUERY_NOISE 0.5       /* per-channel noise of queries */
#define KEY_RHO 0.95          /* AR(1) smoothness of keys along positions */
#define VALUE_RHO 0.5         /* AR(1) smoothness of values */
#define OUTLIER_SCALE 10.0    /* magnitude of outlier key channels (others have std 1) */
#define SINK_VALUE_SCALE 0.1 /* the sink's value vector is small (a "no-op" attention target) */
#define MAX_PLANTED 8         /* planted heavy tokens per (sequence, layer, KV head) */

/* "Weights" of one layer, shared by every sequence. */
typedef struct layer_model {
  float *u;           /* [Hkv][D] unit query direction of each KV head (0 on outlier channels) */
  uint8_t *outlier;   /* [D] 1 for outlier key channels */
  float *offset;      /* [Hkv][D] outlier channel offsets (0 elsewhere) */
} layer_model;

/* Token stream of one (sequence, layer): prompt positions, then generated ones. */
typedef struct token_stream {
  rng r;
  float *z, *zv;       /* [Hkv][D] AR(1) state of keys and values */
  uint32_t pos;        /* next position */
  uint32_t n_planted;  /* heavy tokens per KV head */
  int32_t *heavy_pos;  /* [Hkv][n_planted] ascending */
  float *heavy_logit;  /* [Hkv][n_planted] */
} token_stream;

static void model_init(layer_model *m, const options *o, uint32_t layer) {
  const uint32_t D = o->head_dim, Hkv = o->kv_heads;
  rng r;
  rng_init(&r, o->seed, 1, layer, 0);
  m->u = xmalloc(sizeof(float) * Hkv * D);
  m->outlier = xmalloc(D);
  m->offset = xmalloc(sizeof(float) * Hkv * D);
  /* D/32 outlier channels (at least 1), placed at random. */
  uint32_t n_out = D / 32 ? D / 32 : 1, placed = 0;
  while (placed < n_out) {
    const uint32_t c = (uint32_t)(rng_next(&r) % D);
    if (!m->outlier[c]) {
      m->outlier[c] = 1;
      ++placed;
    }
  }
  for (uint32_t g = 0; g < Hkv; ++g) {
    float *u = m->u + (size_t)g * D;
    double norm = 0.0;
    for (uint32_t c = 0; c < D; ++c) {
      const double x = m->outlier[c] ? 0.0 : rng_normal(&r);
      u[c] = (float)x;
      norm += x * x;
    }
    for (uint32_t c = 0; c < D; ++c) u[c] = (float)(u[c] / sqrt(norm));
    for (uint32_t c = 0; c < D; ++c)
      m->offset[(size_t)g * D + c] =
          m->outlier[c] ? (float)(OUTLIER_SCALE * (rng_uniform(&r) < 0.5 ? -1.0 : 1.0) *
                                  (0.8 + 0.4 * rng_uniform(&r)))
                        : 0.0f;
  }
}

static void model_free(layer_model *m) {
  free(m->u);
  free(m->outlier);
  free(m->offset);
}

/* Last prompt position (exclusive) that MiniKV's heavy-hitter selection can pick from:
 * the recent window (and, in window mode, the scoring window) is kept anyway. */
static uint32_t candidate_end(const options *o) {
  const uint32_t L = o->prompt;
  uint32_t protect = (uint32_t)floor((double)o->recent * L + 1e-9);
  if (o->mode == MINIKV_SCORE_WINDOW && protect < 32) protect = 32 < L ? 32 : L;
  return protect >= L ? 0 : L - protect;
}

static int cmp_i32(const void *a, const void *b) {
  const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

static void stream_init(token_stream *s, const options *o, uint32_t seq, uint32_t layer) {
  const uint32_t D = o->head_dim, Hkv = o->kv_heads;
  rng_init(&s->r, o->seed, 2, layer, seq);
  s->z = xmalloc(sizeof(float) * Hkv * D);
  s->zv = xmalloc(sizeof(float) * Hkv * D);
  for (uint32_t i = 0; i < Hkv * D; ++i) {
    s->z[i] = (float)rng_normal(&s->r);
    s->zv[i] = (float)rng_normal(&s->r);
  }
  s->pos = 0;
  /* Heavy tokens: distinct positions in [1, candidate_end), well apart from the sink. */
  const uint32_t end = candidate_end(o);
  const uint32_t room = end > 1 ? end - 1 : 0;
  s->n_planted = room / 16 < MAX_PLANTED ? room / 16 : MAX_PLANTED;
  s->heavy_pos = xmalloc(sizeof(int32_t) * Hkv * (s->n_planted + 1));
  s->heavy_logit = xmalloc(sizeof(float) * Hkv * (s->n_planted + 1));
  rng r;
  rng_init(&r, o->seed, 3, layer, seq);
  for (uint32_t g = 0; g < Hkv; ++g) {
    int32_t *pos = s->heavy_pos + (size_t)g * s->n_planted;
    for (uint32_t i = 0; i < s->n_planted; ++i) {
      int32_t p;
      int dup;
      do {
        p = 1 + (int32_t)(rng_next(&r) % room);
        dup = 0;
        for (uint32_t j = 0; j < i; ++j) dup |= pos[j] == p;
      } while (dup);
      pos[i] = p;
    }
    qsort(pos, s->n_planted, sizeof(int32_t), cmp_i32);
    for (uint32_t i = 0; i < s->n_planted; ++i)
      s->heavy_logit[(size_t)g * s->n_planted + i] =
          (float)(HEAVY_LOGIT_MIN + HEAVY_LOGIT_SPAN * rng_uniform(&r));
  }
}

static void stream_free(token_stream *s) {
  free(s->z);
  free(s->zv);
  free(s->heavy_pos);
  free(s->heavy_logit);
}

/* Generates the next token of a stream: q [H][D], k and v [Hkv][D], as floats. */
static void stream_next(token_stream *s, const layer_model *m, const options *o, float *q,
                        float *k, float *v) {
  const uint32_t D = o->head_dim, H = o->heads, Hkv = o->kv_heads, n_rep = H / Hkv;
  const double sqrt_d = sqrt((double)D);
  const double ck = sqrt(1.0 - KEY_RHO * KEY_RHO), cv = sqrt(1.0 - VALUE_RHO * VALUE_RHO);
  const double local = LOCAL_LOGIT / sqrt_d; /* so that local * |z|^2 / sqrt(D) ~ LOCAL_LOGIT */
  const uint32_t pos = s->pos++;
  for (uint32_t g = 0; g < Hkv; ++g) {
    float *z = s->z + (size_t)g * D, *zv = s->zv + (size_t)g * D;
    const float *u = m->u + (size_t)g * D, *off = m->offset + (size_t)g * D;
    for (uint32_t c = 0; c < D; ++c) {
      z[c] = (float)(KEY_RHO * z[c] + ck * rng_normal(&s->r));
      zv[c] = (float)(VALUE_RHO * zv[c] + cv * rng_normal(&s->r));
    }
    /* Alignment with the query direction: the sink, or a planted heavy token. */
    double boost = 0.0;
    if (pos == 0) {
      boost = SINK_LOGIT;
    } else {
      for (uint32_t i = 0; i < s->n_planted; ++i)
        if (s->heavy_pos[(size_t)g * s->n_planted + i] == (int32_t)pos)
          boost = s->heavy_logit[(size_t)g * s->n_planted + i];
    }
    float *kg = k + (size_t)g * D, *vg = v + (size_t)g * D;
    for (uint32_t c = 0; c < D; ++c) {
      /* Outlier channels: a large per-channel offset that drifts ~15% with the token. */
      const double outl = m->outlier[c] ? off[c] * (1.0 + 0.15 * z[c]) - z[c] : 0.0;
      kg[c] = (float)(z[c] + outl + boost * u[c]);
      /* The sink is a no-op target: its value is small, as in trained models. */
      vg[c] = pos == 0 ? (float)(SINK_VALUE_SCALE * zv[c]) : zv[c];
    }
    /* Queries of the group: aligned with u (logit = boost for an aligned key), plus a
     * little of this position's key (local attention), plus noise. */
    for (uint32_t r = 0; r < n_rep; ++r) {
      float *qh = q + (size_t)(g * n_rep + r) * D;
      for (uint32_t c = 0; c < D; ++c)
        qh[c] = (float)(sqrt_d * u[c] + local * z[c] + QUERY_NOISE * rng_normal(&s->r));
    }
  }
}

/* ---- tensors on the backend's side ------------------------------------------------ */

typedef struct dev_ctx {
  int cuda; /* buffers handed to the library are device buffers */
} dev_ctx;

static void *dev_alloc(const dev_ctx *d, void *host, size_t bytes) {
#ifdef MINIKV_DEMO_CUDA
  if (d->cuda) {
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
  }
#endif
  (void)d;
  (void)bytes;
  return host; /* CPU backend: the library reads the host buffer itself */
}

static void dev_free(const dev_ctx *d, void *p) {
#ifdef MINIKV_DEMO_CUDA
  if (d->cuda) CUDA_CHECK(cudaFree(p));
#endif
  (void)d;
  (void)p;
}

static void to_dev(const dev_ctx *d, void *dst, const void *src, size_t bytes) {
#ifdef MINIKV_DEMO_CUDA
  if (d->cuda) {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return;
  }
#endif
  (void)d;
  if (dst != src) memcpy(dst, src, bytes);
}

static void from_dev(const dev_ctx *d, void *dst, const void *src, size_t bytes) {
#ifdef MINIKV_DEMO_CUDA
  if (d->cuda) {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return;
  }
#endif
  (void)d;
  if (dst != src) memcpy(dst, src, bytes);
}

/* Waits for queued work, so that timings cover it (CUDA calls are asynchronous). */
static void dev_sync(const dev_ctx *d) {
#ifdef MINIKV_DEMO_CUDA
  if (d->cuda) CUDA_CHECK(cudaDeviceSynchronize());
#endif
  (void)d;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- the caches under comparison ------------------------------------------------- */

enum { V_MINIKV = 0, V_FULL = 1, V_EVICT = 2, V_QUANT = 3, V_MAX = 4 };

typedef struct variant {
  const char *name;
  minikv_config cfg;
  minikv_cache *cache;
  void *out_host, *out_dev;  /* prefill / decode output (prefill-sized) */
  double *prefill_ms;        /* [layers] */
  double decode_ms;          /* total append + decode over all steps and layers */
  double err_sq, ref_sq;     /* this step: squared error vs the full cache, and its norm */
  double max_abs;            /* this step */
  double *layer_rel_sum;     /* [layers] sum over steps of the per-layer relative error */
  double rel_sum, rel_max, abs_max; /* over steps */
} variant;

static void human_bytes(char *buf, size_t n, double bytes) {
  const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (bytes >= 1024.0 && i < 4) {
    bytes /= 1024.0;
    ++i;
  }
  snprintf(buf, n, i == 0 ? "%.0f %s" : "%.2f %s", bytes, unit[i]);
}

static void print_stats(const variant *v) {
  minikv_memory_stats st;
  memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  CHECK(minikv_memory_stats_get(v->cache, &st));
  char pool[32], used[32], fp16[32], ws[32];
  human_bytes(pool, sizeof pool, (double)st.pool_bytes);
  human_bytes(used, sizeof used, (double)st.used_bytes);
  human_bytes(fp16, sizeof fp16, (double)st.fp16_equivalent_bytes);
  human_bytes(ws, sizeof ws, (double)st.workspace_bytes);
  printf("  %-14s %11s %11s %11s %11.1f%% %8llu/%-8llu %11s\n", v->name, pool, used, fp16,
         100.0 * st.compression_ratio, (unsigned long long)st.tokens_cached,
         (unsigned long long)st.tokens_seen, ws);
}

/* Exact attention in double of one query row over keys/values [0, n) of one KV head
 * (history rows are [pos][Hkv][D] floats, already rounded to the caller's dtype). */
static void exact_attention(const float *q, const float *hk, const float *hv, uint32_t n,
                            uint32_t g, uint32_t Hkv, uint32_t D, double *out, double *logit) {
  const double scale = 1.0 / sqrt((double)D);
  double mx = -INFINITY;
  for (uint32_t j = 0; j < n; ++j) {
    const float *kj = hk + ((size_t)j * Hkv + g) * D;
    double s = 0.0;
    for (uint32_t c = 0; c < D; ++c) s += (double)q[c] * kj[c];
    logit[j] = s * scale;
    if (logit[j] > mx) mx = logit[j];
  }
  double sum = 0.0;
  for (uint32_t c = 0; c < D; ++c) out[c] = 0.0;
  for (uint32_t j = 0; j < n; ++j) {
    const double p = exp(logit[j] - mx);
    const float *vj = hv + ((size_t)j * Hkv + g) * D;
    sum += p;
    for (uint32_t c = 0; c < D; ++c) out[c] += p * vj[c];
  }
  for (uint32_t c = 0; c < D; ++c) out[c] /= sum;
}

/* Tolerance of a dtype-rounded attention output against float64. */
static double ref_tolerance(minikv_dtype t, double max_ref) {
  const double rel = t == MINIKV_DTYPE_F16 ? 2e-3 : t == MINIKV_DTYPE_BF16 ? 1.6e-2 : 1e-5;
  return rel * (max_ref > 1.0 ? max_ref : 1.0);
}

int main(int argc, char **argv) {
  options o;
  parse_options(argc, argv, &o);

  if (!MINIKV_VERSION_COMPATIBLE(minikv_version_number())) {
    fprintf(stderr, "minikv_demo: compiled against libminikv %d.%d.%d but loaded %s\n",
            MINIKV_VERSION_MAJOR, MINIKV_VERSION_MINOR, MINIKV_VERSION_PATCH,
            minikv_version_string());
    return 1;
  }

  /* ---- backend --------------------------------------------------------------------- */
  dev_ctx dev = {0};
  minikv_backend backend = MINIKV_BACKEND_CPU;
  const char *backend_note = "";
#ifdef MINIKV_DEMO_CUDA
  if (o.backend != 1) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (count > 0) {
      dev.cuda = 1;
      backend = MINIKV_BACKEND_CUDA;
    } else if (o.backend == 2) {
      fprintf(stderr, "minikv_demo: --backend cuda, but no CUDA device is visible\n");
      return 1;
    } else {
      backend_note = " (auto: no CUDA device visible)";
    }
  }
#else
  if (o.backend == 2) {
    fprintf(stderr,
            "minikv_demo: --backend cuda: this demo was built without CUDA (libminikv was "
            "configured without its CUDA backend; reconfigure with -DMINIKV_CUDA=ON on a "
            "machine with nvcc)\n");
    return 1;
  }
  if (o.backend == 0) backend_note = " (auto: demo built without CUDA)";
#endif

  const uint32_t NL = o.layers, H = o.heads, Hkv = o.kv_heads, D = o.head_dim;
  const uint32_t L = o.prompt, B = o.batch, G = o.gen;
  const minikv_dtype dt = o.dtype;
  const size_t es = dtype_size(dt);

  /* ---- the caches ------------------------------------------------------------------ */
  variant vars[V_MAX];
  const int n_vars = o.ablation ? 4 : 2;
  memset(vars, 0, sizeof(vars));
  for (int i = 0; i < n_vars; ++i) {
    minikv_config *c = &vars[i].cfg;
    minikv_config_default(c);
    c->backend = backend;
    c->dtype = dt;
    c->num_layers = NL;
    c->num_heads = H;
    c->num_kv_heads = Hkv;
    c->head_dim = D;
    c->max_sequences = B;
    c->max_seq_len = L + G;
    c->heavy_ratio = o.heavy;
    c->recent_ratio = o.recent;
    c->budget_policy = o.policy;
    c->pyramid_depth = o.depth;
    c->score_mode = o.mode;
    c->key_bits = o.key_bits;
    c->value_bits = o.value_bits;
    c->group_size = o.group;
    c->residual_length = o.residual;
    c->flush_tokens = o.flush;
    c->sink_tokens = o.sinks;
  }
  vars[V_MINIKV].name = "MiniKV";
  /* The exact reference: nothing evicted (a budget of the whole prompt keeps every token),
   * nothing quantized. */
  vars[V_FULL].name = "full 16-bit";
  vars[V_FULL].cfg.heavy_ratio = 1.0f;
  vars[V_FULL].cfg.recent_ratio = 1.0f;
  vars[V_FULL].cfg.budget_policy = MINIKV_BUDGET_UNIFORM;
  vars[V_FULL].cfg.key_bits = vars[V_FULL].cfg.value_bits = 16;
  if (o.ablation) {
    vars[V_EVICT].name = "evict-only";
    vars[V_EVICT].cfg.key_bits = vars[V_EVICT].cfg.value_bits = 16;
    vars[V_QUANT].name = "quant-only";
    vars[V_QUANT].cfg.heavy_ratio = 1.0f;
    vars[V_QUANT].cfg.recent_ratio = 1.0f;
    vars[V_QUANT].cfg.budget_policy = MINIKV_BUDGET_UNIFORM;
  }
  for (int i = 0; i < n_vars; ++i) {
    const minikv_status st = minikv_cache_create(&vars[i].cfg, &vars[i].cache);
    if (st != MINIKV_OK) {
      fprintf(stderr, "minikv_demo: minikv_cache_create of the %s cache failed\n  status: %s\n"
                      "  detail: %s\n", vars[i].name, minikv_status_string(st),
              minikv_last_error_message());
      return 1;
    }
  }

  printf("libminikv %s demo: synthetic LLaMA-shaped workload, seed %llu\n",
         minikv_version_string(), (unsigned long long)o.seed);
  printf("  model    %u layers, %u query heads, %u KV heads (GQA x%u), head_dim %u, %s\n", NL,
         H, Hkv, H / Hkv, D, dtype_name(dt));
  printf("  work     %u sequence(s) x %u prompt tokens, then %u decode steps; backend %s%s\n",
         B, L, G, dev.cuda ? "cuda" : "cpu", backend_note);
  printf("  MiniKV   %u-bit keys (per channel), %u-bit values (per token), group %u, residual %u%s;\n"
         "           %u sinks, heavy %.3g + recent %.3g of the prompt, %s budgets",
         o.key_bits, o.value_bits, o.group, o.residual, o.flush ? " (sliding flush)" : "", o.sinks,
         o.heavy, o.recent,
         o.policy == MINIKV_BUDGET_PYRAMID ? "pyramid" : "uniform");
  if (o.policy == MINIKV_BUDGET_PYRAMID) printf(" (depth %.3g)", o.depth);
  printf(", %s scores\n", o.mode == MINIKV_SCORE_WINDOW ? "window (SnapKV)" : "cumulative (H2O)");
  printf("  exact    keep-everything 16-bit cache (key_bits = value_bits = 16, heavy_ratio =\n"
         "           recent_ratio = 1)\n");

  /* ---- buffers --------------------------------------------------------------------- */
  const size_t q_elems = (size_t)B * L * H * D, kv_elems = (size_t)B * L * Hkv * D;
  void *hq = xmalloc(q_elems * es), *hk = xmalloc(kv_elems * es), *hv = xmalloc(kv_elems * es);
  void *dq = dev_alloc(&dev, hq, q_elems * es), *dk = dev_alloc(&dev, hk, kv_elems * es),
       *dv = dev_alloc(&dev, hv, kv_elems * es);
  for (int i = 0; i < n_vars; ++i) {
    vars[i].out_host = xmalloc(q_elems * es);
    vars[i].out_dev = dev_alloc(&dev, vars[i].out_host, q_elems * es);
    vars[i].prefill_ms = xmalloc(sizeof(double) * NL);
    vars[i].layer_rel_sum = xmalloc(sizeof(double) * NL);
  }
  float *tq = xmalloc(sizeof(float) * H * D), *tk = xmalloc(sizeof(float) * Hkv * D),
        *tv = xmalloc(sizeof(float) * Hkv * D);
  /* float64 check of the reference itself: layer 0, sequence 0, every position. */
  const size_t hist_rows = (size_t)L + G;
  float *hist_k = xmalloc(sizeof(float) * hist_rows * Hkv * D);
  float *hist_v = xmalloc(sizeof(float) * hist_rows * Hkv * D);
  float *hist_q = xmalloc(sizeof(float) * (size_t)L * H * D); /* layer 0 prompt queries */
  double *ref_out = xmalloc(sizeof(double) * D), *ref_logit = xmalloc(sizeof(double) * hist_rows);
  double ref_max_err = 0.0, ref_max_tol = 0.0;
  int ref_fail = 0;

  layer_model *models = xmalloc(sizeof(layer_model) * NL);
  token_stream *streams = xmalloc(sizeof(token_stream) * (size_t)NL * B);
  uint32_t *seq_ids = xmalloc(sizeof(uint32_t) * B);
  int32_t *cu = xmalloc(sizeof(int32_t) * (B + 1));
  for (uint32_t s = 0; s < B; ++s) {
    seq_ids[s] = s;
    cu[s] = (int32_t)(s * L);
  }
  cu[B] = (int32_t)(B * L);
  for (uint32_t l = 0; l < NL; ++l) {
    model_init(&models[l], &o, l);
    for (uint32_t s = 0; s < B; ++s) stream_init(&streams[(size_t)l * B + s], &o, s, l);
  }
  int32_t *kept = xmalloc(sizeof(int32_t) * L);

  /* ---- prefill, layer by layer ----------------------------------------------------- */
  printf("\nPrefill: kept prompt tokens per layer (sequence 0, KV head 0), planted tokens kept\n"
         "(all sequences and KV heads), time per layer for the %u sequence(s)\n", B);
  printf("  layer   kept/prompt            sink   heavy     MiniKV ms   full ms\n");
  double prefill_out_diff = 0.0;
  uint64_t sink_total = 0, sink_kept = 0, heavy_total = 0, heavy_kept = 0;
  for (uint32_t l = 0; l < NL; ++l) {
    for (uint32_t s = 0; s < B; ++s) {
      token_stream *st = &streams[(size_t)l * B + s];
      for (uint32_t t = 0; t < L; ++t) {
        stream_next(st, &models[l], &o, tq, tk, tv);
        const size_t row = (size_t)s * L + t;
        for (uint32_t i = 0; i < H * D; ++i) {
          const float x = store_elem(hq, dt, row * H * D + i, tq[i]);
          if (l == 0 && s == 0) hist_q[(size_t)t * H * D + i] = x;
        }
        for (uint32_t i = 0; i < Hkv * D; ++i) {
          const float xk = store_elem(hk, dt, row * Hkv * D + i, tk[i]);
          const float xv = store_elem(hv, dt, row * Hkv * D + i, tv[i]);
          if (l == 0 && s == 0) {
            hist_k[(size_t)t * Hkv * D + i] = xk;
            hist_v[(size_t)t * Hkv * D + i] = xv;
          }
        }
      }
    }
    to_dev(&dev, dq, hq, q_elems * es);
    to_dev(&dev, dk, hk, kv_elems * es);
    to_dev(&dev, dv, hv, kv_elems * es);
    for (int i = 0; i < n_vars; ++i) {
      dev_sync(&dev);
      const double t0 = now_ms();
      CHECK(minikv_prefill(vars[i].cache, l, B, seq_ids, cu, dq, dk, dv, vars[i].out_dev, NULL));
      dev_sync(&dev);
      vars[i].prefill_ms[l] = now_ms() - t0;
      from_dev(&dev, vars[i].out_host, vars[i].out_dev, q_elems * es);
    }
    /* Prefill attention is exact in every cache (compression only affects later steps). */
    for (int i = 0; i < n_vars; ++i)
      for (size_t e = 0; e < q_elems; ++e) {
        const double d = fabs((double)load_elem(vars[i].out_host, dt, e) -
                              (double)load_elem(vars[V_FULL].out_host, dt, e));
        if (!(d <= prefill_out_diff)) prefill_out_diff = d; /* NaN propagates */
      }
    if (l == 0) {
      /* Check the reference's prefill rows against float64: first, last and a few others. */
      const uint32_t rows[6] = {0, 1, L / 3, L / 2, (L * 3) / 4, L - 1};
      for (uint32_t ri = 0; ri < 6; ++ri) {
        const uint32_t t = rows[ri] < L ? rows[ri] : L - 1;
        for (uint32_t h = 0; h < H; ++h) {
          exact_attention(hist_q + ((size_t)t * H + h) * D, hist_k, hist_v, t + 1, h / (H / Hkv),
                          Hkv, D, ref_out, ref_logit);
          double mx = 0.0, err = 0.0;
          for (uint32_t c = 0; c < D; ++c) {
            const double got = load_elem(vars[V_FULL].out_host, dt, ((size_t)t * H + h) * D + c);
            const double e = fabs(got - ref_out[c]);
            if (!(e <= err)) err = e;
            if (fabs(ref_out[c]) > mx) mx = fabs(ref_out[c]);
          }
          const double tol = ref_tolerance(dt, mx);
          if (err > ref_max_err || err != err) ref_max_err = err;
          if (tol > ref_max_tol) ref_max_tol = tol;
          if (!(err <= tol)) ref_fail = 1;
        }
      }
    }

    /* What MiniKV kept: count (sequence 0, KV head 0), and the planted tokens everywhere. */
    uint64_t seen = 0, cached = 0;
    CHECK(minikv_sequence_length(vars[V_MINIKV].cache, 0, l, &seen, &cached));
    uint32_t n_kept0 = 0, layer_sink = 0, layer_sink_total = 0, layer_heavy = 0, layer_heavy_total = 0;
    for (uint32_t s = 0; s < B; ++s) {
      const token_stream *st = &streams[(size_t)l * B + s];
      for (uint32_t g = 0; g < Hkv; ++g) {
        uint32_t count = 0;
        CHECK(minikv_kept_positions(vars[V_MINIKV].cache, s, l, g, kept, L, &count));
        if (s == 0 && g == 0) n_kept0 = count;
        const uint32_t n = count < L ? count : L;
        /* kept is ascending: binary search. */
        int has_sink = n > 0 && kept[0] == 0;
        layer_sink += (uint32_t)has_sink;
        ++layer_sink_total;
        for (uint32_t i = 0; i < st->n_planted; ++i) {
          const int32_t p = st->heavy_pos[(size_t)g * st->n_planted + i];
          layer_heavy += bsearch(&p, kept, n, sizeof(int32_t), cmp_i32) != NULL;
          ++layer_heavy_total;
        }
      }
    }
    sink_kept += layer_sink;
    sink_total += layer_sink_total;
    heavy_kept += layer_heavy;
    heavy_total += layer_heavy_total;
    if (cached != n_kept0) {
      fprintf(stderr,
              "minikv_demo: inconsistent library answers: minikv_sequence_length says %llu "
              "tokens cached, minikv_kept_positions says %u\n",
              (unsigned long long)cached, n_kept0);
      return 1;
    }
    char bar[41];
    const uint32_t width = (uint32_t)(40.0 * n_kept0 / L + 0.5);
    for (uint32_t i = 0; i < 40; ++i) bar[i] = i < width ? '#' : '.';
    bar[40] = '\0';
    printf("  %5u  %6u/%-6u %5.1f%%  %3u/%-3u %4u/%-4u %9.2f %9.2f  %s\n", l, n_kept0, L,
           100.0 * n_kept0 / L, layer_sink, layer_sink_total, layer_heavy, layer_heavy_total,
           vars[V_MINIKV].prefill_ms[l], vars[V_FULL].prefill_ms[l], bar);
  }
  double prefill_total[V_MAX] = {0};
  for (int i = 0; i < n_vars; ++i)
    for (uint32_t l = 0; l < NL; ++l) prefill_total[i] += vars[i].prefill_ms[l];
  printf("  total                                           %9.2f %9.2f\n",
         prefill_total[V_MINIKV], prefill_total[V_FULL]);
  printf("  planted tokens kept: sink %llu/%llu, heavy %llu/%llu\n",
         (unsigned long long)sink_kept, (unsigned long long)sink_total,
         (unsigned long long)heavy_kept, (unsigned long long)heavy_total);
  printf("  prefill outputs, every cache vs the full cache: max |diff| %.3g (prefill attention "
         "is exact)\n", prefill_out_diff);
  if (o.ablation) {
    printf("  prefill ms, ablation caches:");
    for (int i = 2; i < n_vars; ++i) printf("  %s %.1f", vars[i].name, prefill_total[i]);
    printf("\n");
  }

  printf("\nMemory after prefill\n");
  printf("  %-14s %11s %11s %11s %12s %17s %11s\n", "cache", "pool", "used", "fp16-equiv",
         "compression", "cached/seen", "workspace");
  for (int i = 0; i < n_vars; ++i) print_stats(&vars[i]);

  /* ---- decode ---------------------------------------------------------------------- */
  const size_t dq_elems = (size_t)B * H * D, dkv_elems = (size_t)B * Hkv * D;
  uint32_t every = o.every;
  if (every == 0) every = G <= 16 ? 1 : (G + 15) / 16; /* about 16 lines */
  if (G > 0) {
    printf("\nDecode: append + decode of one token per sequence in every layer; error of MiniKV's\n"
           "attention output vs the full cache, over all layers, sequences and heads\n");
    printf("  step  position   rel L2 err  max abs err   MiniKV ms   full ms");
    if (o.ablation) printf("   evict-only  quant-only");
    printf("\n");
  }
  for (uint32_t step = 0; step < G; ++step) {
    const uint32_t pos = L + step;
    for (int i = 0; i < n_vars; ++i) vars[i].err_sq = vars[i].ref_sq = vars[i].max_abs = 0.0;
    double step_ms[V_MAX] = {0};
    for (uint32_t l = 0; l < NL; ++l) {
      for (uint32_t s = 0; s < B; ++s) {
        stream_next(&streams[(size_t)l * B + s], &models[l], &o, tq, tk, tv);
        for (uint32_t i = 0; i < H * D; ++i) {
          const float x = store_elem(hq, dt, (size_t)s * H * D + i, tq[i]);
          tq[i] = x;
        }
        for (uint32_t i = 0; i < Hkv * D; ++i) {
          const float xk = store_elem(hk, dt, (size_t)s * Hkv * D + i, tk[i]);
          const float xv = store_elem(hv, dt, (size_t)s * Hkv * D + i, tv[i]);
          if (l == 0 && s == 0) {
            hist_k[(size_t)pos * Hkv * D + i] = xk;
            hist_v[(size_t)pos * Hkv * D + i] = xv;
          }
        }
        if (l == 0 && s == 0) memcpy(hist_q, tq, sizeof(float) * H * D); /* this step's query */
      }
      to_dev(&dev, dq, hq, dq_elems * es);
      to_dev(&dev, dk, hk, dkv_elems * es);
      to_dev(&dev, dv, hv, dkv_elems * es);
      for (int i = 0; i < n_vars; ++i) {
        dev_sync(&dev);
        const double t0 = now_ms();
        CHECK(minikv_append(vars[i].cache, l, B, seq_ids, dk, dv, NULL));
        CHECK(minikv_decode(vars[i].cache, l, B, seq_ids, dq, vars[i].out_dev, NULL));
        dev_sync(&dev);
        step_ms[i] += now_ms() - t0;
        from_dev(&dev, vars[i].out_host, vars[i].out_dev, dq_elems * es);
      }
      /* Errors of this layer vs the full cache. */
      for (int i = 0; i < n_vars; ++i) {
        if (i == V_FULL) continue;
        double e2 = 0.0, r2 = 0.0;
        for (size_t e = 0; e < dq_elems; ++e) {
          const double ref = load_elem(vars[V_FULL].out_host, dt, e);
          const double d = (double)load_elem(vars[i].out_host, dt, e) - ref;
          e2 += d * d;
          r2 += ref * ref;
          if (!(fabs(d) <= vars[i].max_abs)) vars[i].max_abs = fabs(d);
        }
        vars[i].err_sq += e2;
        vars[i].ref_sq += r2;
        vars[i].layer_rel_sum[l] += r2 > 0.0 ? sqrt(e2 / r2) : (e2 > 0.0 ? INFINITY : 0.0);
      }
      if (l == 0) { /* the reference itself vs float64, sequence 0 */
        for (uint32_t h = 0; h < H; ++h) {
          exact_attention(hist_q + (size_t)h * D, hist_k, hist_v, pos + 1, h / (H / Hkv), Hkv, D,
                          ref_out, ref_logit);
          double mx = 0.0, err = 0.0;
          for (uint32_t c = 0; c < D; ++c) {
            const double e = fabs(load_elem(vars[V_FULL].out_host, dt, (size_t)h * D + c) - ref_out[c]);
            if (!(e <= err)) err = e;
            if (fabs(ref_out[c]) > mx) mx = fabs(ref_out[c]);
          }
          const double tol = ref_tolerance(dt, mx);
          if (err > ref_max_err || err != err) ref_max_err = err;
          if (tol > ref_max_tol) ref_max_tol = tol;
          if (!(err <= tol)) ref_fail = 1;
        }
      }
    }
    for (int i = 0; i < n_vars; ++i) {
      vars[i].decode_ms += step_ms[i];
      if (i == V_FULL) continue;
      const double rel = vars[i].ref_sq > 0.0 ? sqrt(vars[i].err_sq / vars[i].ref_sq) : 0.0;
      vars[i].rel_sum += rel;
      if (!(rel <= vars[i].rel_max)) vars[i].rel_max = rel;
      if (!(vars[i].max_abs <= vars[i].abs_max)) vars[i].abs_max = vars[i].max_abs;
      vars[i].err_sq = rel; /* reused below for printing */
    }
    if ((step + 1) % every == 0 || step == 0 || step + 1 == G) {
      printf("  %4u  %8u   %10.3e  %11.3e  %10.3f %9.3f", step + 1, pos, vars[V_MINIKV].err_sq,
             vars[V_MINIKV].max_abs, step_ms[V_MINIKV], step_ms[V_FULL]);
      if (o.ablation) printf("   %10.3e  %10.3e", vars[V_EVICT].err_sq, vars[V_QUANT].err_sq);
      printf("\n");
      fflush(stdout);
    }
  }

  if (G > 0) {
    printf("  mean rel L2 err per layer:");
    for (uint32_t l = 0; l < NL; ++l) printf(" %u:%.3e", l, vars[V_MINIKV].layer_rel_sum[l] / G);
    printf("\n  over %u steps: MiniKV rel L2 err mean %.3e, max %.3e; max abs err %.3e\n", G,
           vars[V_MINIKV].rel_sum / G, vars[V_MINIKV].rel_max, vars[V_MINIKV].abs_max);
    if (o.ablation)
      for (int i = 2; i < n_vars; ++i)
        printf("  over %u steps: %-10s rel L2 err mean %.3e, max %.3e; max abs err %.3e\n", G,
               vars[i].name, vars[i].rel_sum / G, vars[i].rel_max, vars[i].abs_max);

    printf("\nMemory after %u decode steps\n", G);
    printf("  %-14s %11s %11s %11s %12s %17s %11s\n", "cache", "pool", "used", "fp16-equiv",
           "compression", "cached/seen", "workspace");
    for (int i = 0; i < n_vars; ++i) print_stats(&vars[i]);
  }

  printf("\nTiming (%s backend)\n", dev.cuda ? "cuda" : "cpu");
  for (int i = 0; i < n_vars; ++i) {
    printf("  %-14s prefill %9.2f ms total, %8.2f ms/layer", vars[i].name, prefill_total[i],
           prefill_total[i] / NL);
    if (G > 0)
      printf("; decode %8.3f ms/step (all %u layers, %u seq), %8.3f ms/token", vars[i].decode_ms / G,
             NL, B, vars[i].decode_ms / G / B);
    printf("\n");
  }

  printf("\nReference check: full 16-bit cache vs float64 attention (layer 0, sequence 0, %s):\n"
         "  max abs err %.3e (tolerance %.3e) -> %s\n",
         G > 0 ? "6 prompt rows + every decode step" : "6 prompt rows", ref_max_err, ref_max_tol,
         ref_fail ? "FAIL" : "ok");

  {
    minikv_memory_stats st;
    memset(&st, 0, sizeof(st));
    st.struct_size = sizeof(st);
    CHECK(minikv_memory_stats_get(vars[V_MINIKV].cache, &st));
    printf("\nSummary: MiniKV kept %llu of %llu tokens in %.1f%% less memory than fp16; sink kept "
           "%llu/%llu, heavy %llu/%llu",
           (unsigned long long)st.tokens_cached, (unsigned long long)st.tokens_seen,
           100.0 * st.compression_ratio, (unsigned long long)sink_kept,
           (unsigned long long)sink_total, (unsigned long long)heavy_kept,
           (unsigned long long)heavy_total);
    if (G > 0) printf("; decode rel L2 err mean %.3f", vars[V_MINIKV].rel_sum / G);
    printf("; reference %s\n", ref_fail ? "FAIL" : "ok");
  }

  /* ---- cleanup --------------------------------------------------------------------- */
  for (int i = 0; i < n_vars; ++i) {
    minikv_cache_destroy(vars[i].cache);
    dev_free(&dev, vars[i].out_dev);
    free(vars[i].out_host);
    free(vars[i].prefill_ms);
    free(vars[i].layer_rel_sum);
  }
  for (uint32_t l = 0; l < NL; ++l) {
    model_free(&models[l]);
    for (uint32_t s = 0; s < B; ++s) stream_free(&streams[(size_t)l * B + s]);
  }
  dev_free(&dev, dq);
  dev_free(&dev, dk);
  dev_free(&dev, dv);
  free(models); free(streams); free(seq_ids); free(cu); free(kept);
  free(hq); free(hk); free(hv); free(tq); free(tk); free(tv);
  free(hist_k); free(hist_v); free(hist_q); free(ref_out); free(ref_logit);

  if (ref_fail) {
    fprintf(stderr, "minikv_demo: the keep-everything cache disagrees with float64 attention "
                    "beyond the %s tolerance: a libminikv bug\n", dtype_name(dt));
    return 3;
  }
  return 0;
}

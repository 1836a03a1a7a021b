/* gguf.c — see gguf.h. */
#define _POSIX_C_SOURCE 200809L /* strdup, mmap */

#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

struct gguf_file {
  char *path;
  const uint8_t *map;
  uint64_t size;
  uint32_t version;
  uint64_t n_kv, n_tensors;
  gguf_kv *kv;
  gguf_tensor *tensors;
};

/* ---- element types ----------------------------------------------------------------- */

typedef struct type_info {
  const char *name;
  uint32_t block;      /* elements per block */
  uint32_t block_size; /* bytes per block */
} type_info;

/* ggml's element types (index = type number); block 0 = a number not assigned. */
static const type_info TYPES[] = {
  [0] = {"F32", 1, 4},       [1] = {"F16", 1, 2},        [2] = {"Q4_0", 32, 18},
  [3] = {"Q4_1", 32, 20},    [6] = {"Q5_0", 32, 22},     [7] = {"Q5_1", 32, 24},
  [8] = {"Q8_0", 32, 34},    [9] = {"Q8_1", 32, 36},     [10] = {"Q2_K", 256, 84},
  [11] = {"Q3_K", 256, 110}, [12] = {"Q4_K", 256, 144},  [13] = {"Q5_K", 256, 176},
  [14] = {"Q6_K", 256, 210}, [15] = {"Q8_K", 256, 292},  [16] = {"IQ2_XXS", 256, 66},
  [17] = {"IQ2_XS", 256, 74}, [18] = {"IQ3_XXS", 256, 98}, [19] = {"IQ1_S", 256, 50},
  [20] = {"IQ4_NL", 32, 18}, [21] = {"IQ3_S", 256, 110}, [22] = {"IQ2_S", 256, 82},
  [23] = {"IQ4_XS", 256, 136}, [24] = {"I8", 1, 1},      [25] = {"I16", 1, 2},
  [26] = {"I32", 1, 4},      [27] = {"I64", 1, 8},       [28] = {"F64", 1, 8},
  [29] = {"IQ1_M", 256, 56}, [30] = {"BF16", 1, 2},      [34] = {"TQ1_0", 256, 54},
  [35] = {"TQ2_0", 256, 66}, [39] = {"MXFP4", 32, 17},
};

static const type_info *type_info_of(uint32_t type) {
  if (type >= sizeof TYPES / sizeof TYPES[0] || TYPES[type].block == 0) return NULL;
  return &TYPES[type];
}

const char *gguf_type_name(uint32_t type) {
  static char unknown[32];
  const type_info *t = type_info_of(type);
  if (t) return t->name;
  snprintf(unknown, sizeof unknown, "type %u", type);
  return unknown;
}

bool gguf_type_supported(uint32_t type) {
  return type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16 ||
         type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q8_0;
}

/* ---- a bounds-checked cursor over the mapping --------------------------------------- */

typedef struct cursor {
  const uint8_t *base;
  uint64_t size, pos;
  const char *path;
  bool ok;
} cursor;

static bool truncated(cursor *c, const char *what) {
  if (c->ok) fail("%s: truncated or corrupt GGUF header (reading %s at byte %llu of %llu)",
                  c->path, what, (unsigned long long)c->pos, (unsigned long long)c->size);
  c->ok = false;
  return false;
}

static bool take(cursor *c, uint64_t n, const uint8_t **at, const char *what) {
  if (!c->ok || n > c->size - c->pos) return truncated(c, what);
  *at = c->base + c->pos;
  c->pos += n;
  return true;
}

static uint64_t read_uint(cursor *c, unsigned bytes, const char *what) {
  const uint8_t *p;
  if (!take(c, bytes, &p, what)) return 0;
  uint64_t v = 0;
  for (unsigned i = 0; i < bytes; ++i) v |= (uint64_t)p[i] << (8 * i); /* little-endian */
  return v;
}

static gguf_string read_string(cursor *c, const char *what) {
  gguf_string s = {"", 0};
  const uint64_t len = read_uint(c, 8, what);
  const uint8_t *p;
  if (c->ok && take(c, len, &p, what)) {
    s.ptr = (const char *)p;
    s.len = len;
  }
  return s;
}

static unsigned scalar_size(gguf_value_type t) {
  switch (t) {
    case GGUF_UINT8: case GGUF_INT8: case GGUF_BOOL: return 1;
    case GGUF_UINT16: case GGUF_INT16: return 2;
    case GGUF_UINT32: case GGUF_INT32: case GGUF_FLOAT32: return 4;
    case GGUF_UINT64: case GGUF_INT64: case GGUF_FLOAT64: return 8;
    default: return 0;
  }
}

/* Steps over one value of type t (arrays recursively, depth-limited). */
static bool skip_value(cursor *c, gguf_value_type t, int depth) {
  const unsigned s = scalar_size(t);
  const uint8_t *p;
  if (s) return take(c, s, &p, "a metadata value");
  if (t == GGUF_STRING) {
    read_string(c, "a metadata string");
    return c->ok;
  }
  if (t == GGUF_ARRAY && depth < 4) {
    const gguf_value_type et = (gguf_value_type)read_uint(c, 4, "an array type");
    const uint64_t n = read_uint(c, 8, "an array length");
    if (!c->ok) return false;
    const unsigned es = scalar_size(et);
    if (es) return n <= (c->size - c->pos) / es ? take(c, n * es, &p, "array data")
                                                : truncated(c, "array data");
    for (uint64_t i = 0; i < n && c->ok; ++i) skip_value(c, et, depth + 1);
    return c->ok;
  }
  if (c->ok) fail("%s: metadata value of unknown type %u at byte %llu", c->path, (unsigned)t,
                  (unsigned long long)c->pos);
  c->ok = false;
  return false;
}

/* ---- open / close ------------------------------------------------------------------- */

static bool parse(gguf_file *g) {
  cursor c = {g->map, g->size, 0, g->path, true};
  const uint8_t *magic;
  if (!take(&c, 4, &magic, "the magic") || memcmp(magic, "GGUF", 4) != 0)
    return fail("%s: not a GGUF file (no \"GGUF\" magic)", g->path);
  g->version = (uint32_t)read_uint(&c, 4, "the version");
  if (c.ok && (g->version < 2 || g->version > 3))
    return fail("%s: GGUF version %u is not supported (2 and 3 are)", g->path, g->version);
  g->n_tensors = read_uint(&c, 8, "the tensor count");
  g->n_kv = read_uint(&c, 8, "the metadata count");
  if (!c.ok) return false;
  /* Each pair or descriptor takes at least 8 bytes: a bound that rejects absurd counts. */
  if (g->n_kv > g->size / 8 || g->n_tensors > g->size / 8)
    return fail("%s: corrupt GGUF header (%llu metadata pairs, %llu tensors in %llu bytes)",
                g->path, (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors,
                (unsigned long long)g->size);
  g->kv = alloc_zeroed(g->n_kv, sizeof *g->kv, "GGUF metadata");
  g->tensors = alloc_zeroed(g->n_tensors, sizeof *g->tensors, "GGUF tensor list");
  if (!g->kv || !g->tensors) return false;

  for (uint64_t i = 0; i < g->n_kv && c.ok; ++i) {
    gguf_kv *kv = &g->kv[i];
    kv->key = read_string(&c, "a metadata key");
    kv->type = (gguf_value_type)read_uint(&c, 4, "a metadata type");
    if (!c.ok) break;
    if (kv->type == GGUF_ARRAY) {
      const uint64_t at = c.pos;
      kv->array_type = (gguf_value_type)read_uint(&c, 4, "an array type");
      kv->array_count = read_uint(&c, 8, "an array length");
      kv->value = g->map + c.pos;
      c.pos = at;
    } else {
      kv->value = g->map + c.pos;
    }
    skip_value(&c, kv->type, 0);
  }
  if (!c.ok) return false;

  uint64_t alignment = 32;
  if (gguf_get_u64(g, "general.alignment", &alignment) && (alignment == 0 || (alignment & (alignment - 1))))
    return fail("%s: general.alignment %llu is not a power of two", g->path,
                (unsigned long long)alignment);

  for (uint64_t i = 0; i < g->n_tensors && c.ok; ++i) {
    gguf_tensor *t = &g->tensors[i];
    t->name = read_string(&c, "a tensor name");
    t->n_dims = (uint32_t)read_uint(&c, 4, "a tensor's dimension count");
    if (c.ok && (t->n_dims == 0 || t->n_dims > 4))
      return fail("%s: tensor %.*s has %u dimensions (1 to 4 allowed)", g->path,
                  (int)t->name.len, t->name.ptr, t->n_dims);
    t->n_elements = 1;
    for (uint32_t d = 0; d < t->n_dims && c.ok; ++d) {
      t->dims[d] = read_uint(&c, 8, "a tensor dimension");
      if (t->dims[d] == 0 || t->n_elements > UINT64_MAX / 2 / t->dims[d])
        return fail("%s: tensor %.*s has a bad dimension", g->path, (int)t->name.len,
                    t->name.ptr);
      t->n_elements *= t->dims[d];
    }
    for (uint32_t d = t->n_dims; d < 4; ++d) t->dims[d] = 1;
    t->type = (uint32_t)read_uint(&c, 4, "a tensor type");
    const uint64_t offset = read_uint(&c, 8, "a tensor offset");
    if (!c.ok) break;
    const type_info *ti = type_info_of(t->type);
    if (ti) {
      if (t->dims[0] % ti->block)
        return fail("%s: tensor %.*s (%s) has rows of %llu elements, not whole blocks of %u",
                    g->path, (int)t->name.len, t->name.ptr, ti->name,
                    (unsigned long long)t->dims[0], ti->block);
      t->n_bytes = t->n_elements / ti->block * ti->block_size;
    }
    t->data = (const uint8_t *)(uintptr_t)offset; /* relative until the data start is known */
  }
  if (!c.ok) return false;

  const uint64_t data_start = (c.pos + alignment - 1) / alignment * alignment;
  for (uint64_t i = 0; i < g->n_tensors; ++i) {
    gguf_tensor *t = &g->tensors[i];
    const uint64_t offset = (uint64_t)(uintptr_t)t->data;
    if (data_start > g->size || offset > g->size - data_start ||
        t->n_bytes > g->size - data_start - offset)
      return fail("%s: tensor %.*s lies beyond the end of the file (truncated download?)",
                  g->path, (int)t->name.len, t->name.ptr);
    t->data = g->map + data_start + offset;
  }
  return true;
}

gguf_file *gguf_open(const char *path) {
  gguf_file *g = alloc_zeroed(1, sizeof *g, "GGUF handle");
  if (!g) return NULL;
  g->path = strdup(path);
  const int fd = open(path, O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    fail("%s: cannot open (%s)", path, strerror(errno));
    if (fd >= 0) close(fd);
    gguf_close(g);
    return NULL;
  }
  g->size = (uint64_t)st.st_size;
  if (g->size < 24) {
    close(fd);
    fail("%s: %llu bytes, too short for a GGUF file", path, (unsigned long long)g->size);
    gguf_close(g);
    return NULL;
  }
  void *map = mmap(NULL, (size_t)g->size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    fail("%s: cannot map %llu bytes (%s)", path, (unsigned long long)g->size,
         strerror(errno));
    gguf_close(g);
    return NULL;
  }
  g->map = map;
  if (!parse(g)) {
    gguf_close(g);
    return NULL;
  }
  return g;
}

void gguf_close(gguf_file *g) {
  if (!g) return;
  if (g->map) munmap((void *)(uintptr_t)g->map, (size_t)g->size);
  free(g->kv);
  free(g->tensors);
  free(g->path);
  free(g);
}

/* ---- metadata ----------------------------------------------------------------------- */

bool gguf_string_is(gguf_string s, const char *text) {
  const size_t n = strlen(text);
  return s.len == n && memcmp(s.ptr, text, n) == 0;
}

const char *gguf_path(const gguf_file *g) { return g->path; }
uint64_t gguf_kv_count(const gguf_file *g) { return g->n_kv; }
const gguf_kv *gguf_kv_at(const gguf_file *g, uint64_t i) { return i < g->n_kv ? &g->kv[i] : NULL; }

const gguf_kv *gguf_find(const gguf_file *g, const char *key) {
  for (uint64_t i = 0; i < g->n_kv; ++i)
    if (gguf_string_is(g->kv[i].key, key)) return &g->kv[i];
  return NULL;
}

bool gguf_has(const gguf_file *g, const char *key) { return gguf_find(g, key) != NULL; }

static uint64_t le(const uint8_t *p, unsigned bytes) {
  uint64_t v = 0;
  for (unsigned i = 0; i < bytes; ++i) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* An integer value of any width as int64/uint64; false for non-integer types. */
static bool integer_value(gguf_value_type t, const uint8_t *p, int64_t *s, uint64_t *u, bool *is_signed) {
  switch (t) {
    case GGUF_UINT8: case GGUF_UINT16: case GGUF_UINT32: case GGUF_UINT64: case GGUF_BOOL:
      *u = le(p, scalar_size(t));
      *is_signed = false;
      return true;
    case GGUF_INT8: *s = (int8_t)le(p, 1); break;
    case GGUF_INT16: *s = (int16_t)le(p, 2); break;
    case GGUF_INT32: *s = (int32_t)le(p, 4); break;
    case GGUF_INT64: *s = (int64_t)le(p, 8); break;
    default: return false;
  }
  *is_signed = true;
  return true;
}

bool gguf_get_u64(const gguf_file *g, const char *key, uint64_t *out) {
  const gguf_kv *kv = gguf_find(g, key);
  if (!kv) return false;
  int64_t s = 0;
  uint64_t u = 0;
  bool is_signed;
  if (!integer_value(kv->type, kv->value, &s, &u, &is_signed))
    return fail("%s: metadata %s is not an integer (type %u)", g->path, key, (unsigned)kv->type);
  if (is_signed) {
    if (s < 0) return fail("%s: metadata %s is negative (%lld)", g->path, key, (long long)s);
    u = (uint64_t)s;
  }
  *out = u;
  return true;
}

bool gguf_get_u32(const gguf_file *g, const char *key, uint32_t *out) {
  uint64_t v;
  if (!gguf_get_u64(g, key, &v)) return false;
  if (v > UINT32_MAX) return fail("%s: metadata %s = %llu does not fit 32 bits", g->path, key,
                                  (unsigned long long)v);
  *out = (uint32_t)v;
  return true;
}

bool gguf_get_f32(const gguf_file *g, const char *key, float *out) {
  const gguf_kv *kv = gguf_find(g, key);
  if (!kv) return false;
  if (kv->type == GGUF_FLOAT32) {
    uint32_t bits = (uint32_t)le(kv->value, 4);
    memcpy(out, &bits, 4);
    return true;
  }
  if (kv->type == GGUF_FLOAT64) {
    uint64_t bits = le(kv->value, 8);
    double d;
    memcpy(&d, &bits, 8);
    *out = (float)d;
    return true;
  }
  return fail("%s: metadata %s is not a float (type %u)", g->path, key, (unsigned)kv->type);
}

bool gguf_get_bool(const gguf_file *g, const char *key, bool *out) {
  const gguf_kv *kv = gguf_find(g, key);
  if (!kv) return false;
  if (kv->type != GGUF_BOOL) return fail("%s: metadata %s is not a bool", g->path, key);
  *out = kv->value[0] != 0;
  return true;
}

bool gguf_get_string(const gguf_file *g, const char *key, gguf_string *out) {
  const gguf_kv *kv = gguf_find(g, key);
  if (!kv) return false;
  if (kv->type != GGUF_STRING) return fail("%s: metadata %s is not a string", g->path, key);
  out->len = le(kv->value, 8);
  out->ptr = (const char *)kv->value + 8;
  return true;
}

uint64_t gguf_array_length(const gguf_file *g, const char *key) {
  const gguf_kv *kv = gguf_find(g, key);
  return kv && kv->type == GGUF_ARRAY ? kv->array_count : 0;
}

static const gguf_kv *array_of(const gguf_file *g, const char *key, uint64_t count) {
  const gguf_kv *kv = gguf_find(g, key);
  if (!kv) {
    fail("%s: metadata %s is missing", g->path, key);
    return NULL;
  }
  if (kv->type != GGUF_ARRAY) {
    fail("%s: metadata %s is not an array", g->path, key);
    return NULL;
  }
  if (kv->array_count != count) {
    fail("%s: metadata %s has %llu elements, expected %llu", g->path, key,
         (unsigned long long)kv->array_count, (unsigned long long)count);
    return NULL;
  }
  return kv;
}

bool gguf_array_strings(const gguf_file *g, const char *key, gguf_string *out, uint64_t count) {
  const gguf_kv *kv = array_of(g, key, count);
  if (!kv) return false;
  if (kv->array_type != GGUF_STRING) return fail("%s: metadata %s is not an array of strings", g->path, key);
  /* The strings were bounds-checked when the file was opened. */
  const uint8_t *p = kv->value;
  for (uint64_t i = 0; i < count; ++i) {
    out[i].len = le(p, 8);
    out[i].ptr = (const char *)p + 8;
    p += 8 + out[i].len;
  }
  return true;
}

bool gguf_array_ints(const gguf_file *g, const char *key, int32_t *out, uint64_t count) {
  const gguf_kv *kv = array_of(g, key, count);
  if (!kv) return false;
  const unsigned es = scalar_size(kv->array_type);
  for (uint64_t i = 0; i < count; ++i) {
    int64_t s = 0;
    uint64_t u = 0;
    bool is_signed;
    if (!integer_value(kv->array_type, kv->value + i * es, &s, &u, &is_signed))
      return fail("%s: metadata %s is not an array of integers", g->path, key);
    const int64_t v = is_signed ? s : (int64_t)u;
    if (v < INT32_MIN || v > INT32_MAX || (!is_signed && u > INT32_MAX))
      return fail("%s: metadata %s[%llu] does not fit 32 bits", g->path, key, (unsigned long long)i);
    out[i] = (int32_t)v;
  }
  return true;
}

/* ---- tensors ------------------------------------------------------------------------ */

uint64_t gguf_tensor_count(const gguf_file *g) { return g->n_tensors; }
const gguf_tensor *gguf_tensor_at(const gguf_file *g, uint64_t i) {
  return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *g, const char *name) {
  for (uint64_t i = 0; i < g->n_tensors; ++i)
    if (gguf_string_is(g->tensors[i].name, name)) return &g->tensors[i];
  return NULL;
}

static float half_at(const uint8_t *p) { return f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

bool gguf_tensor_to_f32(const gguf_tensor *t, float *dst) {
  const uint8_t *p = t->data;
  const uint64_t n = t->n_elements;
  switch (t->type) {
    case GGML_TYPE_F32:
      memcpy(dst, p, n * 4);
      return true;
    case GGML_TYPE_F16:
      for (uint64_t i = 0; i < n; ++i) dst[i] = half_at(p + 2 * i);
      return true;
    case GGML_TYPE_BF16:
      for (uint64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
      return true;
    case GGML_TYPE_Q4_0: /* {f16 d; u8 qs[16]}: x[j] = (lo nibble - 8) d, x[j+16] = (hi - 8) d */
      for (uint64_t b = 0; b < n / 32; ++b, p += 18, dst += 32) {
        const float d = half_at(p);
        for (int j = 0; j < 16; ++j) {
          dst[j] = (float)((p[2 + j] & 0x0f) - 8) * d;
          dst[j + 16] = (float)((p[2 + j] >> 4) - 8) * d;
        }
      }
      return true;
    case GGML_TYPE_Q4_1: /* {f16 d, m; u8 qs[16]}: x = nibble * d + m */
      for (uint64_t b = 0; b < n / 32; ++b, p += 20, dst += 32) {
        const float d = half_at(p), m = half_at(p + 2);
        for (int j = 0; j < 16; ++j) {
          dst[j] = (float)(p[4 + j] & 0x0f) * d + m;
          dst[j + 16] = (float)(p[4 + j] >> 4) * d + m;
        }
      }
      return true;
    case GGML_TYPE_Q8_0: /* {f16 d; i8 qs[32]}: x = q * d */
      for (uint64_t b = 0; b < n / 32; ++b, p += 34, dst += 32) {
        const float d = half_at(p);
        for (int j = 0; j < 32; ++j) dst[j] = (float)(int8_t)p[2 + j] * d;
      }
      return true;
    default:
      return fail("tensor %.*s has element type %s, which the engine does not read (it reads "
                  "F32, F16, BF16, Q4_0, Q4_1 and Q8_0)",
                  (int)t->name.len, t->name.ptr, gguf_type_name(t->type));
  }
}

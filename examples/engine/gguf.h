/*
 * gguf.h — a reader of GGUF files (llama.cpp's model format, versions 2 and 3).
 *
 * A GGUF file is: the magic "GGUF", a version, a count of tensors and of metadata
 * key/value pairs; the pairs (typed values, arrays included); one descriptor per tensor
 * (name, shape innermost dimension first, element type, offset); then, aligned to
 * `general.alignment` (32 by default), the tensor data. The file is mapped read-only, every
 * length and offset is checked against its size when it is opened, and strings point into
 * the mapping (they are not NUL-terminated: use the length).
 *
 * Tensor data is converted to float32 by gguf_tensor_to_f32 for the element types the
 * engine supports: F32, F16, BF16 and the blocks Q4_0, Q4_1, Q8_0 (32 elements each).
 * Other types are refused with a message that names the type.
 */
#ifndef ENGINE_GGUF_H
#define ENGINE_GGUF_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Metadata value types, as the format numbers them. */
typedef enum gguf_value_type {
  GGUF_UINT8 = 0, GGUF_INT8 = 1, GGUF_UINT16 = 2, GGUF_INT16 = 3, GGUF_UINT32 = 4,
  GGUF_INT32 = 5, GGUF_FLOAT32 = 6, GGUF_BOOL = 7, GGUF_STRING = 8, GGUF_ARRAY = 9,
  GGUF_UINT64 = 10, GGUF_INT64 = 11, GGUF_FLOAT64 = 12
} gguf_value_type;

/* Tensor element types the engine reads (ggml's numbering; others exist). */
enum {
  GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3,
  GGML_TYPE_Q8_0 = 8, GGML_TYPE_BF16 = 30
};

typedef struct gguf_string {
  const char *ptr; /* into the mapping, not NUL-terminated */
  uint64_t len;
} gguf_string;

typedef struct gguf_kv {
  gguf_string key;
  gguf_value_type type;
  gguf_value_type array_type; /* element type when type == GGUF_ARRAY */
  uint64_t array_count;       /* element count when type == GGUF_ARRAY */
  const uint8_t *value;       /* the encoded value (for arrays: the first element) */
} gguf_kv;

typedef struct gguf_tensor {
  gguf_string name;
  uint32_t n_dims;
  uint64_t dims[4]; /* innermost first: a [rows, cols] row-major matrix has dims {cols, rows} */
  uint32_t type;    /* GGML_TYPE_* */
  uint64_t n_elements;
  uint64_t n_bytes;
  const uint8_t *data; /* into the mapping */
} gguf_tensor;

typedef struct gguf_file gguf_file;

/* Maps and parses `path`. NULL with a message on failure (missing file, not GGUF, an
   unsupported version, a truncated or inconsistent header). */
gguf_file *gguf_open(const char *path);
void gguf_close(gguf_file *g);

const char *gguf_path(const gguf_file *g);
uint64_t gguf_kv_count(const gguf_file *g);
const gguf_kv *gguf_kv_at(const gguf_file *g, uint64_t i);
/* The pair with this key, or NULL. */
const gguf_kv *gguf_find(const gguf_file *g, const char *key);

/* Typed getters. Absent keys leave *out untouched and return false without a message
   (so callers apply their defaults); a key present with a wrong type returns false with
   a message. Integers of any width and sign convert when the value fits. */
bool gguf_get_u64(const gguf_file *g, const char *key, uint64_t *out);
bool gguf_get_u32(const gguf_file *g, const char *key, uint32_t *out);
bool gguf_get_f32(const gguf_file *g, const char *key, float *out);
bool gguf_get_bool(const gguf_file *g, const char *key, bool *out);
bool gguf_get_string(const gguf_file *g, const char *key, gguf_string *out);
/* true when the key exists (whatever its type). */
bool gguf_has(const gguf_file *g, const char *key);

/* Array access: the strings of a string array (filled into out[count]), or the integers
   of an integer array. False with a message when the key is absent, has another type,
   or holds a different number of elements than `count`. */
bool gguf_array_strings(const gguf_file *g, const char *key, gguf_string *out, uint64_t count);
bool gguf_array_ints(const gguf_file *g, const char *key, int32_t *out, uint64_t count);
/* Elements in the array `key` (0 when absent or not an array). */
uint64_t gguf_array_length(const gguf_file *g, const char *key);

uint64_t gguf_tensor_count(const gguf_file *g);
const gguf_tensor *gguf_tensor_at(const gguf_file *g, uint64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *g, const char *name);

/* "F16", "Q4_K", ... for any ggml type number ("type 123" for unknown ones; static). */
const char *gguf_type_name(uint32_t type);
/* true for the element types gguf_tensor_to_f32 converts. */
bool gguf_type_supported(uint32_t type);

/* Converts every element of `t` to float32 in dst[t->n_elements], in file order. False
   with a message naming the tensor and its type when the type is not supported. */
bool gguf_tensor_to_f32(const gguf_tensor *t, float *dst);

/* true when s equals the NUL-terminated text. */
bool gguf_string_is(gguf_string s, const char *text);

#ifdef __cplusplus
}
#endif

#endif /* ENGINE_GGUF_H */

/* model.c — see model.h. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* ---- hyperparameters ---------------------------------------------------------------- */

static bool required_u32(const gguf_file *g, const char *key, uint32_t *out) {
  if (gguf_get_u32(g, key, out)) return true;
  if (gguf_has(g, key)) return false; /* present with a bad type: the message says so */
  return fail("%s: metadata %s is missing", gguf_path(g), key);
}

bool model_config_from_gguf(const gguf_file *g, model_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  gguf_string arch = {"", 0}, name = {"", 0}, scaling = {"none", 4};
  if (!gguf_get_string(g, "general.architecture", &arch))
    return fail("%s: general.architecture is missing", gguf_path(g));
  if (!gguf_string_is(arch, "llama"))
    return fail("%s: architecture \"%.*s\" is not supported (the engine runs \"llama\": "
                "LLaMA, Mistral, SmolLM)", gguf_path(g), (int)arch.len, arch.ptr);
  if (gguf_get_string(g, "general.name", &name))
    snprintf(cfg->name, sizeof cfg->name, "%.*s", (int)name.len, name.ptr);
  else
    snprintf(cfg->name, sizeof cfg->name, "llama");
  if (!required_u32(g, "llama.block_count", &cfg->n_layers) ||
      !required_u32(g, "llama.embedding_length", &cfg->n_embd) ||
      !required_u32(g, "llama.feed_forward_length", &cfg->n_ff) ||
      !required_u32(g, "llama.attention.head_count", &cfg->n_heads))
    return false;
  cfg->n_kv_heads = cfg->n_heads;
  if (!gguf_get_u32(g, "llama.attention.head_count_kv", &cfg->n_kv_heads) &&
      gguf_has(g, "llama.attention.head_count_kv"))
    return false;
  if (cfg->n_heads == 0 || cfg->n_kv_heads == 0 || cfg->n_heads % cfg->n_kv_heads)
    return fail("%s: %u query heads are not a multiple of %u KV heads", gguf_path(g),
                cfg->n_heads, cfg->n_kv_heads);
  cfg->head_dim = cfg->n_embd / cfg->n_heads;
  gguf_get_u32(g, "llama.attention.key_length", &cfg->head_dim);
  uint32_t value_length = cfg->head_dim, rope_dims = cfg->head_dim;
  gguf_get_u32(g, "llama.attention.value_length", &value_length);
  gguf_get_u32(g, "llama.rope.dimension_count", &rope_dims);
  if (value_length != cfg->head_dim || rope_dims != cfg->head_dim || cfg->head_dim % 2)
    return fail("%s: key length %u, value length %u and rotary dimensions %u must be one "
                "even head size", gguf_path(g), cfg->head_dim, value_length, rope_dims);
  cfg->n_vocab = (uint32_t)gguf_array_length(g, "tokenizer.ggml.tokens");
  gguf_get_u32(g, "llama.vocab_size", &cfg->n_vocab);
  const gguf_tensor *embd = gguf_find_tensor(g, "token_embd.weight");
  if (!embd || embd->n_dims != 2)
    return fail("%s: token_embd.weight is missing or not a matrix", gguf_path(g));
  if (cfg->n_vocab == 0) cfg->n_vocab = (uint32_t)embd->dims[1];
  cfg->context_length = 4096;
  gguf_get_u32(g, "llama.context_length", &cfg->context_length);
  cfg->rms_eps = 1e-5f;
  gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &cfg->rms_eps);
  cfg->rope_theta = 10000.0f;
  gguf_get_f32(g, "llama.rope.freq_base", &cfg->rope_theta);
  cfg->rope_linear_factor = 1.0f;
  gguf_get_string(g, "llama.rope.scaling.type", &scaling);
  if (gguf_string_is(scaling, "linear")) {
    if (!gguf_get_f32(g, "llama.rope.scaling.factor", &cfg->rope_linear_factor) ||
        !(cfg->rope_linear_factor > 0))
      return fail("%s: linear rope scaling without a positive llama.rope.scaling.factor",
                  gguf_path(g));
  } else if (!gguf_string_is(scaling, "none")) {
    return fail("%s: rope scaling \"%.*s\" is not supported (none, linear and rope_freqs are)",
                gguf_path(g), (int)scaling.len, scaling.ptr);
  }
  cfg->has_rope_freqs = gguf_find_tensor(g, "rope_freqs.weight") != NULL;
  cfg->tied_embeddings = gguf_find_tensor(g, "output.weight") == NULL;
  return model_check_tensors(g, cfg);
}

static const model_config PRESETS[] = {
  {"llama2-7b (random weights)", 32, 4096, 32, 32, 128, 11008, 32000, 4096, 1e-5f, 10000.0f, 1.0f, false, false},
  {"llama3-8b (random weights)", 32, 4096, 32, 8, 128, 14336, 128256, 8192, 1e-5f, 500000.0f, 1.0f, false, false},
  {"tiny (random weights)", 2, 256, 8, 2, 32, 512, 1000, 4096, 1e-5f, 10000.0f, 1.0f, false, true},
};
static const char *const PRESET_KEYS[] = {"llama2-7b", "llama3-8b", "tiny"};

bool model_config_preset(const char *name, model_config *cfg) {
  for (size_t i = 0; i < sizeof PRESETS / sizeof PRESETS[0]; ++i)
    if (strcmp(name, PRESET_KEYS[i]) == 0) {
      *cfg = PRESETS[i];
      return true;
    }
  return fail("no model shape called \"%s\" (known: %s)", name, model_preset_names());
}

const char *model_preset_names(void) { return "llama2-7b, llama3-8b, tiny"; }

/* ---- tensors ------------------------------------------------------------------------ */

const char *model_layer_tensor(uint32_t layer, const char *what, char *buf, uint64_t size) {
  snprintf(buf, (size_t)size, "blk.%u.%s.weight", layer, what);
  return buf;
}

/* The [rows, cols] shape the config implies for a tensor name; false for a name that is
   not part of the model. */
static bool expected_shape(const model_config *c, const char *name, uint64_t *rows, uint64_t *cols) {
  const uint64_t d = c->n_embd, q = (uint64_t)c->n_heads * c->head_dim,
                 kv = (uint64_t)c->n_kv_heads * c->head_dim;
  struct { const char *what; uint64_t rows, cols; } layer[] = {
    {"attn_norm", 1, d}, {"attn_q", q, d},  {"attn_k", kv, d},     {"attn_v", kv, d},
    {"attn_output", d, q}, {"ffn_norm", 1, d}, {"ffn_gate", c->n_ff, d}, {"ffn_up", c->n_ff, d},
    {"ffn_down", d, c->n_ff},
  };
  *rows = 1;
  if (strcmp(name, "token_embd.weight") == 0 || strcmp(name, "output.weight") == 0) {
    *rows = c->n_vocab;
    *cols = d;
    return true;
  }
  if (strcmp(name, "output_norm.weight") == 0) {
    *cols = d;
    return true;
  }
  if (strcmp(name, "rope_freqs.weight") == 0) {
    *cols = c->head_dim / 2;
    return true;
  }
  unsigned blk;
  int consumed = 0;
  if (sscanf(name, "blk.%u.%n", &blk, &consumed) != 1 || consumed == 0 || blk >= c->n_layers)
    return false;
  for (size_t i = 0; i < sizeof layer / sizeof layer[0]; ++i) {
    char full[96];
    if (strcmp(name, model_layer_tensor(blk, layer[i].what, full, sizeof full)) == 0) {
      *rows = layer[i].rows;
      *cols = layer[i].cols;
      return true;
    }
  }
  return false;
}

bool model_check_tensors(const gguf_file *g, const model_config *cfg) {
  uint64_t found = 0;
  for (uint64_t i = 0; i < gguf_tensor_count(g); ++i) {
    const gguf_tensor *t = gguf_tensor_at(g, i);
    char name[128];
    snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
    uint64_t rows, cols;
    if (!expected_shape(cfg, name, &rows, &cols))
      return fail("%s: tensor %s is not part of a LLaMA model the engine runs (biases and "
                  "other extras are not supported)", gguf_path(g), name);
    if (t->n_elements != rows * cols || t->dims[0] != cols)
      return fail("%s: tensor %s has shape [%llu, %llu], the metadata implies [%llu, %llu]",
                  gguf_path(g), name, (unsigned long long)(t->n_elements / t->dims[0]),
                  (unsigned long long)t->dims[0], (unsigned long long)rows,
                  (unsigned long long)cols);
    if (!gguf_type_supported(t->type))
      return fail("%s: tensor %s has element type %s; the engine reads F32, F16, BF16, Q4_0, "
                  "Q4_1 and Q8_0 (re-quantize the model to one of those)",
                  gguf_path(g), name, gguf_type_name(t->type));
    ++found;
  }
  const uint64_t needed = 2 + (cfg->tied_embeddings ? 0 : 1) + (cfg->has_rope_freqs ? 1 : 0) +
                          9ull * cfg->n_layers;
  if (found != needed)
    return fail("%s: %llu tensors, a %u-layer model has %llu (some are missing)", gguf_path(g),
                (unsigned long long)found, cfg->n_layers, (unsigned long long)needed);
  return true;
}

static uint64_t hash_name(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; ++s) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

bool model_read_tensor(const model_source *src, const char *name, uint64_t rows, uint64_t cols,
                       float *dst) {
  if (!src->gguf) {
    const size_t len = strlen(name);
    const bool norm = len >= 11 && strcmp(name + len - 11, "norm.weight") == 0;
    rng64 r;
    rng_seed(&r, src->seed ^ hash_name(name));
    const double scale = sqrt(3.0 / (double)cols); /* uniform(-a, a) has variance a^2 / 3 */
    for (uint64_t i = 0; i < rows * cols; ++i)
      dst[i] = norm ? 1.0f : (float)((2.0 * rng_uniform(&r) - 1.0) * scale);
    return true;
  }
  const gguf_tensor *t = gguf_find_tensor(src->gguf, name);
  if (!t) return fail("%s: tensor %s is missing", gguf_path(src->gguf), name);
  if (t->n_elements != rows * cols)
    return fail("%s: tensor %s has %llu elements, expected %llu", gguf_path(src->gguf), name,
                (unsigned long long)t->n_elements, (unsigned long long)(rows * cols));
  return gguf_tensor_to_f32(t, dst);
}

bool model_rope_frequencies(const model_source *src, const model_config *cfg, double *inv_freq) {
  const uint32_t pairs = cfg->head_dim / 2;
  float *factors = NULL;
  if (cfg->has_rope_freqs) {
    factors = alloc_zeroed(pairs, sizeof *factors, "rope frequency factors");
    if (!factors || !model_read_tensor(src, "rope_freqs.weight", 1, pairs, factors)) {
      free(factors);
      return false;
    }
  }
  for (uint32_t i = 0; i < pairs; ++i) {
    double f = pow((double)cfg->rope_theta, -2.0 * i / (double)cfg->head_dim);
    f /= (double)cfg->rope_linear_factor;
    if (factors) f /= (double)factors[i];
    inv_freq[i] = f;
  }
  free(factors);
  return true;
}

uint64_t model_layer_params(const model_config *c) {
  const uint64_t d = c->n_embd, q = (uint64_t)c->n_heads * c->head_dim,
                 kv = (uint64_t)c->n_kv_heads * c->head_dim;
  return 2 * d + d * q * 2 + 2 * d * kv + 3 * d * c->n_ff;
}

uint64_t model_params(const model_config *c) {
  const uint64_t embed = (uint64_t)c->n_vocab * c->n_embd;
  return embed * (c->tied_embeddings ? 1 : 2) + c->n_embd + c->n_layers * model_layer_params(c);
}

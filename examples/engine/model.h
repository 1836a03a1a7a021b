/*
 * model.h — a LLaMA-family decoder: its hyperparameters, where its weights come from, and
 * the pieces of arithmetic both backends share (RoPE frequencies, weight sizes).
 *
 * The model (LLaMA 1/2/3, Mistral, SmolLM, ...; GGUF architecture "llama"):
 *   x = embed[token]
 *   per layer:  h = x + Wo · attention(rope(Wq · rms(x)), rope(Wk · rms(x)), Wv · rms(x))
 *               x = h + Wdown · (silu(Wgate · rms(h)) * (Wup · rms(h)))
 *   logits = Wout · rms(x)          (Wout = embed when the file has no output.weight)
 * with rms(x) = x / sqrt(mean(x^2) + eps) * w (a weight per norm), grouped-query attention
 * (query head h reads KV head h / (n_heads / n_kv_heads)), and rotary embeddings on
 * interleaved pairs (x[2i], x[2i+1]) of each head at angle pos * theta^(-2i/head_dim):
 * llama.cpp's converter stores the Q and K rows in that pair order, and since Q and K of a
 * head are permuted alike their dot products — all attention sees — are unchanged.
 * Rope scaling: "linear" divides positions by the factor; a rope_freqs.weight tensor
 * (LLaMA-3.1's frequency scaling, precomputed by the converter) divides each pair's
 * frequency by its entry. YaRN is refused.
 *
 * Weights come from a GGUF file (dequantized to float32 as they are read) or are random,
 * for speed measurements of a shape without its weights ("llama2-7b", "llama3-8b" presets).
 */
#ifndef ENGINE_MODEL_H
#define ENGINE_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct model_config {
  char name[96];
  uint32_t n_layers, n_embd, n_heads, n_kv_heads, head_dim, n_ff, n_vocab;
  uint32_t context_length; /* the training context from the metadata (information only) */
  float rms_eps;
  float rope_theta;
  float rope_linear_factor; /* 1 = no linear scaling */
  bool has_rope_freqs;      /* rope_freqs.weight divides each pair's frequency */
  bool tied_embeddings;     /* no output.weight: the embedding is the output matrix */
} model_config;

/* Where weights come from: a GGUF file, or random values from `seed` (gguf == NULL). */
typedef struct model_source {
  gguf_file *gguf;
  uint64_t seed;
} model_source;

/* The hyperparameters in a GGUF file's metadata. False with a message for another
   architecture, missing keys, shapes that do not fit, or YaRN rope scaling. */
bool model_config_from_gguf(const gguf_file *g, model_config *cfg);

/* A random-weight model of a known shape: "llama2-7b" (32 layers, 4096, MHA 32 heads,
   FFN 11008, vocab 32000), "llama3-8b" (32 layers, 4096, GQA 32/8, FFN 14336, vocab 128256,
   theta 500000), "tiny" (a 2-layer GQA model small enough for CI). False for other names. */
bool model_config_preset(const char *name, model_config *cfg);
/* The preset names, for messages: "llama2-7b, llama3-8b, tiny". */
const char *model_preset_names(void);

/* Checks that every tensor of the file belongs to the model and has the shape the config
   implies, and that each element type is one the engine reads (the message names the
   first that is not). */
bool model_check_tensors(const gguf_file *g, const model_config *cfg);

/* The name of layer `layer`'s tensor `what` ("attn_q", "ffn_down", ...): "blk.3.attn_q.weight". */
const char *model_layer_tensor(uint32_t layer, const char *what, char *buf, uint64_t size);

/* Reads tensor `name`, a [rows, cols] row-major matrix (rows = 1 for vectors), as
   float32 into dst[rows * cols]. Random sources give uniform values of variance 1/cols
   (so a product keeps the scale of its input), 1 for norm weights. */
bool model_read_tensor(const model_source *src, const char *name, uint64_t rows, uint64_t cols,
                       float *dst);

/* The inverse frequency of each rotary pair: inv_freq[i] = theta^(-2i/head_dim) /
   (linear factor * rope_freqs[i]), for i < head_dim / 2 (double: long contexts need the
   angle's precision). */
bool model_rope_frequencies(const model_source *src, const model_config *cfg, double *inv_freq);

/* Parameters (elements) of the whole model, of one layer, and of the embedding. */
uint64_t model_layer_params(const model_config *cfg);
uint64_t model_params(const model_config *cfg);

#ifdef __cplusplus
}
#endif

#endif /* ENGINE_MODEL_H */

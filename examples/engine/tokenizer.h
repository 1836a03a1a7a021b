/*
 * tokenizer.h — the byte-level BPE tokenizer of a GGUF model (tokenizer.ggml.model "gpt2",
 * the kind SmolLM2, LLaMA-3, Qwen2 and GPT-2 use), read from the file's metadata.
 *
 * Encoding, as Hugging Face `tokenizers` does it:
 *   1. special tokens (GGUF token types control and user-defined) are cut out of the text
 *      wherever they occur, longest match first, and become their ids;
 *   2. the rest is split into pieces by the model's pre-tokenizer (tokenizer.ggml.pre):
 *      GPT-2's regular expression ("gpt2", "default"), the same after isolating every
 *      digit ("smollm", "starcoder", "refact"), or LLaMA-3's expression ("llama-bpe",
 *      "llama3");
 *   3. each piece's bytes are mapped to GPT-2's printable byte alphabet and merged pairwise
 *      in merge-rank order (lowest first, leftmost among equal ranks); LLaMA-3 takes a
 *      piece that is a whole vocabulary entry as it is (ignore_merges).
 * A BOS token is prepended when tokenizer.ggml.add_bos_token says so. Decoding maps the
 * alphabet back to bytes; special tokens decode to their text.
 */
#ifndef ENGINE_TOKENIZER_H
#define ENGINE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tokenizer tokenizer;

/* Reads the vocabulary, merges and special tokens from `g` (which may be closed after).
   NULL with a message for an unsupported tokenizer model or pre-tokenizer, or an
   inconsistent vocabulary (a merge of tokens that are not in it, a missing byte token). */
tokenizer *tokenizer_load(const gguf_file *g);
void tokenizer_free(tokenizer *t);

uint32_t tokenizer_vocab_size(const tokenizer *t);
int32_t tokenizer_bos(const tokenizer *t); /* -1 when the model has none */
bool tokenizer_adds_bos(const tokenizer *t);
/* true for the end-of-sequence and end-of-turn tokens (generation stops there). */
bool tokenizer_is_end(const tokenizer *t, int32_t id);

/* Encodes text[len] into a new array *ids (caller frees) of *count ids, with the BOS
   token first when add_bos. False with a message only when out of memory. */
bool tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_bos,
                      int32_t **ids, size_t *count);

/* The bytes token `id` stands for (not NUL-terminated; an empty string for a bad id),
   written into buf[size]; returns the byte count (truncated to size). */
size_t tokenizer_decode(const tokenizer *t, int32_t id, char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif /* ENGINE_TOKENIZER_H */

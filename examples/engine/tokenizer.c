/* tokenizer.c — see tokenizer.h. */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "unicode_tables.h"
#include "util.h"

/* GGUF token types (llama.cpp's numbering). */
enum { TOKEN_NORMAL = 1, TOKEN_CONTROL = 3, TOKEN_USER_DEFINED = 4 };

typedef enum pre_tokenizer { PRE_GPT2, PRE_GPT2_DIGITS, PRE_LLAMA3 } pre_tokenizer;

struct tokenizer {
  uint32_t n_vocab;
  char *text;        /* every token's string, back to back */
  uint32_t *offset;  /* token i is text[offset[i], offset[i+1]) */
  uint8_t *type;
  /* vocabulary: string -> id, open addressing, -1 = empty */
  int32_t *vocab_slot;
  uint32_t vocab_mask;
  /* merges: (left id, right id) -> rank and merged id, open addressing, key 0 = empty */
  uint64_t *merge_key;
  int32_t *merge_rank, *merge_id;
  uint32_t merge_mask;
  int32_t byte_token[256];   /* the one-character token of each byte, -1 = none */
  uint32_t byte_char[256];   /* GPT-2's printable alphabet: byte -> code point */
  int16_t char_byte[512];    /* and back (code points < 512), -1 = none */
  int32_t *special;          /* control and user-defined ids, longest text first */
  uint32_t n_special;
  bool special_starts[256];  /* first bytes of the special tokens' texts */
  pre_tokenizer pre;
  bool ignore_merges, add_bos;
  int32_t bos, eos, eot;
};

/* ---- Unicode ------------------------------------------------------------------------ */

static bool in_ranges(const uint32_t (*r)[2], size_t n, uint32_t cp) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (cp < r[mid][0]) hi = mid;
    else if (cp > r[mid][1]) lo = mid + 1;
    else return true;
  }
  return false;
}

static bool is_letter(uint32_t cp) {
  return in_ranges(UNICODE_LETTERS, sizeof UNICODE_LETTERS / sizeof UNICODE_LETTERS[0], cp);
}
static bool is_number(uint32_t cp) {
  return in_ranges(UNICODE_NUMBERS, sizeof UNICODE_NUMBERS / sizeof UNICODE_NUMBERS[0], cp);
}
/* \s of the pre-tokenizers' regular expressions: Unicode White_Space. */
static bool is_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202f || cp == 0x205f || cp == 0x3000;
}
static bool is_other(uint32_t cp) { return !is_space(cp) && !is_letter(cp) && !is_number(cp); }
static bool is_newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }

/* Decodes one UTF-8 character of s[0, n) (n >= 1) into *cp; returns its length. A byte
   that does not start a valid sequence is one character of its own (code point 0xfffd),
   so every byte of the text still reaches the byte-level alphabet. */
static size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
  const unsigned c = s[0];
  size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (len == 1) {
    *cp = c;
    return 1;
  }
  if (len == 0 || len > n) {
    *cp = 0xfffd;
    return 1;
  }
  uint32_t v = c & (0x7fu >> len);
  for (size_t i = 1; i < len; ++i) {
    if ((s[i] & 0xc0) != 0x80) {
      *cp = 0xfffd;
      return 1;
    }
    v = v << 6 | (s[i] & 0x3fu);
  }
  *cp = v;
  return len;
}

static size_t utf8_encode(uint32_t cp, char *out) {
  if (cp < 0x80) {
    out[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    out[0] = (char)(0xc0 | cp >> 6);
    out[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = (char)(0xe0 | cp >> 12);
    out[1] = (char)(0x80 | (cp >> 6 & 0x3f));
    out[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  out[0] = (char)(0xf0 | cp >> 18);
  out[1] = (char)(0x80 | (cp >> 12 & 0x3f));
  out[2] = (char)(0x80 | (cp >> 6 & 0x3f));
  out[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

/* ---- hash tables -------------------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
  for (size_t i = 0; i < n; ++i) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
  return h;
}

static uint64_t hash_u64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static uint32_t table_size(uint64_t n) { /* a power of two at least twice n */
  uint32_t s = 16;
  while (s < 2 * n) s *= 2;
  return s;
}

static int32_t vocab_lookup(const tokenizer *t, const char *s, size_t n) {
  for (uint32_t i = (uint32_t)hash_bytes(s, n) & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
    const int32_t id = t->vocab_slot[i];
    if (id < 0) return -1;
    if (t->offset[id + 1] - t->offset[id] == n && memcmp(t->text + t->offset[id], s, n) == 0)
      return id;
  }
}

static uint64_t pair_key(int32_t a, int32_t b) {
  return ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1; /* +1: 0 marks an empty slot */
}

/* Rank of merging (a, b), or -1; *merged receives the result's id. */
static int32_t merge_lookup(const tokenizer *t, int32_t a, int32_t b, int32_t *merged) {
  const uint64_t key = pair_key(a, b);
  for (uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
    if (t->merge_key[i] == 0) return -1;
    if (t->merge_key[i] == key) {
      *merged = t->merge_id[i];
      return t->merge_rank[i];
    }
  }
}

/* ---- loading ------------------------------------------------------------------------ */

void tokenizer_free(tokenizer *t) {
  if (!t) return;
  free(t->text);
  free(t->offset);
  free(t->type);
  free(t->vocab_slot);
  free(t->merge_key);
  free(t->merge_rank);
  free(t->merge_id);
  free(t->special);
  free(t);
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68
   bytes take the code points from 256 on, in byte order. */
static void byte_alphabet(tokenizer *t) {
  uint32_t next = 256;
  for (int i = 0; i < 512; ++i) t->char_byte[i] = -1;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
    t->byte_char[b] = printable ? b : next++;
    t->char_byte[t->byte_char[b]] = (int16_t)b;
  }
}

static bool pick_pre_tokenizer(tokenizer *t, const gguf_file *g, gguf_string pre) {
  static const char *const gpt2[] = {"default", "gpt2", "gpt-2"};
  static const char *const digits[] = {"smollm", "starcoder", "refact"};
  static const char *const llama3[] = {"llama-bpe", "llama3", "llama-v3"};
  for (size_t i = 0; i < 3; ++i) {
    if (gguf_string_is(pre, gpt2[i])) t->pre = PRE_GPT2;
    else if (gguf_string_is(pre, digits[i])) t->pre = PRE_GPT2_DIGITS;
    else if (gguf_string_is(pre, llama3[i])) t->pre = PRE_LLAMA3;
    else continue;
    t->ignore_merges = t->pre == PRE_LLAMA3;
    return true;
  }
  return fail("%s: pre-tokenizer \"%.*s\" (tokenizer.ggml.pre) is not supported; the engine "
              "knows gpt2/default, smollm/starcoder/refact and llama-bpe",
              gguf_path(g), (int)pre.len, pre.ptr);
}

static const tokenizer *sort_ctx; /* qsort has no context argument in C11 */
static int longer_first(const void *a, const void *b) {
  const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  const uint32_t lx = sort_ctx->offset[x + 1] - sort_ctx->offset[x];
  const uint32_t ly = sort_ctx->offset[y + 1] - sort_ctx->offset[y];
  return lx != ly ? (lx > ly ? -1 : 1) : (x > y) - (x < y);
}

static bool load_vocabulary(tokenizer *t, const gguf_file *g) {
  const uint64_t n = gguf_array_length(g, "tokenizer.ggml.tokens");
  if (n == 0 || n > INT32_MAX) return fail("%s: tokenizer.ggml.tokens is missing or empty", gguf_path(g));
  t->n_vocab = (uint32_t)n;
  gguf_string *tok = alloc_zeroed(n, sizeof *tok, "token list");
  int32_t *types = alloc_zeroed(n, sizeof *types, "token types");
  t->offset = alloc_zeroed(n + 1, sizeof *t->offset, "token offsets");
  t->type = alloc_zeroed(n, 1, "token types");
  bool ok = tok && types && t->offset && t->type &&
            gguf_array_strings(g, "tokenizer.ggml.tokens", tok, n);
  if (ok && gguf_has(g, "tokenizer.ggml.token_type"))
    ok = gguf_array_ints(g, "tokenizer.ggml.token_type", types, n);
  else
    for (uint64_t i = 0; ok && i < n; ++i) types[i] = TOKEN_NORMAL;
  uint64_t bytes = 0;
  for (uint64_t i = 0; ok && i < n; ++i) bytes += tok[i].len;
  if (ok && bytes > UINT32_MAX) ok = fail("%s: the vocabulary holds too much text", gguf_path(g));
  if (ok) t->text = alloc_zeroed(bytes ? bytes : 1, 1, "token text");
  ok = ok && t->text;
  for (uint64_t i = 0, at = 0; ok && i < n; ++i) {
    memcpy(t->text + at, tok[i].ptr, tok[i].len);
    t->offset[i] = (uint32_t)at;
    at += tok[i].len;
    t->offset[i + 1] = (uint32_t)at;
    t->type[i] = (uint8_t)types[i];
  }
  free(tok);
  free(types);
  if (!ok) return false;

  t->vocab_mask = table_size(n) - 1;
  t->vocab_slot = alloc_zeroed((size_t)t->vocab_mask + 1, sizeof *t->vocab_slot, "vocabulary table");
  if (!t->vocab_slot) return false;
  memset(t->vocab_slot, 0xff, ((size_t)t->vocab_mask + 1) * sizeof *t->vocab_slot);
  for (uint32_t id = 0; id < n; ++id) {
    const char *s = t->text + t->offset[id];
    const size_t len = t->offset[id + 1] - t->offset[id];
    if (vocab_lookup(t, s, len) >= 0) continue; /* a duplicate string: the first id wins */
    uint32_t i = (uint32_t)hash_bytes(s, len) & t->vocab_mask;
    while (t->vocab_slot[i] >= 0) i = (i + 1) & t->vocab_mask;
    t->vocab_slot[i] = (int32_t)id;
  }

  for (uint32_t id = 0; id < n; ++id)
    if (t->type[id] == TOKEN_CONTROL || t->type[id] == TOKEN_USER_DEFINED) ++t->n_special;
  t->special = alloc_zeroed(t->n_special, sizeof *t->special, "special tokens");
  if (!t->special) return false;
  uint32_t k = 0;
  for (uint32_t id = 0; id < n; ++id)
    if ((t->type[id] == TOKEN_CONTROL || t->type[id] == TOKEN_USER_DEFINED) &&
        t->offset[id + 1] > t->offset[id])
      t->special[k++] = (int32_t)id;
  t->n_special = k;
  for (uint32_t i = 0; i < k; ++i) t->special_starts[(unsigned char)t->text[t->offset[t->special[i]]]] = true;
  sort_ctx = t;
  qsort(t->special, k, sizeof *t->special, longer_first);
  return true;
}

static bool load_merges(tokenizer *t, const gguf_file *g) {
  const uint64_t n = gguf_array_length(g, "tokenizer.ggml.merges");
  if (n == 0) return fail("%s: tokenizer.ggml.merges is missing (a BPE model needs merges)", gguf_path(g));
  gguf_string *m = alloc_zeroed(n, sizeof *m, "merge list");
  if (!m || !gguf_array_strings(g, "tokenizer.ggml.merges", m, n)) {
    free(m);
    return false;
  }
  t->merge_mask = table_size(n) - 1;
  const size_t slots = (size_t)t->merge_mask + 1;
  t->merge_key = alloc_zeroed(slots, sizeof *t->merge_key, "merge table");
  t->merge_rank = alloc_zeroed(slots, sizeof *t->merge_rank, "merge table");
  t->merge_id = alloc_zeroed(slots, sizeof *t->merge_id, "merge table");
  bool ok = t->merge_key && t->merge_rank && t->merge_id;
  char joined[1024];
  for (uint64_t r = 0; ok && r < n; ++r) {
    const char *space = memchr(m[r].ptr, ' ', m[r].len);
    const size_t la = space ? (size_t)(space - m[r].ptr) : 0, lb = space ? m[r].len - la - 1 : 0;
    const int32_t a = space ? vocab_lookup(t, m[r].ptr, la) : -1;
    const int32_t b = space ? vocab_lookup(t, space + 1, lb) : -1;
    int32_t c = -1;
    if (a >= 0 && b >= 0 && la + lb <= sizeof joined) {
      memcpy(joined, m[r].ptr, la);
      memcpy(joined + la, space + 1, lb);
      c = vocab_lookup(t, joined, la + lb);
    }
    if (c < 0) {
      ok = fail("%s: merge %llu (\"%.*s\") joins strings that are not in the vocabulary",
                gguf_path(g), (unsigned long long)r, (int)m[r].len, m[r].ptr);
      break;
    }
    const uint64_t key = pair_key(a, b);
    uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
    while (t->merge_key[i] != 0 && t->merge_key[i] != key) i = (i + 1) & t->merge_mask;
    if (t->merge_key[i] == key) continue; /* a repeated merge keeps its first (best) rank */
    t->merge_key[i] = key;
    t->merge_rank[i] = (int32_t)r;
    t->merge_id[i] = c;
  }
  free(m);
  return ok;
}

static int32_t token_id_or(const gguf_file *g, const char *key, uint32_t n_vocab) {
  uint32_t id;
  return gguf_get_u32(g, key, &id) && id < n_vocab ? (int32_t)id : -1;
}

tokenizer *tokenizer_load(const gguf_file *g) {
  gguf_string model = {"", 0}, pre = {"default", 7};
  if (!gguf_get_string(g, "tokenizer.ggml.model", &model)) {
    fail("%s: no tokenizer in the file (tokenizer.ggml.model is missing)", gguf_path(g));
    return NULL;
  }
  if (!gguf_string_is(model, "gpt2")) {
    fail("%s: tokenizer model \"%.*s\" is not supported (the engine reads byte-level BPE, "
         "\"gpt2\"; \"llama\" is SentencePiece)", gguf_path(g), (int)model.len, model.ptr);
    return NULL;
  }
  gguf_get_string(g, "tokenizer.ggml.pre", &pre);
  tokenizer *t = alloc_zeroed(1, sizeof *t, "tokenizer");
  if (!t) return NULL;
  if (!pick_pre_tokenizer(t, g, pre) || !load_vocabulary(t, g) || !load_merges(t, g)) {
    tokenizer_free(t);
    return NULL;
  }
  byte_alphabet(t);
  /* Bytes without a token of their own (some vocabularies lack a few control and invalid
     UTF-8 bytes) are dropped while encoding, as Hugging Face's BPE without an unknown token
     does. */
  for (int b = 0; b < 256; ++b) {
    char s[4];
    t->byte_token[b] = vocab_lookup(t, s, utf8_encode(t->byte_char[b], s));
  }
  t->bos = token_id_or(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
  t->eos = token_id_or(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
  t->eot = token_id_or(g, "tokenizer.ggml.eot_token_id", t->n_vocab);
  t->add_bos = false;
  gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos);
  t->add_bos = t->add_bos && t->bos >= 0;
  return t;
}

uint32_t tokenizer_vocab_size(const tokenizer *t) { return t->n_vocab; }
int32_t tokenizer_bos(const tokenizer *t) { return t->bos; }
bool tokenizer_adds_bos(const tokenizer *t) { return t->add_bos; }
bool tokenizer_is_end(const tokenizer *t, int32_t id) { return id >= 0 && (id == t->eos || id == t->eot); }

/* ---- encoding ----------------------------------------------------------------------- */

typedef struct id_list {
  int32_t *ids;
  size_t count, capacity;
} id_list;

static bool push(id_list *l, int32_t id) {
  if (l->count == l->capacity) {
    const size_t cap = l->capacity ? 2 * l->capacity : 256;
    int32_t *p = realloc(l->ids, cap * sizeof *p);
    if (!p) return fail("out of host memory (token list of %zu)", cap);
    l->ids = p;
    l->capacity = cap;
  }
  l->ids[l->count++] = id;
  return true;
}

/* Byte-pair merges of one piece (bytes s[0, n)) into ids. sym[] and rank[] are scratch of
   n entries: sym holds the live symbols in order, rank[i] the rank of merging sym[i] with
   sym[i+1] (-1: no such merge), so each round is one scan for the lowest rank. */
static bool bpe_piece(const tokenizer *t, const unsigned char *s, size_t n, int32_t *sym,
                      int32_t *rank, int32_t *merged, id_list *out) {
  if (t->ignore_merges && n <= 256) {
    char whole[1024];
    size_t len = 0;
    for (size_t i = 0; i < n; ++i) len += utf8_encode(t->byte_char[s[i]], whole + len);
    const int32_t id = vocab_lookup(t, whole, len);
    if (id >= 0) return push(out, id);
  }
  size_t m = 0;
  for (size_t i = 0; i < n; ++i)
    if (t->byte_token[s[i]] >= 0) sym[m++] = t->byte_token[s[i]];
  for (size_t i = 0; i + 1 < m; ++i) rank[i] = merge_lookup(t, sym[i], sym[i + 1], &merged[i]);
  while (m > 1) {
    size_t best = m;
    for (size_t i = 0; i + 1 < m; ++i)
      if (rank[i] >= 0 && (best == m || rank[i] < rank[best])) best = i;
    if (best == m) break;
    sym[best] = merged[best];
    memmove(sym + best + 1, sym + best + 2, (m - best - 2) * sizeof *sym);
    memmove(rank + best + 1, rank + best + 2, (m - best - 2) * sizeof *rank);
    memmove(merged + best + 1, merged + best + 2, (m - best - 2) * sizeof *merged);
    --m;
    if (best + 1 < m) rank[best] = merge_lookup(t, sym[best], sym[best + 1], &merged[best]);
    if (best > 0) rank[best - 1] = merge_lookup(t, sym[best - 1], sym[best], &merged[best - 1]);
  }
  for (size_t i = 0; i < m; ++i)
    if (!push(out, sym[i])) return false;
  return true;
}

/* A run of text without special tokens, decoded: cp[i] starts at byte at[i] (at[n] = end). */
typedef struct chars {
  const uint32_t *cp;
  const size_t *at;
  size_t n;
} chars;

static bool ascii_fold_is(uint32_t cp, char lower) {
  return cp == (uint32_t)lower || cp == (uint32_t)lower - 32;
}

/* Length (in characters) of a contraction ('s 't 'm 'd 're 've 'll) at i, or 0. */
static size_t contraction(chars c, size_t i, bool any_case) {
  if (c.cp[i] != '\'' || i + 1 >= c.n) return 0;
  const uint32_t a = c.cp[i + 1], b = i + 2 < c.n ? c.cp[i + 2] : 0;
  if (any_case) {
    if (ascii_fold_is(a, 's') || ascii_fold_is(a, 't') || ascii_fold_is(a, 'm') || ascii_fold_is(a, 'd')) return 2;
    if ((ascii_fold_is(a, 'r') && ascii_fold_is(b, 'e')) || (ascii_fold_is(a, 'v') && ascii_fold_is(b, 'e')) ||
        (ascii_fold_is(a, 'l') && ascii_fold_is(b, 'l')))
      return 3;
    return 0;
  }
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

static size_t run_of(chars c, size_t i, bool (*pred)(uint32_t)) {
  while (i < c.n && pred(c.cp[i])) ++i;
  return i;
}

/* End of the whitespace match at i: `\s+(?!\S)|\s+` — a run of spaces followed by text
   leaves its last space to the text's piece, unless the run is that one space. */
static size_t whitespace_end(chars c, size_t i) {
  size_t k = run_of(c, i, is_space);
  if (k < c.n && k - i > 1) --k;
  return k;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t next_piece_gpt2(chars c, size_t i) {
  const size_t k = contraction(c, i, false);
  if (k) return i + k;
  const size_t j = i + (c.cp[i] == ' ' && i + 1 < c.n ? 1 : 0);
  if (is_letter(c.cp[j])) return run_of(c, j, is_letter);
  if (is_number(c.cp[j])) return run_of(c, j, is_number);
  if (is_other(c.cp[j])) return run_of(c, j, is_other);
  return whitespace_end(c, i);
}

/* LLaMA-3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
            ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t next_piece_llama3(chars c, size_t i) {
  const size_t k = contraction(c, i, true);
  if (k) return i + k;
  const uint32_t x = c.cp[i];
  if (is_letter(x)) return run_of(c, i, is_letter);
  if (!is_newline(x) && !is_number(x) && i + 1 < c.n && is_letter(c.cp[i + 1]))
    return run_of(c, i + 1, is_letter);
  if (is_number(x)) {
    size_t e = i;
    while (e < c.n && e - i < 3 && is_number(c.cp[e])) ++e;
    return e;
  }
  const size_t j = i + (x == ' ' && i + 1 < c.n ? 1 : 0);
  if (is_other(c.cp[j])) return run_of(c, run_of(c, j, is_other), is_newline);
  /* \s*[\r\n]+ : the space run up to and including its last line break */
  const size_t end = run_of(c, i, is_space);
  for (size_t p = end; p > i; --p)
    if (is_newline(c.cp[p - 1])) return p;
  return whitespace_end(c, i);
}

/* Pre-tokenizes and encodes a run of text without special tokens. */
static bool encode_plain(const tokenizer *t, const unsigned char *s, size_t len, id_list *out) {
  if (len == 0) return true;
  uint32_t *cp = alloc_zeroed(len, sizeof *cp, "tokenizer scratch");
  size_t *at = alloc_zeroed(len + 1, sizeof *at, "tokenizer scratch");
  int32_t *scratch = alloc_zeroed(3 * len, sizeof *scratch, "tokenizer scratch");
  bool ok = cp && at && scratch;
  size_t n = 0;
  for (size_t b = 0; ok && b < len; ++n) {
    at[n] = b;
    b += utf8_decode(s + b, len - b, &cp[n]);
  }
  at[n] = len;
  /* The digit-isolating pre-tokenizer cuts the text at every number character first and
     runs GPT-2's expression on each stretch between them. */
  for (size_t start = 0; ok && start < n;) {
    size_t stop = n;
    if (t->pre == PRE_GPT2_DIGITS) {
      if (is_number(cp[start])) stop = start + 1;
      else for (stop = start; stop < n && !is_number(cp[stop]);) ++stop;
    }
    const chars c = {cp + start, at + start, stop - start};
    for (size_t i = 0; ok && i < c.n;) {
      const size_t e = t->pre == PRE_LLAMA3 ? next_piece_llama3(c, i) : next_piece_gpt2(c, i);
      ok = bpe_piece(t, s + c.at[i], c.at[e] - c.at[i], scratch, scratch + len, scratch + 2 * len, out);
      i = e;
    }
    start = stop;
  }
  free(cp);
  free(at);
  free(scratch);
  return ok;
}

bool tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_bos,
                      int32_t **ids, size_t *count) {
  id_list out = {NULL, 0, 0};
  bool ok = !add_bos || t->bos < 0 || push(&out, t->bos);
  const unsigned char *s = (const unsigned char *)text;
  size_t plain = 0; /* start of the text not yet encoded */
  for (size_t i = 0; ok && i < len; ++i) {
    if (!t->special_starts[s[i]]) continue;
    int32_t hit = -1;
    for (uint32_t k = 0; k < t->n_special && hit < 0; ++k) { /* longest first */
      const int32_t id = t->special[k];
      const size_t n = t->offset[id + 1] - t->offset[id];
      if (n <= len - i && memcmp(text + i, t->text + t->offset[id], n) == 0) hit = id;
    }
    if (hit < 0) continue;
    ok = encode_plain(t, s + plain, i - plain, &out) && push(&out, hit);
    i += t->offset[hit + 1] - t->offset[hit] - 1;
    plain = i + 1;
  }
  ok = ok && encode_plain(t, s + plain, len - plain, &out);
  if (!ok) {
    free(out.ids);
    return false;
  }
  *ids = out.ids;
  *count = out.count;
  return true;
}

size_t tokenizer_decode(const tokenizer *t, int32_t id, char *buf, size_t size) {
  if (id < 0 || (uint32_t)id >= t->n_vocab) return 0;
  const char *s = t->text + t->offset[id];
  const size_t n = t->offset[id + 1] - t->offset[id];
  size_t w = 0;
  if (t->type[id] == TOKEN_CONTROL || t->type[id] == TOKEN_USER_DEFINED) {
    w = n < size ? n : size;
    memcpy(buf, s, w);
    return w;
  }
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    const size_t l = utf8_decode((const unsigned char *)s + i, n - i, &cp);
    if (cp < 512 && t->char_byte[cp] >= 0) {
      if (w < size) buf[w++] = (char)t->char_byte[cp];
    } else { /* not from the byte alphabet: copy the character itself */
      for (size_t j = 0; j < l && w < size; ++j) buf[w++] = s[i + j];
    }
    i += l;
  }
  return w;
}

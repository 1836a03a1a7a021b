/*
 * main.c — minikv-engine, the command line.
 *
 *   minikv-engine --model M.gguf --prompt "..." [-n 128] [--kv full|minikv|<k=v,...>]
 *   minikv-engine --bench [...]            (bench.c; --bench --help lists its flags)
 *
 * Generation streams the text of a single prompt to stdout; several prompts (--prompt
 * given more than once) run together through continuous batching and are printed when
 * all are done. Timing and cache statistics go to stderr. --help lists every flag.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench.h"
#include "engine.h"
#include "gguf.h"
#include "model.h"
#include "sampler.h"
#include "tokenizer.h"
#include "util.h"

enum { MAX_PROMPTS = 256 };

typedef struct options {
  const char *model, *random_shape, *kv, *backend, *dtype, *dump_logits;
  const char *prompt_text[MAX_PROMPTS];
  bool prompt_is_file[MAX_PROMPTS];
  size_t n_prompts;
  uint32_t n_new[MAX_PROMPTS], n_new_count, batch, max_seq_len;
  float temperature, top_p;
  uint64_t seed;
  bool ids, tokenize, quiet, raw, no_graphs, no_gemv, no_pdl;
} options;

static void usage(FILE *f) {
  fprintf(f,
    "usage: minikv-engine --model M.gguf --prompt TEXT [options]\n"
    "       minikv-engine --bench [bench options]   (minikv-engine --bench --help)\n"
    "\n"
    "Runs a LLaMA-family GGUF model (F32/F16/BF16/Q4_0/Q4_1/Q8_0 weights, byte-level BPE\n"
    "tokenizer) with every attention call through libminikv.\n"
    "\n"
    "  --model PATH          GGUF file\n"
    "  --random SHAPE        random weights of a known shape instead (%s)\n"
    "  --prompt TEXT         a prompt; give it several times to run several sequences\n"
    "                        together (continuous batching)\n"
    "  --prompt-file PATH    a prompt read from a file (may be repeated, mixed with --prompt)\n"
    "  -n N[,N...]           new tokens per prompt, one value or one per prompt (128)\n"
    "  --kv SETTING          full (16-bit, every token kept) | minikv (the library's\n"
    "                        defaults) | balanced | paper | quality | eviction (its\n"
    "                        presets), optionally followed by ,field=value items (minikv)\n"
    "                        fields: heavy recent key_bits value_bits bits group residual\n"
    "                        flush sinks policy=uniform|pyramid depth score=cumulative|window\n"
    "                        window pool max_tokens\n"
    "  --backend cpu|cuda    where to compute (%s)\n"
    "  --dtype f16|bf16|f32  activations handed to libminikv (f16; f32 on the CPU only)\n"
    "  --batch N             sequences decoded together at most (the number of prompts)\n"
    "  --max-seq-len N       cache positions per sequence (longest prompt + n)\n"
    "  --temp T              sampling temperature; 0 = greedy (0)\n"
    "  --top-p P             nucleus sampling mass (1)\n"
    "  --seed S              sampling seed, and the random weights' (1)\n"
    "  --raw                 no BOS token even where the model adds one\n"
    "  --ids                 print generated token ids, one per line, instead of text\n"
    "  --tokenize            print the prompt's token ids and exit\n"
    "  --dump-logits PATH    write the logits of every generated token (float32, rows of\n"
    "                        n_vocab, in generation order); PATH.i for prompt i of several\n"
    "  --quiet               no progress or statistics on stderr\n"
    "  --no-graphs           CUDA: launch each decode step's kernels directly instead of\n"
    "                        replaying it as one CUDA graph\n"
    "  --no-gemv             CUDA: decode batches of up to 8 through cuBLAS and separate\n"
    "                        norm/RoPE/SwiGLU kernels, not the fused GEMVs\n"
    "  --no-pdl              CUDA: fused GEMVs that do not start behind the kernel before\n"
    "                        them (programmatic dependent launch)\n",
    model_preset_names(),
#ifdef ENGINE_WITH_CUDA
    "cuda"
#else
    "cpu; this build has no CUDA"
#endif
  );
}

static bool parse_f32(const char *flag, const char *v, float *out) {
  char *end;
  const double x = v ? strtod(v, &end) : 0;
  if (!v || *end != '\0' || !(x >= 0)) return fail("%s needs a number >= 0 (got %s)", flag, v ? v : "nothing");
  *out = (float)x;
  return true;
}

static bool parse_args(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->kv = "minikv";
  o->n_new[0] = 128;
  o->n_new_count = 1;
  o->top_p = 1.0f;
  o->seed = 1;
  o->dtype = "f16";
#ifdef ENGINE_WITH_CUDA
  o->backend = "cuda";
#else
  o->backend = "cpu";
#endif
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    bool takes_value = true;
    uint32_t u;
    if (strcmp(a, "--model") == 0) o->model = v;
    else if (strcmp(a, "--random") == 0) o->random_shape = v;
    else if (strcmp(a, "--prompt") == 0 || strcmp(a, "--prompt-file") == 0) {
      if (o->n_prompts == MAX_PROMPTS) return fail("at most %d prompts", MAX_PROMPTS);
      o->prompt_is_file[o->n_prompts] = strcmp(a, "--prompt-file") == 0;
      o->prompt_text[o->n_prompts++] = v;
    } else if (strcmp(a, "-n") == 0) {
      if (!v || strlen(v) >= 4096) return fail("-n needs a value");
      char list[4096], *save = NULL;
      strcpy(list, v);
      o->n_new_count = 0;
      for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->n_new_count == MAX_PROMPTS) return fail("-n: at most %d values", MAX_PROMPTS);
        if (!parse_flag_u32(a, t, 0, &o->n_new[o->n_new_count++])) return false;
      }
      if (o->n_new_count == 0) return fail("-n needs a value");
    } else if (strcmp(a, "--kv") == 0) o->kv = v;
    else if (strcmp(a, "--backend") == 0) o->backend = v;
    else if (strcmp(a, "--dtype") == 0) o->dtype = v;
    else if (strcmp(a, "--batch") == 0) {
      if (!parse_flag_u32(a, v, 1, &o->batch)) return false;
    } else if (strcmp(a, "--max-seq-len") == 0) {
      if (!parse_flag_u32(a, v, 2, &o->max_seq_len)) return false;
    } else if (strcmp(a, "--temp") == 0) {
      if (!parse_f32(a, v, &o->temperature)) return false;
    } else if (strcmp(a, "--top-p") == 0) {
      if (!parse_f32(a, v, &o->top_p)) return false;
    } else if (strcmp(a, "--seed") == 0) {
      if (!parse_flag_u32(a, v, 0, &u)) return false;
      o->seed = u;
    } else if (strcmp(a, "--dump-logits") == 0) o->dump_logits = v;
    else {
      takes_value = false;
      if (strcmp(a, "--ids") == 0) o->ids = true;
      else if (strcmp(a, "--tokenize") == 0) o->tokenize = true;
      else if (strcmp(a, "--quiet") == 0) o->quiet = true;
      else if (strcmp(a, "--raw") == 0) o->raw = true;
      else if (strcmp(a, "--no-graphs") == 0) o->no_graphs = true;
      else if (strcmp(a, "--no-gemv") == 0) o->no_gemv = true;
      else if (strcmp(a, "--no-pdl") == 0) o->no_pdl = true;
      else return fail("unknown flag %s (--help lists them)", a);
    }
    if (takes_value) {
      if (!v) return fail("%s needs a value", a);
      ++i;
    }
  }
  if (!o->model == !o->random_shape) return fail("give one of --model PATH or --random SHAPE");
  if (o->n_prompts == 0) return fail("no prompt (--prompt TEXT or --prompt-file PATH)");
  if (o->n_new_count != 1 && o->n_new_count != o->n_prompts)
    return fail("-n has %u values for %zu prompts (give one, or one per prompt)", o->n_new_count, o->n_prompts);
  return true;
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fail("cannot open %s", path);
    return NULL;
  }
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    n += fread(buf + n, 1, cap - n, f);
    if (n < cap) break;
    char *bigger = realloc(buf, cap *= 2);
    if (!bigger) free(buf);
    buf = bigger;
  }
  const bool bad = ferror(f);
  fclose(f);
  if (!buf || bad) {
    free(buf);
    fail("cannot read %s", path);
    return NULL;
  }
  *len = n;
  return buf;
}

/* ---- generation ---------------------------------------------------------------------- */

typedef struct run_ctx {
  const tokenizer *tok;
  const options *o;
  FILE **logits_files; /* one per request, or NULL */
  uint32_t n_vocab;
  bool stream; /* one prompt: print tokens as they come */
  bool write_failed;
} run_ctx;

static void print_token(const run_ctx *r, int32_t id) {
  if (r->o->ids || !r->tok) { /* a random-weight model has no tokenizer: ids */
    printf("%d\n", id);
    return;
  }
  char buf[512];
  fwrite(buf, 1, tokenizer_decode(r->tok, id, buf, sizeof buf), stdout);
}

static void on_token(void *ctx, size_t req, int32_t id) {
  (void)req;
  run_ctx *r = ctx;
  if (!r->stream) return;
  print_token(r, id);
  fflush(stdout);
}

static void on_logits(void *ctx, size_t req, const float *logits) {
  (void)req;
  run_ctx *r = ctx;
  if (r->logits_files && fwrite(logits, sizeof *logits, r->n_vocab, r->logits_files[req]) != r->n_vocab)
    r->write_failed = true;
}

static bool is_end(void *ctx, int32_t id) {
  const run_ctx *r = ctx;
  return r->tok && tokenizer_is_end(r->tok, id);
}

static void progress(void *ctx, uint32_t done, uint32_t layers) {
  const double *t0 = ctx;
  fprintf(stderr, "\rprefill: layer %u/%u, %.1f s", done, layers, now_seconds() - *t0);
  if (done == layers) fputc('\n', stderr);
}

static bool pick_dtype(const char *name, const char *backend_name, minikv_dtype *dt) {
  if (strcmp(name, "f16") == 0) *dt = MINIKV_DTYPE_F16;
  else if (strcmp(name, "bf16") == 0) *dt = MINIKV_DTYPE_BF16;
  else if (strcmp(name, "f32") == 0 && strcmp(backend_name, "cpu") == 0) *dt = MINIKV_DTYPE_F32;
  else return fail("--dtype %s: f16 or bf16 (f32 on the CPU backend)", name);
  return true;
}

static void print_stats(const backend *b, const request *reqs, size_t n, const engine_stats *st) {
  const minikv_memory_stats ms = st->peak;
  char a[32], c[32], d[32], e[32];
  fprintf(stderr, "\n---\n");
  for (size_t i = 0; i < n; ++i)
    if (reqs[i].state == REQUEST_REFUSED) fprintf(stderr, "prompt %zu refused: %s\n", i, reqs[i].refusal);
  fprintf(stderr, "prefill  %llu tokens in %.3f s (%.1f tokens/s)\n", (unsigned long long)st->prefill_tokens,
          st->prefill_seconds, st->prefill_seconds > 0 ? (double)st->prefill_tokens / st->prefill_seconds : 0.0);
  fprintf(stderr, "decode   %llu tokens in %llu steps, %.3f s: %.2f ms/step, %.1f tokens/s (at most %u sequences together%s)\n",
          (unsigned long long)st->decoded_tokens, (unsigned long long)st->decode_steps, st->decode_seconds,
          st->decode_steps ? 1e3 * st->decode_seconds / (double)st->decode_steps : 0.0,
          st->decode_seconds > 0 ? (double)st->decoded_tokens / st->decode_seconds : 0.0, st->max_running,
          st->deferred ? ", admissions deferred for a full cache" : "");
  if (ms.struct_size)
    fprintf(stderr, "cache    pool %s; at its fullest %s in use for %llu of %llu positions (%.0f%% of the "
            "%s an fp16 cache of every position takes), workspace %s\n",
            format_bytes((double)ms.pool_bytes, a, sizeof a), format_bytes((double)ms.used_bytes, c, sizeof c),
            (unsigned long long)ms.tokens_cached, (unsigned long long)ms.tokens_seen,
            100.0 * (double)ms.used_bytes / (double)(ms.fp16_equivalent_bytes ? ms.fp16_equivalent_bytes : 1),
            format_bytes((double)ms.fp16_equivalent_bytes, d, sizeof d),
            format_bytes((double)ms.workspace_bytes, e, sizeof e));
  fprintf(stderr, "model    weights %s, buffers %s (%s backend)\n", format_bytes((double)b->weight_bytes, a, sizeof a),
          format_bytes((double)b->buffer_bytes, c, sizeof c), b->name);
}

static int generate(const options *o) {
  int rc = 1;
  gguf_file *g = NULL;
  tokenizer *tok = NULL;
  backend *b = NULL;
  request reqs[MAX_PROMPTS];
  char *texts[MAX_PROMPTS] = {0};
  int32_t *prompts[MAX_PROMPTS] = {0};
  size_t n_req = 0;
  FILE *logits_files[MAX_PROMPTS] = {0};
  sampler smp;
  sampler_init(&smp, o->temperature, o->top_p, o->seed);
  memset(reqs, 0, sizeof reqs);

  model_config m = {0};
  model_source src = {NULL, o->seed};
  if (o->model) {
    /* --tokenize needs only the tokenizer (the file may hold nothing else) */
    if (!(g = gguf_open(o->model)) || !(tok = tokenizer_load(g))) goto done;
    if (!o->tokenize && !model_config_from_gguf(g, &m)) goto done;
    src.gguf = g;
  } else if (!model_config_preset(o->random_shape, &m)) {
    goto done;
  }

  /* Prompts -> token ids (a random-weight model has no tokenizer: bytes as ids). */
  size_t longest = 0;
  uint32_t most_new = 0;
  for (; n_req < o->n_prompts; ++n_req) {
    size_t len = strlen(o->prompt_text[n_req]), count = 0;
    const char *text = o->prompt_text[n_req];
    if (o->prompt_is_file[n_req]) {
      if (!(texts[n_req] = read_file(text, &len))) goto done;
      text = texts[n_req];
    }
    if (tok) {
      if (!tokenizer_encode(tok, text, len, tokenizer_adds_bos(tok) && !o->raw, &prompts[n_req], &count)) goto done;
    } else {
      if (!(prompts[n_req] = alloc_zeroed(len, sizeof(int32_t), "prompt"))) goto done;
      for (count = 0; count < len; ++count) prompts[n_req][count] = (unsigned char)text[count] % (int32_t)m.n_vocab;
    }
    reqs[n_req].prompt = prompts[n_req];
    reqs[n_req].prompt_len = count;
    reqs[n_req].max_new_tokens = o->n_new[o->n_new_count == 1 ? 0 : n_req];
    if (count > longest) longest = count;
    if (reqs[n_req].max_new_tokens > most_new) most_new = reqs[n_req].max_new_tokens;
  }
  if (o->tokenize) {
    for (size_t i = 0; i < n_req; ++i)
      for (size_t t = 0; t < reqs[i].prompt_len; ++t) printf("%d\n", reqs[i].prompt[t]);
    rc = 0;
    goto done;
  }

  minikv_config kv;
  minikv_config_default(&kv);
  backend_options opt = {0};
  if (!engine_parse_kv(o->kv, &kv) || !pick_dtype(o->dtype, o->backend, &opt.dtype)) goto done;
  opt.max_batch = o->batch ? o->batch : (uint32_t)n_req;
  opt.max_prompt_tokens = longest > 0 ? (uint32_t)longest : 1;
  opt.quiet = o->quiet;
  opt.no_graphs = o->no_graphs;
  opt.no_gemv = o->no_gemv;
  opt.no_pdl = o->no_pdl;
  const uint32_t max_seq_len = o->max_seq_len ? o->max_seq_len : (uint32_t)longest + most_new + 1;
  if (!o->quiet) {
    char desc[256];
    fprintf(stderr, "model    %s: %u layers, %u heads (%u KV), head_dim %u, vocab %u\n", m.name, m.n_layers,
            m.n_heads, m.n_kv_heads, m.head_dim, m.n_vocab);
    fprintf(stderr, "cache    %s\n", engine_describe_kv(&kv, desc, sizeof desc));
    fprintf(stderr, "prompts  %zu, longest %zu tokens; up to %u new tokens each\n", n_req, longest, most_new);
  }
  if (!(b = backend_create(o->backend, &src, &m, &kv, max_seq_len, &opt))) goto done;
  double t_prefill = now_seconds();
  if (!o->quiet && longest >= 1024) {
    b->progress = progress;
    b->progress_ctx = &t_prefill;
  }
  for (size_t i = 0; o->dump_logits && i < n_req; ++i) {
    char path[4096];
    if (n_req == 1) snprintf(path, sizeof path, "%s", o->dump_logits);
    else snprintf(path, sizeof path, "%s.%zu", o->dump_logits, i);
    if (!(logits_files[i] = fopen(path, "wb"))) {
      fail("cannot write %s", path);
      goto done;
    }
  }
  run_ctx ctx = {tok, o, o->dump_logits ? logits_files : NULL, m.n_vocab, n_req == 1, false};
  const engine_hooks hooks = {on_token, on_logits, is_end, &ctx};
  engine_stats st;
  if (!engine_run(b, reqs, n_req, &smp, &hooks, &st)) goto done;
  if (ctx.write_failed) {
    fail("writing %s failed", o->dump_logits);
    goto done;
  }
  const bool text = tok && !o->ids;
  if (n_req == 1 && text) putchar('\n');
  for (size_t i = 0; n_req > 1 && i < n_req; ++i) {
    printf("=== prompt %zu (%zu tokens): %s\n", i, reqs[i].prompt_len,
           reqs[i].state == REQUEST_REFUSED ? "refused" : "");
    for (size_t t = 0; t < reqs[i].n_tokens; ++t) print_token(&ctx, reqs[i].tokens[t]);
    if (text) putchar('\n');
  }
  if (!o->quiet) print_stats(b, reqs, n_req, &st);
  rc = 0;
  for (size_t i = 0; i < n_req; ++i)
    if (reqs[i].state == REQUEST_REFUSED) rc = 3;

done:
  if (rc == 1) fprintf(stderr, "minikv-engine: %s\n", last_error());
  for (size_t i = 0; i < MAX_PROMPTS; ++i)
    if (logits_files[i] && fclose(logits_files[i]) != 0 && rc == 0) {
      fprintf(stderr, "minikv-engine: writing %s failed\n", o->dump_logits);
      rc = 1;
    }
  engine_free_requests(reqs, n_req);
  for (size_t i = 0; i < MAX_PROMPTS; ++i) {
    free(texts[i]);
    free(prompts[i]);
  }
  if (b) b->destroy(b);
  sampler_free(&smp);
  tokenizer_free(tok);
  gguf_close(g);
  return rc;
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; ++i)
    if (strcmp(argv[i], "--bench") == 0) return bench_main(argc, argv);
  for (int i = 1; i < argc; ++i)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    }
  if (minikv_version_number() != MINIKV_VERSION_NUMBER) {
    fprintf(stderr, "minikv-engine: built against libminikv %d, loaded %s\n", MINIKV_VERSION_NUMBER,
            minikv_version_string());
    return 1;
  }
  options o;
  if (!parse_args(argc, argv, &o)) {
    fprintf(stderr, "minikv-engine: %s\n", last_error());
    usage(stderr);
    return 2;
  }
  return generate(&o);
}

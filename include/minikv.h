/*
 * minikv.h — the public C API of libminikv.
 *
 * libminikv stores the KV cache of a transformer compressed with the MiniKV method
 * (arXiv 2411.18077): at the end of each prompt's prefill it keeps, per layer and KV
 * head, a recent window plus the "heavy hitter" tokens that received the most
 * attention, quantizes what it keeps to 2, 4 or 8 bits KIVI-style, and computes decode
 * attention directly over the compressed cache.
 *
 * Introduction / lifecycle
 * ------------------------
 *   minikv_config cfg;
 *   minikv_config_default(&cfg);              // defaults + cfg.struct_size (this header's)
 *   // minikv_config_preset(&cfg, MINIKV_PRESET_PAPER);  // the MiniKV paper's exact setting
 *   cfg.num_layers = 32; cfg.num_heads = 32; cfg.num_kv_heads = 8; cfg.head_dim = 128;
 *   cfg.max_sequences = 16; cfg.max_seq_len = 8192;
 *   minikv_cache *cache;
 *   if (minikv_cache_create(&cfg, &cache) != MINIKV_OK) puts(minikv_last_error_message());
 *   for each layer: minikv_prefill(cache, layer, ...)    // prompt attention + compression
 *     (or the prompt in chunks: for each chunk, for each layer: minikv_prefill_chunk(...))
 *   for each generated token, for each layer:
 *       minikv_append(cache, layer, ...)                 // the token's K/V
 *       minikv_decode(cache, layer, ...)                 // the token's attention output
 *       // or both in one call: minikv_append_decode(cache, layer, ...)
 *   minikv_sequence_release(cache, seq_id);              // the slot can take a new prompt
 *   minikv_cache_destroy(cache);
 *
 * Memory spaces. Tensor arguments (q, k, v, out) live where the cache's backend computes:
 * host memory for MINIKV_BACKEND_CPU, device memory of cfg.device_id for
 * MINIKV_BACKEND_CUDA. Index arrays (seq_ids, cu_seqlens) are always host memory. All
 * tensors are dense, row-major, "tokens-major":
 *   prefill q, out : [total_tokens, num_heads,    head_dim]
 *   prefill k, v   : [total_tokens, num_kv_heads, head_dim]
 *   append  k, v   : [n_seqs,       num_kv_heads, head_dim]
 *   decode  q, out : [n_seqs,       num_heads,    head_dim]
 * in the element type cfg.dtype. Keys arrive with rotary embeddings already applied.
 * Alignment: each tensor pointer is aligned to its element size (2 bytes for F16/BF16, 4 for
 * F32) for the CPU backend, and to 16 bytes for the CUDA backend (its prefill moves rows
 * with 16-byte loads); a misaligned pointer is MINIKV_ERR_INVALID_ARGUMENT.
 *
 * Values. Inputs must be finite: no NaN or +-inf in q, k, v. The CPU backend checks every
 * input element of a call (one pass over them, before anything else happens) and fails with
 * MINIKV_ERR_INVALID_ARGUMENT naming the first non-finite element, so a non-finite value
 * never reaches the cache and never affects other tokens. The CUDA backend cannot check
 * without synchronizing the host: there a non-finite input is the caller's duty, and what
 * it does is contained to the (sequence, layer) it was given for: it may make that
 * sequence's outputs of that layer NaN or inf (a query: that call's output; a key or value:
 * every later output too, as the token stays in the cache until the sequence is released),
 * and nothing else: other sequences' outputs and caches, other layers, lengths, statistics
 * and later calls are exactly as if it had been finite. Finite inputs anywhere in the
 * dtype's range are stored with finite scales, and outputs stay within the dtype's finite
 * range (dequantized values and outputs are clamped to it) as long as the logits
 * q.k / sqrt(head_dim) are finite in float32; with the CUDA backend for every F16 input,
 * and for BF16 inputs whose |v| and products |q_i| |k_i| stay below 2^60 (beyond, float32
 * intermediates of the CUDA decode may overflow).
 *
 * Streams. `stream` is a cudaStream_t passed as void* (NULL = the legacy default stream)
 * for the CUDA backend and must be NULL for the CPU backend. CUDA calls are asynchronous
 * with respect to the host: they return once the work is queued, and borrowed device
 * buffers must stay valid until that work has run. A handle's workspaces are shared by its
 * calls, so calls on one handle that use different streams must be ordered by the caller
 * (events, or one stream per handle). A CUDA cache with max_sequences above 128 owns a
 * few streams of its own: a decode of more than 128 sequences runs its launches on them
 * side by side, after the work already queued on `stream` and before any work queued there
 * later (event fork and join, which CUDA graph capture records). CPU calls are synchronous.
 *
 * CUDA graphs. minikv_append, minikv_decode and minikv_append_decode can be captured into
 * a CUDA graph (stream capture). A captured call records the launches for that moment's
 * sizes (cache lengths, split counts), so a graph replays one step only: capture each step
 * again and update an executable graph with it (cudaGraphExecUpdate). The number of
 * launches changes too: a decode adds a split merge at some lengths, and minikv_append /
 * minikv_append_decode add a flush launch in the steps where a sequence's residual fills
 * (every flush_tokens steps, at different steps in layers with different budgets). Keep
 * executable graphs by shape, e.g. by the captured node count after each call, as
 * examples/engine does.
 *
 * Errors. Every fallible call returns a minikv_status. A call that fails leaves the cache
 * exactly as it was: no partial prefill or append, no lost tokens, no leaked memory. The
 * detail of the last failure is in minikv_last_error_message() (per thread) and
 * minikv_cache_last_error() (per handle).
 *
 * Device faults. CUDA work runs after the call that queued it has returned MINIKV_OK, so a
 * fault while it runs (an invalid device pointer, an illegal address) is not that call's
 * status. It surfaces at the next point that asks CUDA: the caller's own synchronization
 * of the stream (cudaStreamSynchronize, cudaEventSynchronize), or the next minikv call on
 * that device, which returns MINIKV_ERR_DEVICE with CUDA's text. Such faults are sticky in
 * CUDA: from then on every CUDA call of the process on that device fails, so every minikv
 * call there returns MINIKV_ERR_DEVICE, and the contents of the caches on it are lost.
 * Destroy them (minikv_cache_destroy still frees the host memory) and restart the process
 * to use the GPU again. To find which call faulted, synchronize after each call while
 * debugging (or run under compute-sanitizer).
 *
 * Threading. A handle is not internally synchronized: use it from one thread at a time
 * (any thread). Distinct handles are independent and may be used concurrently. A call made
 * while another thread's call is using the same handle fails with MINIKV_ERR_BAD_STATE
 * ("minikv_decode: the cache is in use by minikv_prefill on another thread ...") and
 * changes nothing; this is a detector (one atomic operation per call), not a lock, and it
 * does not cover minikv_cache_destroy and minikv_cache_last_error, which must not overlap
 * another call on the handle.
 *
 * fork(). A handle created before fork() keeps working in the child with the CPU backend:
 * the child has its own copy of the cache and starts its own worker threads on first use
 * (destroying the handle there is fine too). The CUDA runtime does not survive fork(): in
 * the child, CUDA calls fail with MINIKV_ERR_DEVICE.
 *
 * ABI. Structs start with `struct_size`; the library reads only the fields the caller's
 * size covers and evolves by appending fields. Status values are pinned and append-only.
 * The SONAME carries the major version. A program may use a loaded library of the same
 * major version that is not older than the header it was compiled with; check it at start-
 * up with  MINIKV_VERSION_COMPATIBLE(minikv_version_number()).
 */
#ifndef MINIKV_H
#define MINIKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- export and deprecation macros ------------------------------------------------ */
#ifndef MINIKV_API
#  if defined(_WIN32) && defined(MINIKV_SHARED)
#    ifdef MINIKV_BUILD
#      define MINIKV_API __declspec(dllexport)
#    else
#      define MINIKV_API __declspec(dllimport)
#    endif
#  elif defined(__GNUC__) && __GNUC__ >= 4
#    define MINIKV_API __attribute__((visibility("default")))
#  else
#    define MINIKV_API
#  endif
#endif

#ifndef MINIKV_DEPRECATED
#  if defined(__cplusplus) && __cplusplus >= 201402L
#    define MINIKV_DEPRECATED(msg) [[deprecated(msg)]]
#  elif defined(__GNUC__) || defined(__clang__)
#    define MINIKV_DEPRECATED(msg) __attribute__((deprecated(msg)))
#  elif defined(_MSC_VER)
#    define MINIKV_DEPRECATED(msg) __declspec(deprecated(msg))
#  else
#    define MINIKV_DEPRECATED(msg)
#  endif
#endif

/* ---- version ---------------------------------------------------------------------- */
#define MINIKV_VERSION_MAJOR 0
#define MINIKV_VERSION_MINOR 1
#define MINIKV_VERSION_PATCH 0
#define MINIKV_VERSION_NUMBER \
  (MINIKV_VERSION_MAJOR * 10000 + MINIKV_VERSION_MINOR * 100 + MINIKV_VERSION_PATCH)

/** Whether a library whose minikv_version_number() is `loaded` can serve a program compiled
 *  with this header: the same major version (the ABI only grows within one), and not older
 *  than the header (an older library may lack a function or field the program uses). The
 *  one version rule of libminikv: every language binding applies it too. */
#define MINIKV_VERSION_COMPATIBLE(loaded) \
  ((loaded) / 10000 == MINIKV_VERSION_MAJOR && (loaded) >= MINIKV_VERSION_NUMBER)

/** `major*10000 + minor*100 + patch` of the loaded library, for MINIKV_VERSION_COMPATIBLE.
 *  Never fails; callable from any thread. */
MINIKV_API uint32_t minikv_version_number(void);

/** The loaded library's version as "MAJOR.MINOR.PATCH". Static storage owned by the
 *  library; never NULL. */
MINIKV_API const char *minikv_version_string(void);

/* ---- status codes (values pinned, append-only) ------------------------------------ */
typedef enum minikv_status {
  MINIKV_OK = 0,
  MINIKV_ERR_INVALID_ARGUMENT = 1, /**< a NULL pointer, an out-of-range id or size, a bad field */
  MINIKV_ERR_OUT_OF_MEMORY = 2,    /**< a host or device allocation failed */
  MINIKV_ERR_CAPACITY_EXCEEDED = 3,/**< the block pool is full, or a sequence reached
                                        max_seq_len; nothing changed: release or preempt
                                        sequences and retry */
  MINIKV_ERR_BAD_STATE = 4,        /**< the call is valid but not now (decode before prefill,
                                        prefill of a layer twice, the handle in use by
                                        another thread's call) */
  MINIKV_ERR_UNSUPPORTED = 5,      /**< valid but not built/supported here (CUDA backend
                                        absent, head_dim not compiled) */
  MINIKV_ERR_DEVICE = 6,           /**< a CUDA runtime error; the message has CUDA's text */
  MINIKV_ERR_VERSION_MISMATCH = 7, /**< a struct_size the library cannot read */
  MINIKV_ERR_INTERNAL = 8          /**< a bug in libminikv; please report the message */
} minikv_status;

/** Static English text for a status ("MINIKV_ERR_BAD_STATE: ..."); never NULL, also for
 *  values this version does not know. */
MINIKV_API const char *minikv_status_string(minikv_status status);

/** Detail of the last failed call made on this thread ("" if none), e.g.
 *  "minikv_cache_create: num_heads (12) must be a multiple of num_kv_heads (8)".
 *  Ownership: thread-local storage owned by the library, valid until the next minikv_*
 *  call on this thread. Never NULL. A successful call does not clear it. */
MINIKV_API const char *minikv_last_error_message(void);

/* ---- configuration ---------------------------------------------------------------- */
typedef enum minikv_backend {
  MINIKV_BACKEND_AUTO = 0, /**< CUDA when built and a device is present, else CPU */
  MINIKV_BACKEND_CPU = 1,  /**< host memory, multithreaded float32 arithmetic */
  MINIKV_BACKEND_CUDA = 2  /**< device memory of device_id, kernels on the caller's stream */
} minikv_backend;

typedef enum minikv_dtype {
  MINIKV_DTYPE_F16 = 0,  /**< IEEE binary16 */
  MINIKV_DTYPE_BF16 = 1, /**< bfloat16 */
  MINIKV_DTYPE_F32 = 2   /**< IEEE binary32 */
} minikv_dtype;

typedef enum minikv_budget_policy {
  MINIKV_BUDGET_UNIFORM = 0, /**< every layer keeps heavy_ratio of its prompt as heavy hitters */
  MINIKV_BUDGET_PYRAMID = 1  /**< lower layers keep more: h*(2-1/depth) at layer 0 down to
                                  h/depth at the top, linear, mean h */
} minikv_budget_policy;

typedef enum minikv_score_mode {
  MINIKV_SCORE_CUMULATIVE = 0, /**< H2O: attention each key receives, summed over all prompt queries */
  MINIKV_SCORE_WINDOW = 1      /**< SnapKV: summed over the last window_size queries, max-pooled */
} minikv_score_mode;

/** Cache configuration. Always initialize with minikv_config_default() (which sets
 *  struct_size to this header's size), optionally pick other compression settings with
 *  minikv_config_preset(), then set the model dimensions. The defaults below are
 *  MINIKV_PRESET_BALANCED; the MiniKV paper's exact setting is MINIKV_PRESET_PAPER. */
typedef struct minikv_config {
  uint32_t struct_size;         /**< sizeof(minikv_config) of the caller's header */
  minikv_backend backend;       /**< AUTO */
  int32_t device_id;            /**< CUDA device ordinal; 0 */
  minikv_dtype dtype;           /**< element type of q/k/v/out and of 16-bit storage; F16 */
  uint32_t num_layers;          /**< required, >= 1 */
  uint32_t num_heads;           /**< query heads, required, a multiple of num_kv_heads */
  uint32_t num_kv_heads;        /**< required, >= 1 */
  uint32_t head_dim;            /**< required: a multiple of 16, at most 256 (CPU); CUDA
                                     builds compile 64, 80, 96, 128 and 256 */
  uint32_t max_sequences;       /**< sequence slots, seq_id in [0, max_sequences); 1 */
  uint32_t max_seq_len;         /**< longest prompt + generation of one sequence; 4096 */
  uint64_t max_tokens;          /**< pool capacity in cached tokens summed over sequences
                                     and layers, rounded up to whole blocks of
                                     residual_length tokens, at most 2^31 blocks; 0 = enough
                                     for every slot at max_seq_len. CPU: the pool must fit
                                     the machine's RAM + swap (checked before anything is
                                     allocated: MINIKV_ERR_OUT_OF_MEMORY) */
  float heavy_ratio;            /**< heavy-hitter budget h as a fraction of the prompt; 0.25.
                                     Ratios are read as the shortest decimal that rounds to
                                     the float (0.7f is 0.7, so 0.7 of 1000 tokens is 700);
                                     a layer keeps floor(h_l L) + floor(r L) tokens (in
                                     double, with a slack of 1e-12 (1 + L) for the rounding
                                     of the PYRAMID line), or every token when h_l + r >= 1;
                                     h + r >= 1 keeps every layer whole under either policy */
  float recent_ratio;           /**< recent-window budget r as a fraction of the prompt; 0.25 */
  minikv_budget_policy budget_policy; /**< PYRAMID (with WINDOW scores it measured best
                                            on SmolLM2-135M at 4 bits per element) */
  float pyramid_depth;          /**< PYRAMID depth delta >= 1; 7 */
  minikv_score_mode score_mode; /**< WINDOW (keeps what the prompt's end asks for: passkey
                                     retrieval near the full cache's; CUMULATIVE lost up
                                     to 11 points); WINDOW prefill costs one attention
                                     pass, CUMULATIVE about two */
  uint32_t window_size;         /**< WINDOW mode: scoring queries (always kept); 32 */
  uint32_t pool_kernel;         /**< WINDOW mode: odd max-pool width, 1 = none; 7 */
  uint32_t key_bits;            /**< 2, 4, 8, or 16 (= unquantized, dtype); 4 (keys are the
                                     sensitive side) */
  uint32_t value_bits;          /**< 2, 4, 8, or 16; 2 */
  uint32_t group_size;          /**< quantization group G of keys and values: 16, 32, 64 or
                                     128 (values need head_dim a multiple of G); 32 */
  uint32_t residual_length;     /**< R: tokens kept 16-bit before a flush, a multiple of
                                     group_size; 64 (the presets other than BALANCED: 128) */
  uint32_t reserved_v1_;        /**< the first version's tail padding: ignored (fields are
                                     appended after it) */
  /* ---- appended after the first version (struct_size 104) ---- */
  uint32_t sink_tokens;         /**< S attention sinks: the first S positions of every prompt
                                     are always kept, unquantized (dtype), in every layer and
                                     KV head, counted inside the heavy-hitter budget (the
                                     heavy hitters of a layer are floor(h_l*L) - S, chosen
                                     among the positions after the sinks); a prompt of at
                                     most S tokens keeps all of them as sinks. 0..64; 4 */
  uint32_t prefill_staging_tokens; /**< chunked prefill (minikv_prefill_chunk): the most
                                     prompt tokens that may be in flight at once, summed over
                                     the sequences whose prompt has started but not finished.
                                     Their 16-bit K/V wait, in every layer, in a staging area
                                     reserved at create: num_layers x this x num_kv_heads x
                                     head_dim x 2 (K, V) x dtype bytes, plus the score sums
                                     (num_layers x this x num_heads x 8 B on the CPU, x
                                     num_kv_heads x 4 B on CUDA). At most max_sequences x
                                     max_seq_len. 0 = chunked prefill off: every prompt comes
                                     in one call, nothing is reserved; 0.
                                     This field sits in the first layout's tail padding
                                     (struct_size 104 either way): a library older than it
                                     reads the slot as a reserved field that must be 0 and
                                     rejects a non-zero value (MINIKV_ERR_VERSION_MISMATCH)
                                     instead of ignoring it. */
  /* ---- appended after the second version (struct_size 104) ---- */
  uint32_t flush_tokens;        /**< F: how many tokens a flush quantizes. When the residual
                                     holds residual_length tokens (the new one included),
                                     its oldest F are quantized into the pool and the newest
                                     R - F stay 16-bit, so the last R - F tokens are always
                                     exact (a sliding flush, one every F tokens). Rounded up
                                     to a multiple of group_size, at most residual_length
                                     (any value is valid); 0 = the whole residual at once
                                     (the MiniKV reference, and MINIKV_PRESET_PAPER's).
                                     docs/algorithm.md §4 gives the accuracy a sliding flush
                                     buys. 32 (with residual_length 64). A caller whose struct
                                     ends before this field gets 0 and residual_length 128:
                                     the defaults of the library it was built for. */
  uint32_t reserved_v3_;        /**< tail padding; must be 0 (the slot of a future field:
                                     this library rejects a non-zero value with
                                     MINIKV_ERR_VERSION_MISMATCH instead of ignoring it) */
} minikv_config;

/** Fills the first `struct_size` bytes of `*cfg` with the defaults (see the field
 *  comments; model dimensions are 0 and must be set) and sets cfg->struct_size =
 *  struct_size. Pass sizeof(minikv_config) of *your* header: the library never writes more
 *  than that, so a program built against an older header stays safe when a newer library
 *  appends fields (and a newer header's extra fields are zeroed by an older library, which
 *  minikv_cache_create reads as "not set"). Most code calls the minikv_config_default()
 *  macro below, which passes the size itself.
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL cfg: nothing written);
 *          MINIKV_ERR_VERSION_MISMATCH (struct_size below the first version's size: nothing
 *          written). */
MINIKV_API minikv_status minikv_config_init(minikv_config *cfg, size_t struct_size);

/** The entry point of version 0.1, kept for programs compiled against it: fills the fields
 *  of the first version of minikv_config only (struct_size = that size), so it never
 *  writes past an old caller's struct; later fields take their defaults at create. Source
 *  code reaches minikv_config_init() through the macro below instead. NULL is ignored. */
MINIKV_API void minikv_config_default(minikv_config *cfg);

/** Fills `*cfg` with the defaults for exactly the fields of this header's minikv_config
 *  (zlib's deflateInit pattern: the size is taken where the struct is declared).
 *  Evaluates to a minikv_status (MINIKV_OK unless cfg is NULL). */
#define minikv_config_default(cfg) minikv_config_init((cfg), sizeof(minikv_config))

/** Named compression settings (values pinned, append-only). "Bits per element" counts the
 *  codes plus each group's 16-bit scale and minimum, averaged over keys and values; the
 *  16-bit sink and residual tokens come on top. The budget keeps 50% of each prompt
 *  (heavy_ratio = recent_ratio = 0.25), so the cache is about bits / 32 of an fp16 cache.
 *  The README's Configuration section says why BALANCED is the default; measured accuracy
 *  on a real model is in docs/performance.md. */
typedef enum minikv_preset {
  MINIKV_PRESET_BALANCED = 0,     /**< the default: 4-bit keys, 2-bit values, G = 32, 4 sinks,
                                       PYRAMID depth 7, WINDOW scores (32 queries, pooling
                                       7), a 64-token residual flushed 32 tokens at a time:
                                       4 bits per element (~87% smaller than fp16), the
                                       paper's memory at a fraction of its accuracy cost */
  MINIKV_PRESET_PAPER = 1,        /**< MiniKV exactly: 2-bit keys and values, G = 16, no
                                       sinks, PYRAMID depth 7, CUMULATIVE scores, the whole
                                       128-token residual flushed at once: 4 bits per
                                       element */
  MINIKV_PRESET_QUALITY = 2,      /**< 8-bit keys and values, G = 32, 4 sinks, UNIFORM,
                                       CUMULATIVE: 9 bits per element (~72% smaller);
                                       quantization is near lossless, eviction remains */
  MINIKV_PRESET_EVICTION_ONLY = 3 /**< no quantization (16-bit), no sinks, UNIFORM,
                                       CUMULATIVE: H2O-style eviction alone (50% smaller) */
} minikv_preset;

/** Sets the compression fields of `*cfg` to a named setting: key_bits, value_bits,
 *  group_size, residual_length and flush_tokens (BALANCED: 64 and 32; the others: 128 and
 *  0), sink_tokens, heavy_ratio, recent_ratio, budget_policy, pyramid_depth (7),
 *  score_mode, window_size (32) and pool_kernel (7). A struct_size that ends before
 *  flush_tokens gets residual_length 128 and keeps its (absent) flush_tokens.
 *  Model dimensions, backend, device, dtype and sizes are left as they are, so call it
 *  after minikv_config_default() and before or after setting them.
 *  Writes only those fields, all within cfg->struct_size (which must cover sink_tokens:
 *  initialize with minikv_config_default() of this header or later).
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL cfg, or a preset value this
 *          library does not know: nothing written); MINIKV_ERR_VERSION_MISMATCH
 *          (cfg->struct_size too small to hold sink_tokens: nothing written). */
MINIKV_API minikv_status minikv_config_preset(minikv_config *cfg, minikv_preset preset);

/* ---- the cache handle ------------------------------------------------------------- */
/** Opaque handle: the compressed KV cache of up to max_sequences sequences, all layers. */
typedef struct minikv_cache minikv_cache;

/** CONSTRUCTOR: validates `cfg`, chooses the backend, and reserves the whole block pool
 *  and every workspace: later calls allocate no memory, host or device, when they succeed
 *  (recording a failure's message may).
 *  @param[in]  cfg  configuration; read only during the call.
 *  @param[out] out  receives the handle; set to NULL on failure.
 *  Ownership: the caller owns the handle and frees it with minikv_cache_destroy().
 *  @return MINIKV_OK;
 *          MINIKV_ERR_INVALID_ARGUMENT (NULL cfg/out, or a bad field: the message names the
 *            field and its allowed values);
 *          MINIKV_ERR_VERSION_MISMATCH (cfg->struct_size below the first version's size, or
 *            larger than this library's with non-zero bytes past its end);
 *          MINIKV_ERR_UNSUPPORTED (CUDA requested but not built or no device, or a size
 *            the backend does not compile);
 *          MINIKV_ERR_OUT_OF_MEMORY (also a CPU pool larger than RAM + swap, refused before
 *            anything is allocated); MINIKV_ERR_DEVICE. Every size derived from the config
 *          is computed with overflow checks: one that does not fit (or more than 2^31
 *          blocks, residual slots or block-table entries) is MINIKV_ERR_INVALID_ARGUMENT
 *          naming the fields that cause it. */
MINIKV_API minikv_status minikv_cache_create(const minikv_config *cfg, minikv_cache **out);

/** DESTRUCTOR: frees the pool, the workspaces and the handle. NULL is a no-op. For the CUDA
 *  backend it first waits until the whole device cfg.device_id is idle
 *  (cudaDeviceSynchronize): not only this cache's work but every stream's, other caches'
 *  and the caller's own kernels included. It blocks the calling thread that long; keep it
 *  out of a serving loop. After a device fault (see "Device faults") it frees the host
 *  memory and returns. */
MINIKV_API void minikv_cache_destroy(minikv_cache *cache);

/** METHOD: detail of the last failure of a call on this handle ("" if none). Unlike
 *  minikv_last_error_message() it does not depend on the calling thread (use it from Go,
 *  whose goroutines move between threads). Owned by the handle, valid until the next
 *  failing call on it. NULL handle → a static message saying so. */
MINIKV_API const char *minikv_cache_last_error(const minikv_cache *cache);

/** METHOD: which backend the cache computes with (AUTO resolved to CPU or CUDA at
 *  create), so a caller knows whether tensors must be host or device memory.
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL cache or backend). */
MINIKV_API minikv_status minikv_cache_backend(const minikv_cache *cache, minikv_backend *backend);

/* ---- the compute calls ------------------------------------------------------------ */

/** METHOD: prefill of one layer for a batch of prompts.
 *  For each sequence s (tokens [cu_seqlens[s], cu_seqlens[s+1]) of the packed inputs):
 *  computes causal attention `out = softmax(q k^T / sqrt(head_dim)) v` (GQA: query head h
 *  uses KV head h / (num_heads / num_kv_heads)), scores every prompt token per KV head
 *  (score_mode), keeps the recent window and the heavy hitters of this layer's budget,
 *  and stores them quantized (tail of < group_size tokens in the 16-bit residual).
 *  The selection is final: later tokens are appended, never evicted.
 *  CUDA: on an H100/H200 with the library's sm_90a image the attention runs on warpgroup
 *  MMA, elsewhere on mma.sync, chosen once at minikv_cache_create. Both agree to fp32
 *  rounding, and each is deterministic.
 *  @param layer      in [0, num_layers); each (sequence, layer) is prefilled once.
 *  @param n_seqs     >= 1 sequences in the batch.
 *  @param seq_ids    host [n_seqs], distinct slots in [0, max_sequences).
 *  @param cu_seqlens host [n_seqs+1] prefix sums: cu_seqlens[0] = 0, each prompt length
 *                    cu_seqlens[s+1]-cu_seqlens[s] in [1, max_seq_len].
 *  @param q,k,v,out  backend memory, layouts in the introduction; out is written for every
 *                    prompt token and may not alias the inputs.
 *  @param stream     cudaStream_t or NULL (must be NULL for the CPU backend).
 *  A prompt may also arrive in several calls: minikv_prefill_chunk.
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL pointer, bad id/layer, repeated
 *          seq_id, bad cu_seqlens, a misaligned tensor, a non-finite input with the CPU
 *          backend); MINIKV_ERR_BAD_STATE (a (sequence, layer) already prefilled or
 *          mid-prompt (minikv_prefill_chunk), or the handle in use by another thread's call); MINIKV_ERR_CAPACITY_EXCEEDED (not
 *          enough free blocks for the whole batch); MINIKV_ERR_DEVICE. On failure no
 *          sequence of the batch changes. */
MINIKV_API minikv_status minikv_prefill(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                                        const uint32_t *seq_ids, const int32_t *cu_seqlens,
                                        const void *q, const void *k, const void *v, void *out,
                                        void *stream);

/** METHOD: chunked prefill of one layer: each sequence of the batch gives the next chunk of
 *  its prompt, as engines that split long prompts (or mix prompt and decode tokens in one
 *  step) send them. The result of a prompt sent in any number of chunks of any sizes is the
 *  result of minikv_prefill on the whole prompt: the outputs (CPU: the same values; CUDA:
 *  equal to fp32 rounding, scores summed in a different order), and the kept positions,
 *  the stored bytes, minikv_sequence_length and minikv_memory_stats (identical; on CUDA
 *  where no two scores at the selection boundary are within fp32 rounding of each other).
 *
 *  Chunks. For each sequence s, rows [cu_seqlens[s], cu_seqlens[s+1]) of q/k/v/out are the
 *  prompt positions [p, p + n) of seq_ids[s] in `layer`, where p is the number of tokens
 *  this (sequence, layer) has received so far (chunks come in order; 0 for a new prompt).
 *  The chunk's queries attend causally to every earlier prompt token of the sequence and
 *  to their own chunk; `out` receives their n output rows.
 *  prompt_lens[s] is the length of the whole prompt, the same value at every chunk of it:
 *  the chunk that reaches it is the last. Then, as in minikv_prefill, the prompt is scored
 *  (CUMULATIVE: the column sums over every prompt query, accumulated exactly across chunks;
 *  WINDOW: over the last window_size queries of the whole prompt, known from prompt_lens
 *  whichever chunks they arrive in), selected, quantized into the cache, and the pair is
 *  prefilled: append and decode may follow.
 *  A first chunk that is the whole prompt (n == prompt_lens[s]) is exactly minikv_prefill
 *  and needs no staging; one batch may mix first, middle, last and whole-prompt chunks of
 *  different sequences.
 *
 *  Staging. A prompt that arrives in several chunks keeps its 16-bit K/V (and, for the
 *  score modes that need them, its running score sums) in the layer's staging area, sized
 *  by cfg.prefill_staging_tokens, from its first chunk to its last. The first chunk reserves
 *  prompt_lens[s] contiguous staging rows of the layer and every pool block the finished
 *  prompt will keep, so later chunks of the prompt cannot run out of either. The last chunk
 *  (or minikv_sequence_release) frees the staging rows when the call's work is done, so a
 *  prompt whose first chunk is in the same call cannot take them. A staging area split by
 *  prompts still in flight may refuse a prompt that fits its free total (no contiguous
 *  run): size it with room to spare.
 *
 *  States. Between its first and last chunk a (sequence, layer) is mid-prompt:
 *  minikv_append, minikv_decode and minikv_kept_positions on it fail with
 *  MINIKV_ERR_BAD_STATE, minikv_prefill too, minikv_sequence_length reports 0 and 0, and
 *  minikv_memory_stats counts none of its tokens (its staging is part of workspace_bytes).
 *  A prompt abandoned mid-way is freed by minikv_sequence_release (staging rows and
 *  reserved blocks, every layer); minikv_cache_destroy frees everything.
 *
 *  @param layer, n_seqs, seq_ids, q, k, v, out, stream  as in minikv_prefill.
 *  @param cu_seqlens  host [n_seqs+1] prefix sums of the chunk lengths, each >= 1.
 *  @param prompt_lens host [n_seqs] whole-prompt lengths in [1, max_seq_len], each at least
 *                     p + n (the positions received so far plus this chunk).
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (as minikv_prefill; also a NULL
 *          prompt_lens, a chunk beyond prompt_lens[s], a prompt_lens[s] that differs from
 *          the one of the prompt's first chunk, a first chunk shorter than its prompt when
 *          prefill_staging_tokens is 0, or a prompt longer than prefill_staging_tokens, which
 *          can never be staged); MINIKV_ERR_BAD_STATE (a (sequence, layer) already
 *          prefilled, or the handle in use by another thread's call);
 *          MINIKV_ERR_CAPACITY_EXCEEDED (a first chunk finds no free run of prompt_lens[s]
 *          staging rows, or not enough free pool blocks for what the batch will keep:
 *          finish or release prompts and retry); MINIKV_ERR_DEVICE. On failure no sequence
 *          of the batch changes. Allocates nothing; with CUDA it never synchronizes the host. */
MINIKV_API minikv_status minikv_prefill_chunk(minikv_cache *cache, uint32_t layer,
                                              uint32_t n_seqs, const uint32_t *seq_ids,
                                              const int32_t *cu_seqlens,
                                              const uint32_t *prompt_lens, const void *q,
                                              const void *k, const void *v, void *out,
                                              void *stream);

/** METHOD: appends one new token's K/V (for one layer) to each sequence of the batch. The
 *  token goes to the 16-bit residual; when the residual holds residual_length tokens, its
 *  oldest F (flush_tokens, rounded up to whole groups; all of them for 0) are quantized
 *  into the pool as one flush, before the token's decode (as the reference implementation
 *  does), and the rest move to the front of the residual.
 *  @param k,v  backend memory [n_seqs, num_kv_heads, head_dim].
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (also a misaligned tensor or, with
 *          the CPU backend, a non-finite k/v); MINIKV_ERR_BAD_STATE (layer not prefilled
 *          for a sequence or still mid-prompt (minikv_prefill_chunk), or the handle in use
 *          by another thread's call);
 *          MINIKV_ERR_CAPACITY_EXCEEDED (a flush needs a block
 *          and the pool has none, or a sequence reached max_seq_len); MINIKV_ERR_DEVICE.
 *          On failure no sequence changes. Allocates nothing; with CUDA it never synchronizes
 *          the host (CUDA-graph capturable). */
MINIKV_API minikv_status minikv_append(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                                       const uint32_t *seq_ids, const void *k, const void *v,
                                       void *stream);

/** METHOD: attention of one query token per sequence over that sequence's whole cached
 *  context for `layer` (quantized tokens dequantized inside the kernel, plus the residual),
 *  one softmax over all of them, scale 1/sqrt(head_dim). Append the token first: it then
 *  attends to itself. Reads the cache only.
 *  @param q,out  backend memory [n_seqs, num_heads, head_dim].
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (also a misaligned tensor or, with
 *          the CPU backend, a non-finite q); MINIKV_ERR_BAD_STATE (layer not prefilled or
 *          still mid-prompt (minikv_prefill_chunk), no token cached yet, or the handle in
 *          use by another thread's call);
 *          MINIKV_ERR_DEVICE. Allocates nothing; with CUDA
 *          it never synchronizes the host (CUDA-graph capturable, like minikv_append). */
MINIKV_API minikv_status minikv_decode(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                                       const uint32_t *seq_ids, const void *q, void *out,
                                       void *stream);

/** METHOD: the engine's step for one layer in one call: appends each sequence's new token
 *  K/V, then computes its query's attention over the cache including that token. The
 *  result, in `out` and in the cache, is exactly that of minikv_append(cache, layer, n_seqs,
 *  seq_ids, k, v, stream) followed by minikv_decode(cache, layer, n_seqs, seq_ids, q, out,
 *  stream): bit for bit, with either backend. What it saves is host work and, with CUDA,
 *  the append's own launch: the decode kernels read each new row straight from k and v and
 *  store it as they go, so the call launches what minikv_decode alone would, except where
 *  a sequence's residual becomes full with this token: those sequences are appended (and
 *  flushed) by one launch first.
 *  @param layer      in [0, num_layers), prefilled for every sequence of the batch.
 *  @param n_seqs     >= 1 sequences; seq_ids: host [n_seqs], distinct slots.
 *  @param q,out      backend memory [n_seqs, num_heads, head_dim] (decode's layout).
 *  @param k,v        backend memory [n_seqs, num_kv_heads, head_dim] (append's layout).
 *                    Read only; out may not overlap q, k or v.
 *  @param stream     cudaStream_t or NULL (must be NULL for the CPU backend).
 *  Ownership: every buffer stays the caller's; with CUDA the call is asynchronous and the
 *  buffers must stay valid until the queued work has run. Threading: as every call on a
 *  handle (see "Threading").
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL pointer, bad id or layer, a repeated
 *          seq_id, a misaligned tensor, out overlapping an input, a non-finite q/k/v with
 *          the CPU backend); MINIKV_ERR_BAD_STATE (layer not prefilled for a sequence, or
 *          the handle in use by another thread's call); MINIKV_ERR_CAPACITY_EXCEEDED (a
 *          flush needs a block and the pool has none, or a sequence reached max_seq_len);
 *          MINIKV_ERR_DEVICE. Everything is checked before anything changes: on failure no
 *          sequence changes (no partial append) and out is not written. Allocates nothing;
 *          with CUDA it never synchronizes the host (CUDA-graph capturable). */
MINIKV_API minikv_status minikv_append_decode(minikv_cache *cache, uint32_t layer,
                                              uint32_t n_seqs, const uint32_t *seq_ids,
                                              const void *q, const void *k, const void *v,
                                              void *out, void *stream);

/* ---- sequences -------------------------------------------------------------------- */

/** METHOD: frees every block of sequence `seq_id` (all layers), and the staging rows and
 *  reserved blocks of a prompt still mid-way through minikv_prefill_chunk (the prompt is
 *  abandoned); the slot can then take a new prompt. Releasing an empty slot is a no-op. For CUDA, queue the release after the
 *  work that reads the sequence (same stream, or synchronize first).
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL cache, seq_id >= max_sequences). */
MINIKV_API minikv_status minikv_sequence_release(minikv_cache *cache, uint32_t seq_id);

/** METHOD: positions seen (prompt + appended) and tokens kept in the cache for one
 *  sequence and layer; both 0 for a layer not prefilled. Either output pointer may be
 *  NULL.
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL cache, bad seq_id or layer). */
MINIKV_API minikv_status minikv_sequence_length(const minikv_cache *cache, uint32_t seq_id,
                                                uint32_t layer, uint64_t *tokens_seen,
                                                uint64_t *tokens_cached);

/** METHOD: which prompt positions (0-based, ascending) KV head `kv_head` of `layer` kept
 *  for `seq_id`. Writes min(capacity, total) positions to host array `positions` (may be
 *  NULL when capacity is 0) and always sets *count to the total, so capacity 0 asks for
 *  the size. For CUDA this call synchronizes with the device (it is meant for tests,
 *  debugging and research).
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT; MINIKV_ERR_BAD_STATE (layer not
 *          prefilled); MINIKV_ERR_DEVICE. */
MINIKV_API minikv_status minikv_kept_positions(const minikv_cache *cache, uint32_t seq_id,
                                               uint32_t layer, uint32_t kv_head,
                                               int32_t *positions, uint32_t capacity,
                                               uint32_t *count);

/* ---- memory statistics ------------------------------------------------------------ */
typedef struct minikv_memory_stats {
  uint32_t struct_size;           /**< set by the caller to sizeof(minikv_memory_stats) */
  uint64_t pool_bytes;            /**< reserved for KV storage: blocks + residuals +
                                       position index (device or host) */
  uint64_t used_bytes;            /**< codes + scales/zero-points of quantized tokens +
                                       16-bit tokens (residual, or bits=16 storage) */
  uint64_t workspace_bytes;       /**< scratch reserved for prefill/decode */
  uint64_t tokens_seen;           /**< prompt + appended positions, summed over sequences
                                       and layers */
  uint64_t tokens_cached;         /**< of those, kept in the cache */
  uint64_t fp16_equivalent_bytes; /**< tokens_seen * num_kv_heads * head_dim * 2 (K,V) * 2 B */
  double compression_ratio;       /**< 1 - used_bytes / fp16_equivalent_bytes; 0 when empty */
} minikv_memory_stats;

/** METHOD: fills `out` (which the caller prepares with out->struct_size = sizeof(*out);
 *  the library writes only the fields that size covers). Exact, computed from host
 *  bookkeeping.
 *  @return MINIKV_OK; MINIKV_ERR_INVALID_ARGUMENT (NULL); MINIKV_ERR_VERSION_MISMATCH
 *          (struct_size below the first version's size). */
MINIKV_API minikv_status minikv_memory_stats_get(const minikv_cache *cache,
                                                 minikv_memory_stats *out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MINIKV_H */

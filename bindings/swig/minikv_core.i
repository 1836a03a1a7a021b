/* minikv_core.i — the language-independent SWIG core of libminikv's bindings.
 *
 * A per-language interface file sets `%module` (and, for Java, the exception class and the
 * enum style), then includes this file. What it provides:
 *
 *  - An ALLOWLIST. Everything SWIG sees is ignored (`%ignore ""`), then each reviewed
 *    minikv_* symbol is exposed again by a rename that strips the `minikv_` prefix
 *    (OR-Tools' %ignoreall/%unignore). A symbol added to minikv.h stays hidden from Go and
 *    Java until someone adds it here.
 *  - Proxies for the three structs: CacheHandle (the opaque minikv_cache: no constructor,
 *    its destructor is minikv_cache_destroy), ConfigStruct (constructor = calloc +
 *    minikv_config_default, which passes this header's struct size) and MemoryStatsStruct
 *    (constructor sets struct_size).
 *  - minikv_cache_create returns the new handle (%newobject) instead of writing it through
 *    `minikv_cache **out`; minikv_cache_destroy is %delobject.
 *  - Statuses become native errors INSIDE the wrapper call: the `out` typemap of
 *    minikv_status reads minikv_last_error_message() immediately after the C call, on the
 *    same OS thread. (A Go goroutine can move to another thread between two cgo calls, so
 *    reading the thread-local message in a second call could read another call's text.)
 *      Go:   the function returns `error` (nil or *StatusError{Status, Message}).
 *      Java: the function returns void and throws MINIKV_JAVA_EXCEPTION(int status, String).
 *  - Host index arrays: seq_ids (uint32, with n_seqs taken from the array's length),
 *    cu_seqlens (int32), prompt_lens (uint32) and kept positions (int32, with capacity =
 *    length) as Go slices / Java int[].
 *  - Tensor pointers (q, k, v, out) and the stream as plain addresses: uintptr in Go, long in
 *    Java. Device memory passes through untouched; host memory is the caller's business
 *    (the idiomatic wrappers pin or copy it).
 */

%include <stdint.i>

%{
#include <stdlib.h>
#include <string.h>
#include "minikv.h"
%}

/* ------------------------------------------------------------------------------------
 * Allowlist
 * ---------------------------------------------------------------------------------- */
%ignore "";
%define %minikv_expose(NAME) %rename("%(strip:[minikv_])s") NAME; %enddef
%define %minikv_keep(NAME) %rename("%s") NAME; %enddef

%minikv_expose(minikv_version_number)
%minikv_expose(minikv_version_string)
%minikv_expose(minikv_status_string)
%minikv_expose(minikv_last_error_message)
%minikv_expose(minikv_config_init)
%minikv_expose(minikv_config_preset)
%minikv_expose(minikv_cache_create)
%minikv_expose(minikv_cache_destroy)
%minikv_expose(minikv_cache_last_error)
%minikv_expose(minikv_cache_backend)
%minikv_expose(minikv_prefill)
%minikv_expose(minikv_prefill_chunk)
%minikv_expose(minikv_append)
%minikv_expose(minikv_decode)
%minikv_expose(minikv_append_decode)
%minikv_expose(minikv_sequence_release)
%minikv_expose(minikv_sequence_length)
%minikv_expose(minikv_kept_positions)
%minikv_expose(minikv_memory_stats_get)

/* Version macros: MINIKV_VERSION_NUMBER is the version the binding was generated against,
 * to compare with version_number() of the loaded library. */
%minikv_keep(MINIKV_VERSION_MAJOR)
%minikv_keep(MINIKV_VERSION_MINOR)
%minikv_keep(MINIKV_VERSION_PATCH)
%minikv_keep(MINIKV_VERSION_NUMBER)

/* Enums (pinned values). Java gets no status constants: its typemaps turn minikv_status
 * into void + exception, which would also type these constants; Java's Status enum carries
 * the pinned values instead (tested against status_string). */
#if !defined(SWIGJAVA)
%minikv_keep(minikv_status)
%minikv_keep(MINIKV_OK)
%minikv_keep(MINIKV_ERR_INVALID_ARGUMENT)
%minikv_keep(MINIKV_ERR_OUT_OF_MEMORY)
%minikv_keep(MINIKV_ERR_CAPACITY_EXCEEDED)
%minikv_keep(MINIKV_ERR_BAD_STATE)
%minikv_keep(MINIKV_ERR_UNSUPPORTED)
%minikv_keep(MINIKV_ERR_DEVICE)
%minikv_keep(MINIKV_ERR_VERSION_MISMATCH)
%minikv_keep(MINIKV_ERR_INTERNAL)
#endif
%minikv_keep(minikv_backend)
%minikv_keep(MINIKV_BACKEND_AUTO)
%minikv_keep(MINIKV_BACKEND_CPU)
%minikv_keep(MINIKV_BACKEND_CUDA)
%minikv_keep(minikv_dtype)
%minikv_keep(MINIKV_DTYPE_F16)
%minikv_keep(MINIKV_DTYPE_BF16)
%minikv_keep(MINIKV_DTYPE_F32)
%minikv_keep(minikv_budget_policy)
%minikv_keep(MINIKV_BUDGET_UNIFORM)
%minikv_keep(MINIKV_BUDGET_PYRAMID)
%minikv_keep(minikv_score_mode)
%minikv_keep(MINIKV_SCORE_CUMULATIVE)
%minikv_keep(MINIKV_SCORE_WINDOW)
%minikv_keep(minikv_preset)
%minikv_keep(MINIKV_PRESET_BALANCED)
%minikv_keep(MINIKV_PRESET_PAPER)
%minikv_keep(MINIKV_PRESET_QUALITY)
%minikv_keep(MINIKV_PRESET_EVICTION_ONLY)

/* Structs and their fields, one by one. */
%rename(ConfigStruct) minikv_config;
%minikv_keep(minikv_config::struct_size)
%minikv_keep(minikv_config::backend)
%minikv_keep(minikv_config::device_id)
%minikv_keep(minikv_config::dtype)
%minikv_keep(minikv_config::num_layers)
%minikv_keep(minikv_config::num_heads)
%minikv_keep(minikv_config::num_kv_heads)
%minikv_keep(minikv_config::head_dim)
%minikv_keep(minikv_config::max_sequences)
%minikv_keep(minikv_config::max_seq_len)
%minikv_keep(minikv_config::max_tokens)
%minikv_keep(minikv_config::heavy_ratio)
%minikv_keep(minikv_config::recent_ratio)
%minikv_keep(minikv_config::budget_policy)
%minikv_keep(minikv_config::pyramid_depth)
%minikv_keep(minikv_config::score_mode)
%minikv_keep(minikv_config::window_size)
%minikv_keep(minikv_config::pool_kernel)
%minikv_keep(minikv_config::key_bits)
%minikv_keep(minikv_config::value_bits)
%minikv_keep(minikv_config::group_size)
%minikv_keep(minikv_config::residual_length)
%minikv_keep(minikv_config::sink_tokens)
%minikv_keep(minikv_config::prefill_staging_tokens)
%minikv_keep(minikv_config::flush_tokens)
%rename(ConfigStruct) minikv_config::minikv_config;
%minikv_keep(minikv_config::~minikv_config)

%rename(MemoryStatsStruct) minikv_memory_stats;
%minikv_keep(minikv_memory_stats::struct_size)
%minikv_keep(minikv_memory_stats::pool_bytes)
%minikv_keep(minikv_memory_stats::used_bytes)
%minikv_keep(minikv_memory_stats::workspace_bytes)
%minikv_keep(minikv_memory_stats::tokens_seen)
%minikv_keep(minikv_memory_stats::tokens_cached)
%minikv_keep(minikv_memory_stats::fp16_equivalent_bytes)
%minikv_keep(minikv_memory_stats::compression_ratio)
%rename(MemoryStatsStruct) minikv_memory_stats::minikv_memory_stats;
%minikv_keep(minikv_memory_stats::~minikv_memory_stats)

/* The opaque handle: a proxy without a constructor (only cache_create makes one) whose
 * destructor is minikv_cache_destroy. */
%rename(CacheHandle) minikv_cache;
%minikv_keep(minikv_cache::~minikv_cache)
%nodefaultctor minikv_cache;
%newobject minikv_cache_create;
%delobject minikv_cache_destroy;

/* ------------------------------------------------------------------------------------
 * Struct constructors/destructors. Config and stats are plain heap structs freed by their
 * proxies' destructors.
 * ---------------------------------------------------------------------------------- */
%extend minikv_config {
  minikv_config() {
    minikv_config *cfg = (minikv_config *)calloc(1, sizeof(minikv_config));
    if (cfg) minikv_config_default(cfg);
    return cfg;
  }
  ~minikv_config() { free($self); }
}
%extend minikv_memory_stats {
  minikv_memory_stats() {
    minikv_memory_stats *st = (minikv_memory_stats *)calloc(1, sizeof(minikv_memory_stats));
    if (st) st->struct_size = (uint32_t)sizeof(minikv_memory_stats);
    return st;
  }
  ~minikv_memory_stats() { free($self); }
}
/* SWIG needs a complete type to give the handle a proxy class; C never sees this. */
struct minikv_cache {};
%extend minikv_cache {
  ~minikv_cache() { minikv_cache_destroy($self); }
}

/* ------------------------------------------------------------------------------------
 * Typemaps, per language
 * ---------------------------------------------------------------------------------- */
/* The status typemaps below are for return values; a status passed IN (status_string) is a
 * plain int. */
%apply int { minikv_status status };

#if defined(SWIGGO)

/* minikv_status → error. The C side packs the status and the message read right after the
 * call into one C-allocated Go string: byte 0 = status, byte 1 = 1 when the buffer was
 * malloc'ed (0 for the static fallback used if malloc fails), then the message. OK returns
 * the empty string (no allocation). swigStatusError (below) copies it and frees it. */
%{
static const char minikv_swig_static_errors[9][2] = {
    {0, 0}, {1, 0}, {2, 0}, {3, 0}, {4, 0}, {5, 0}, {6, 0}, {7, 0}, {8, 0}};
%}
%typemap(gotype) minikv_status "error"
%typemap(imtype) minikv_status "string"
%typemap(out) minikv_status %{
  if ($1 == MINIKV_OK) {
    $result.p = NULL;
    $result.n = 0;
  } else {
    const char *msg = minikv_last_error_message();
    const size_t len = strlen(msg);
    char *buf = (char *)malloc(len + 2);
    if (buf) {
      buf[0] = (char)$1;
      buf[1] = 1;
      memcpy(buf + 2, msg, len);
      $result.p = buf;
      $result.n = (intgo)(len + 2);
    } else {
      const unsigned s = (unsigned)$1 < 9 ? (unsigned)$1 : 8;
      $result.p = (char *)minikv_swig_static_errors[s];
      $result.n = 2;
    }
  }
%}
%typemap(goout) minikv_status %{ $result = swigStatusError($1) %}
/* ... but status_string's parameter stays an int (%apply does not reach imtype). */
%typemap(gotype) minikv_status status "int"
%typemap(imtype) minikv_status status "int"

/* Strings returned by the library (version, status and error texts) come back as SWIG's
 * C-allocated copies; swigOwnedString replaces SWIG's swigCopyString, which `go vet`
 * flags (it converts a uintptr to unsafe.Pointer). */
%typemap(goout) char * %{ $result = swigOwnedString($1) %}

%go_import("strings")
%insert(go_wrapper) %{
// StatusError is a failed libminikv call: its minikv_status and the library's message,
// both captured inside the same cgo call as the failure.
type StatusError struct {
	Status  int
	Message string
}

func (e *StatusError) Error() string { return e.Message }

type swigStringHeader struct {
	p uintptr
	n int
}

// swigOwnedString copies a string that SWIG's C code allocated into Go memory and frees
// the C buffer.
func swigOwnedString(s string) string {
	r := strings.Clone(s)
	if p := (*swigStringHeader)(unsafe.Pointer(&s)).p; p != 0 {
		Swig_free(p)
	}
	return r
}

// swigStatusError turns the packed C string of the minikv_status out typemap into nil or a
// *StatusError, freeing the C buffer unless it is the static fallback.
func swigStatusError(s string) error {
	if len(s) == 0 {
		return nil
	}
	b := []byte(s) // a copy in Go memory
	if b[1] == 1 {
		Swig_free((*swigStringHeader)(unsafe.Pointer(&s)).p)
	}
	return &StatusError{Status: int(b[0]), Message: string(b[2:])}
}
%}

/* minikv_cache_create(cfg, &out) → Cache_create(cfg, *CacheHandle) error. The handle comes
 * back through a one-element slice (Go memory C may write to during the call). */
%typemap(gotype) minikv_cache **out "*CacheHandle"
%typemap(imtype) minikv_cache **out "[]uintptr"
%typemap(goin) minikv_cache **out %{ $result = make([]uintptr, 1) %}
%typemap(in) minikv_cache **out (minikv_cache *created = NULL) %{ $1 = &created; %}
%typemap(argout) minikv_cache **out %{
  ((uintptr_t *)$input.array)[0] = (uintptr_t)created$argnum;
%}
%typemap(goargout) minikv_cache **out %{
	if $input[0] != 0 {
		*$1 = SwigcptrCacheHandle($input[0])
	}
%}

/* Host index arrays as slices; n_seqs is the length of seq_ids. */
%typemap(gotype) (uint32_t n_seqs, const uint32_t *seq_ids) "[]uint32"
%typemap(in) (uint32_t n_seqs, const uint32_t *seq_ids) %{
  $2 = (uint32_t *)$input.array;
  $1 = (uint32_t)$input.len;
%}
%typemap(gotype) const int32_t *cu_seqlens "[]int32"
%typemap(in) const int32_t *cu_seqlens %{ $1 = (int32_t *)$input.array; %}
%typemap(gotype) const uint32_t *prompt_lens "[]uint32"
%typemap(in) const uint32_t *prompt_lens %{ $1 = (uint32_t *)$input.array; %}
%typemap(gotype) (int32_t *positions, uint32_t capacity) "[]int32"
%typemap(in) (int32_t *positions, uint32_t capacity) %{
  $1 = (int32_t *)$input.array;
  $2 = (uint32_t)$input.len;
%}
/* Scalar outputs as Go pointers of the exact width (SWIG's default *uint is 8 bytes). */
%typemap(gotype) uint32_t *count "*uint32"
%typemap(gotype) minikv_backend *backend "*int32"
%typemap(gotype) uint64_t *tokens_seen, uint64_t *tokens_cached "*uint64"

/* Tensors and the stream: SWIG's default for void* in Go is already uintptr, passed as an
 * integer (cgo does not inspect it), which is what device addresses need. */

#elif defined(SWIGJAVA)

/* Unsigned fixed-width integers keep their bits in Java's signed types (SWIG's default
 * widens uint32 to long and uint64 to BigInteger). */
%apply int32_t { uint32_t };
%apply int64_t { uint64_t };

%{
#ifndef MINIKV_JAVA_EXCEPTION
#error "define MINIKV_JAVA_EXCEPTION (JNI class name of the exception) before minikv_core.i"
#endif
/* Throws MINIKV_JAVA_EXCEPTION(int status, String message) with this thread's message. */
static void minikv_swig_java_throw(JNIEnv *jenv, minikv_status status) {
  jclass cls;
  jmethodID ctor;
  jstring msg;
  jobject ex;
  if ((*jenv)->ExceptionCheck(jenv)) return;
  cls = (*jenv)->FindClass(jenv, MINIKV_JAVA_EXCEPTION);
  if (!cls) return; /* NoClassDefFoundError is pending */
  ctor = (*jenv)->GetMethodID(jenv, cls, "<init>", "(ILjava/lang/String;)V");
  if (!ctor) return;
  msg = (*jenv)->NewStringUTF(jenv, minikv_last_error_message());
  if (!msg) return;
  ex = (*jenv)->NewObject(jenv, cls, ctor, (jint)status, msg);
  if (ex) (*jenv)->Throw(jenv, (jthrowable)ex);
}
%}

/* minikv_status → void, or a thrown exception. The wrapper does not return early: the
 * exception stays pending while the argout/freearg code releases the Java arrays (the JNI
 * calls used there are allowed with a pending exception, or check for one first). */
%typemap(jni) minikv_status "void"
%typemap(jtype) minikv_status "void"
%typemap(jstype) minikv_status "void"
%typemap(javaout) minikv_status { $jnicall; }
%typemap(out) minikv_status %{
  if ($1 != MINIKV_OK) minikv_swig_java_throw(jenv, $1);
%}

/* minikv_cache_create(cfg, &out) → CacheHandle cache_create(ConfigStruct cfg), owning. */
%typemap(in, numinputs=0) minikv_cache **out (minikv_cache *created = NULL) %{ $1 = &created; %}
%typemap(jni) minikv_status minikv_cache_create "jlong"
%typemap(jtype) minikv_status minikv_cache_create "long"
%typemap(jstype) minikv_status minikv_cache_create "CacheHandle"
%typemap(javaout) minikv_status minikv_cache_create {
    return new CacheHandle($jnicall, true);
  }
%typemap(out) minikv_status minikv_cache_create %{
  if ($1 != MINIKV_OK) {
    minikv_swig_java_throw(jenv, $1);
  } else {
    *(minikv_cache **)&$result = *arg2; /* arg2 is the minikv_cache **out above */
  }
%}

/* Host index arrays as int[] (uint32 bits in Java ints); n_seqs is seq_ids.length.
 * `in` only validates (throwing returns at once, so nothing may be held yet); `check`, which
 * runs after every `in`, pins the arrays; `freearg` releases them. */
%typemap(jni) (uint32_t n_seqs, const uint32_t *seq_ids) "jintArray"
%typemap(jtype) (uint32_t n_seqs, const uint32_t *seq_ids) "int[]"
%typemap(jstype) (uint32_t n_seqs, const uint32_t *seq_ids) "int[]"
%typemap(javain) (uint32_t n_seqs, const uint32_t *seq_ids) "$javainput"
%typemap(in) (uint32_t n_seqs, const uint32_t *seq_ids) (jintArray ids_array = NULL) %{
  if (!$input) {
    SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "seq_ids is null");
    return $null;
  }
  ids_array = $input;
  $1 = (uint32_t)(*jenv)->GetArrayLength(jenv, $input);
  $2 = NULL;
%}
%typemap(check) (uint32_t n_seqs, const uint32_t *seq_ids) %{
  $2 = (uint32_t *)(*jenv)->GetIntArrayElements(jenv, ids_array$argnum, NULL);
  if (!$2) return $null; /* OutOfMemoryError pending */
%}
%typemap(freearg) (uint32_t n_seqs, const uint32_t *seq_ids) %{
  if ($2) (*jenv)->ReleaseIntArrayElements(jenv, $input, (jint *)$2, JNI_ABORT);
%}

/* cu_seqlens: the library reads n_seqs + 1 entries, so a different length is refused here
 * (arg3 is n_seqs of minikv_prefill, set by the seq_ids typemap before this one runs). */
%typemap(jni) const int32_t *cu_seqlens "jintArray"
%typemap(jtype) const int32_t *cu_seqlens "int[]"
%typemap(jstype) const int32_t *cu_seqlens "int[]"
%typemap(javain) const int32_t *cu_seqlens "$javainput"
%typemap(in) const int32_t *cu_seqlens (jintArray cu_array = NULL) %{
  if (!$input) {
    SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "cu_seqlens is null");
    return $null;
  }
  if ((uint64_t)(*jenv)->GetArrayLength(jenv, $input) != (uint64_t)arg3 + 1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                            "cu_seqlens must have seq_ids.length + 1 entries");
    return $null;
  }
  cu_array = $input;
  $1 = NULL;
%}
%typemap(check) const int32_t *cu_seqlens %{
  $1 = (int32_t *)(*jenv)->GetIntArrayElements(jenv, cu_array$argnum, NULL);
  if (!$1) return $null;
%}
%typemap(freearg) const int32_t *cu_seqlens %{
  if ($1) (*jenv)->ReleaseIntArrayElements(jenv, $input, (jint *)$1, JNI_ABORT);
%}

/* prompt_lens (minikv_prefill_chunk): n_seqs entries (arg3, as for cu_seqlens). */
%typemap(jni) const uint32_t *prompt_lens "jintArray"
%typemap(jtype) const uint32_t *prompt_lens "int[]"
%typemap(jstype) const uint32_t *prompt_lens "int[]"
%typemap(javain) const uint32_t *prompt_lens "$javainput"
%typemap(in) const uint32_t *prompt_lens (jintArray lens_array = NULL) %{
  if (!$input) {
    SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "prompt_lens is null");
    return $null;
  }
  if ((uint64_t)(*jenv)->GetArrayLength(jenv, $input) != (uint64_t)arg3) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                            "prompt_lens must have seq_ids.length entries");
    return $null;
  }
  lens_array = $input;
  $1 = NULL;
%}
%typemap(check) const uint32_t *prompt_lens %{
  $1 = (uint32_t *)(*jenv)->GetIntArrayElements(jenv, lens_array$argnum, NULL);
  if (!$1) return $null;
%}
%typemap(freearg) const uint32_t *prompt_lens %{
  if ($1) (*jenv)->ReleaseIntArrayElements(jenv, $input, (jint *)$1, JNI_ABORT);
%}

/* Kept positions: an int[] (may be null: capacity 0) the library writes into. */
%typemap(jni) (int32_t *positions, uint32_t capacity) "jintArray"
%typemap(jtype) (int32_t *positions, uint32_t capacity) "int[]"
%typemap(jstype) (int32_t *positions, uint32_t capacity) "int[]"
%typemap(javain) (int32_t *positions, uint32_t capacity) "$javainput"
%typemap(in) (int32_t *positions, uint32_t capacity) (jintArray pos_array = NULL) %{
  pos_array = $input;
  $1 = NULL;
  $2 = $input ? (uint32_t)(*jenv)->GetArrayLength(jenv, $input) : 0;
%}
%typemap(check) (int32_t *positions, uint32_t capacity) %{
  if (pos_array$argnum) {
    $1 = (int32_t *)(*jenv)->GetIntArrayElements(jenv, pos_array$argnum, NULL);
    if (!$1) return $null;
  }
%}
%typemap(freearg) (int32_t *positions, uint32_t capacity) %{
  if ($1) (*jenv)->ReleaseIntArrayElements(jenv, $input, (jint *)$1, 0); /* copy back */
%}

/* Scalar outputs as one-element arrays, written only when the call succeeded. */
%typemap(jni) uint32_t *count "jintArray"
%typemap(jtype) uint32_t *count "int[]"
%typemap(jstype) uint32_t *count "int[]"
%typemap(javain) uint32_t *count "$javainput"
%typemap(in) uint32_t *count (uint32_t count_value = 0) %{
  if (!$input || (*jenv)->GetArrayLength(jenv, $input) < 1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "count must be int[1]");
    return $null;
  }
  $1 = &count_value;
%}
%typemap(argout) uint32_t *count %{
  if (!(*jenv)->ExceptionCheck(jenv)) {
    jint v = (jint)*$1;
    (*jenv)->SetIntArrayRegion(jenv, $input, 0, 1, &v);
  }
%}
/* (One typemap per name: SWIG would share one temporary between the two.) */
%typemap(jni) minikv_backend *backend "jintArray"
%typemap(jtype) minikv_backend *backend "int[]"
%typemap(jstype) minikv_backend *backend "int[]"
%typemap(javain) minikv_backend *backend "$javainput"
%typemap(in) minikv_backend *backend (minikv_backend backend_value = MINIKV_BACKEND_AUTO) %{
  if (!$input || (*jenv)->GetArrayLength(jenv, $input) < 1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "backend must be int[1]");
    return $null;
  }
  $1 = &backend_value;
%}
%typemap(argout) minikv_backend *backend %{
  if (!(*jenv)->ExceptionCheck(jenv)) {
    jint v = (jint)*$1;
    (*jenv)->SetIntArrayRegion(jenv, $input, 0, 1, &v);
  }
%}
%define %minikv_java_long_out(NAME)
%typemap(jni) uint64_t *NAME "jlongArray"
%typemap(jtype) uint64_t *NAME "long[]"
%typemap(jstype) uint64_t *NAME "long[]"
%typemap(javain) uint64_t *NAME "$javainput"
%typemap(in) uint64_t *NAME (uint64_t NAME##_value = 0) %{
  $1 = NULL;
  if ($input) {
    if ((*jenv)->GetArrayLength(jenv, $input) < 1) {
      SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "expected long[1]");
      return $null;
    }
    $1 = &NAME##_value;
  }
%}
%typemap(argout) uint64_t *NAME %{
  if ($1 && !(*jenv)->ExceptionCheck(jenv)) {
    jlong v = (jlong)*$1;
    (*jenv)->SetLongArrayRegion(jenv, $input, 0, 1, &v);
  }
%}
%enddef
%minikv_java_long_out(tokens_seen)
%minikv_java_long_out(tokens_cached)

/* Tensors and the stream as addresses (long). */
%typemap(jni) const void *, void * "jlong"
%typemap(jtype) const void *, void * "long"
%typemap(jstype) const void *, void * "long"
%typemap(javain) const void *, void * "$javainput"
%typemap(in) const void *, void * %{ $1 = ($1_ltype)(intptr_t)$input; %}

#else
#error "minikv_core.i: add the typemaps for this target language"
#endif

/* ------------------------------------------------------------------------------------
 * The contract itself, parsed from the public header (what is not allowlisted above stays
 * ignored).
 * ---------------------------------------------------------------------------------- */
%include "minikv.h"

package dev.minikv;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Objects;

/**
 * A libminikv cache: the KV cache of up to maxSequences sequences, all layers, compressed with
 * the MiniKV method (arXiv 2411.18077) — per layer and KV head a recent window plus the prompt
 * tokens that received the most attention, quantized to 2 (or 4) bits, with decode attention
 * computed over the compressed cache.
 *
 * <pre>{@code
 * Config cfg = Config.builder().backend(Backend.CPU).dtype(Dtype.F32)
 *     .numLayers(32).numHeads(32).numKvHeads(8).headDim(128).build();
 * try (KvCache cache = new KvCache(cfg)) {
 *   cache.prefill(layer, seqIds, cuSeqlens, q, k, v, out);   // per layer
 *   cache.append(layer, seqIds, k1, v1);                      // per token and layer
 *   cache.decode(layer, seqIds, q1, out1);
 * }
 * }</pre>
 *
 * <p>Memory. With {@link Backend#CPU} tensors are host memory: {@code float[]} for {@link
 * Dtype#F32}, raw 16-bit patterns in {@code short[]} for F16/BF16 (see {@link Half}) — both
 * copied through direct scratch buffers — or direct {@link ByteBuffer}s in native byte order
 * (no copy; the bytes from position() to limit()). With {@link Backend#CUDA} use the {@code
 * *Device} methods: device addresses and a {@code cudaStream_t} as {@code long} (0 = legacy
 * default stream); those calls are asynchronous and the buffers must outlive the queued work.
 * Layouts are dense, row-major, tokens-major: prefill q/out {@code [totalTokens, numHeads,
 * headDim]}, k/v {@code [totalTokens, numKvHeads, headDim]}; append k/v {@code [n, numKvHeads,
 * headDim]}; decode q/out {@code [n, numHeads, headDim]}, with n = seqIds.length. Sequence ids
 * are unsigned 32-bit values carried in Java ints.
 *
 * <p>Errors. Failed calls throw {@link MinikvException} with the library's {@link Status} and
 * message; the cache is then unchanged. Methods are synchronized: one call at a time per cache.
 * {@link #close()} frees the native memory (there is no finalizer: use try-with-resources); it
 * is idempotent, and every other method of a closed cache throws {@link Status#BAD_STATE}.
 */
public final class KvCache implements AutoCloseable {
  private final Config config;
  private final Backend backend; // the backend in use (AUTO resolved at creation)
  private CacheHandle handle; // null once closed
  private final ByteBuffer[] scratch = new ByteBuffer[4]; // q, k, v, out copies of arrays

  /**
   * Validates the configuration, reserves the whole block pool and workspaces.
   *
   * @throws MinikvException INVALID_ARGUMENT naming a bad field; UNSUPPORTED; OUT_OF_MEMORY
   */
  public KvCache(Config config) {
    this.config = Objects.requireNonNull(config, "config");
    if (!compatible(BINDING_VERSION_NUMBER, versionNumber())) {
      throw new MinikvException(Status.VERSION_MISMATCH, "the loaded libminikv is version "
          + version() + ", the binding needs " + MinikvNativeConstants.MINIKV_VERSION_MAJOR
          + ".x, at least " + MinikvNativeConstants.MINIKV_VERSION_MAJOR + "."
          + MinikvNativeConstants.MINIKV_VERSION_MINOR + "."
          + MinikvNativeConstants.MINIKV_VERSION_PATCH);
    }
    ConfigStruct c = config.toNative();
    try {
      handle = MinikvNative.cache_create(c);
    } finally {
      c.delete();
    }
    int[] resolved = new int[1];
    try {
      MinikvNative.cache_backend(handle, resolved);
    } catch (RuntimeException e) {
      handle.delete();
      throw e;
    }
    backend = Backend.fromCode(resolved[0]);
  }

  /**
   * The version of minikv.h this binding was built against, counted as {@link #versionNumber()}
   * counts (major*10000 + minor*100 + patch).
   */
  public static final int BINDING_VERSION_NUMBER = MinikvNativeConstants.MINIKV_VERSION_NUMBER;

  /**
   * libminikv's version rule (MINIKV_VERSION_COMPATIBLE in minikv.h): a library serves a binding
   * built against version {@code built} when it has the same major version and is not older.
   */
  static boolean compatible(int built, int loaded) {
    return loaded / 10000 == built / 10000 && loaded >= built;
  }

  /** The loaded library's version, "MAJOR.MINOR.PATCH". */
  public static String version() {
    return MinikvNative.version_string();
  }

  /** The loaded library's major*10000 + minor*100 + patch. */
  public static int versionNumber() {
    return MinikvNative.version_number();
  }

  /** The library's text for a status code (static, e.g. "MINIKV_ERR_BAD_STATE: ..."). */
  public static String statusString(int code) {
    return MinikvNative.status_string(code);
  }

  /** The configuration the cache was created with. */
  public Config config() {
    return config;
  }

  /**
   * The backend the cache computes with: AUTO resolved to CPU (arrays and ByteBuffers) or
   * CUDA (the {@code *Device} methods).
   */
  public Backend backend() {
    return backend;
  }

  /**
   * Frees the pool, workspaces and handle (for CUDA after the work queued by this cache).
   * Idempotent.
   */
  @Override
  public synchronized void close() {
    if (handle != null) {
      handle.delete(); // minikv_cache_destroy
      handle = null;
      java.util.Arrays.fill(scratch, null);
    }
  }

  /** Whether {@link #close()} was called. */
  public synchronized boolean isClosed() {
    return handle == null;
  }

  // ---- float[] (F32) -----------------------------------------------------------------------

  /**
   * Prefill of one layer for a batch of prompts packed back to back: sequence i (slot
   * seqIds[i]) owns tokens [cuSeqlens[i], cuSeqlens[i+1]). Writes the causal attention output
   * of every prompt token to out, scores the tokens, keeps the recent window and heavy hitters,
   * and stores them quantized. F32 caches; CPU backend.
   */
  public synchronized void prefill(int layer, int[] seqIds, int[] cuSeqlens, float[] q,
      float[] k, float[] v, float[] out) {
    prefillHost("prefill", layer, seqIds, null, cuSeqlens, q, k, v, out);
  }

  /**
   * Chunked prefill ({@code minikv_prefill_chunk}): the next chunk of each sequence's prompt.
   * The rows of sequence i are the prompt positions that follow those already sent for
   * (seqIds[i], layer); promptLens[i] is the length of its whole prompt (the same at every
   * chunk), and the chunk that reaches it completes the prompt as one {@code prefill} would.
   * Prompts in more than one chunk need {@link Config#prefillStagingTokens()}. A sequence
   * mid-prompt refuses append and decode; {@link #release(int)} abandons its prompt.
   */
  public synchronized void prefillChunk(int layer, int[] seqIds, int[] promptLens,
      int[] cuSeqlens, float[] q, float[] k, float[] v, float[] out) {
    prefillHost("prefillChunk", layer, seqIds, lens("prefillChunk", seqIds, promptLens),
        cuSeqlens, q, k, v, out);
  }

  private void prefillHost(String method, int layer, int[] seqIds, int[] promptLens,
      int[] cuSeqlens, float[] q, float[] k, float[] v, float[] out) {
    int tokens = hostPrompt(method, Dtype.F32, seqIds, cuSeqlens);
    checkLen(method, "q", q.length, tokens * qRow());
    checkLen(method, "k", k.length, tokens * kvRow());
    checkLen(method, "v", v.length, tokens * kvRow());
    checkLen(method, "out", out.length, tokens * qRow());
    prefillNative(layer, seqIds, promptLens, cuSeqlens, put(0, q), put(1, k), put(2, v),
        address(scratch(3, out.length * 4)), 0);
    scratch[3].asFloatBuffer().get(out);
  }

  /**
   * Appends one new token's K/V (for one layer) to each sequence: k, v are [seqIds.length,
   * numKvHeads, headDim]. When a residual becomes full (residualLength tokens), its oldest
   * flushTokens (rounded up to whole groups; all of them for 0) are quantized as one flush.
   */
  public synchronized void append(int layer, int[] seqIds, float[] k, float[] v) {
    hostCall("append", Dtype.F32, seqIds);
    checkLen("append", "k", k.length, seqIds.length * kvRow());
    checkLen("append", "v", v.length, seqIds.length * kvRow());
    MinikvNative.append(handle, layer, seqIds, put(1, k), put(2, v), 0);
  }

  /**
   * Attention of one query token per sequence over its whole cached context for layer: q, out
   * are [seqIds.length, numHeads, headDim]. Append the token's K/V first (it attends to itself).
   */
  public synchronized void decode(int layer, int[] seqIds, float[] q, float[] out) {
    hostCall("decode", Dtype.F32, seqIds);
    checkLen("decode", "q", q.length, seqIds.length * qRow());
    checkLen("decode", "out", out.length, seqIds.length * qRow());
    MinikvNative.decode(handle, layer, seqIds, put(0, q), address(scratch(3, out.length * 4)), 0);
    scratch[3].asFloatBuffer().get(out);
  }

  /**
   * The engine's step for one layer in one call: {@code append(layer, seqIds, k, v)} then
   * {@code decode(layer, seqIds, q, out)}, with the same result bit for bit, checked as one
   * call (a failure appends nothing and leaves out unwritten).
   */
  public synchronized void appendDecode(int layer, int[] seqIds, float[] q, float[] k, float[] v,
      float[] out) {
    hostCall("appendDecode", Dtype.F32, seqIds);
    checkLen("appendDecode", "q", q.length, seqIds.length * qRow());
    checkLen("appendDecode", "k", k.length, seqIds.length * kvRow());
    checkLen("appendDecode", "v", v.length, seqIds.length * kvRow());
    checkLen("appendDecode", "out", out.length, seqIds.length * qRow());
    MinikvNative.append_decode(handle, layer, seqIds, put(0, q), put(1, k), put(2, v),
        address(scratch(3, out.length * 4)), 0);
    scratch[3].asFloatBuffer().get(out);
  }

  // ---- short[] (F16 / BF16 bit patterns) ---------------------------------------------------

  /** {@link #prefill(int, int[], int[], float[], float[], float[], float[])} for F16/BF16. */
  public synchronized void prefill(int layer, int[] seqIds, int[] cuSeqlens, short[] q,
      short[] k, short[] v, short[] out) {
    prefillHost("prefill", layer, seqIds, null, cuSeqlens, q, k, v, out);
  }

  /** {@link #prefillChunk(int, int[], int[], int[], float[], float[], float[], float[])} for F16/BF16. */
  public synchronized void prefillChunk(int layer, int[] seqIds, int[] promptLens,
      int[] cuSeqlens, short[] q, short[] k, short[] v, short[] out) {
    prefillHost("prefillChunk", layer, seqIds, lens("prefillChunk", seqIds, promptLens),
        cuSeqlens, q, k, v, out);
  }

  private void prefillHost(String method, int layer, int[] seqIds, int[] promptLens,
      int[] cuSeqlens, short[] q, short[] k, short[] v, short[] out) {
    int tokens = hostPrompt(method, null, seqIds, cuSeqlens);
    checkLen(method, "q", q.length, tokens * qRow());
    checkLen(method, "k", k.length, tokens * kvRow());
    checkLen(method, "v", v.length, tokens * kvRow());
    checkLen(method, "out", out.length, tokens * qRow());
    prefillNative(layer, seqIds, promptLens, cuSeqlens, put(0, q), put(1, k), put(2, v),
        address(scratch(3, out.length * 2)), 0);
    scratch[3].asShortBuffer().get(out);
  }

  /** {@link #append(int, int[], float[], float[])} for F16/BF16. */
  public synchronized void append(int layer, int[] seqIds, short[] k, short[] v) {
    hostCall("append", null, seqIds);
    checkLen("append", "k", k.length, seqIds.length * kvRow());
    checkLen("append", "v", v.length, seqIds.length * kvRow());
    MinikvNative.append(handle, layer, seqIds, put(1, k), put(2, v), 0);
  }

  /** {@link #decode(int, int[], float[], float[])} for F16/BF16. */
  public synchronized void decode(int layer, int[] seqIds, short[] q, short[] out) {
    hostCall("decode", null, seqIds);
    checkLen("decode", "q", q.length, seqIds.length * qRow());
    checkLen("decode", "out", out.length, seqIds.length * qRow());
    MinikvNative.decode(handle, layer, seqIds, put(0, q), address(scratch(3, out.length * 2)), 0);
    scratch[3].asShortBuffer().get(out);
  }

  /** {@link #appendDecode(int, int[], float[], float[], float[], float[])} for F16/BF16. */
  public synchronized void appendDecode(int layer, int[] seqIds, short[] q, short[] k, short[] v,
      short[] out) {
    hostCall("appendDecode", null, seqIds);
    checkLen("appendDecode", "q", q.length, seqIds.length * qRow());
    checkLen("appendDecode", "k", k.length, seqIds.length * kvRow());
    checkLen("appendDecode", "v", v.length, seqIds.length * kvRow());
    checkLen("appendDecode", "out", out.length, seqIds.length * qRow());
    MinikvNative.append_decode(handle, layer, seqIds, put(0, q), put(1, k), put(2, v),
        address(scratch(3, out.length * 2)), 0);
    scratch[3].asShortBuffer().get(out);
  }

  // ---- direct ByteBuffers (any dtype, no copy) ----------------------------------------------

  /** Prefill from direct buffers in native order holding exactly the tensor's bytes. */
  public synchronized void prefill(int layer, int[] seqIds, int[] cuSeqlens, ByteBuffer q,
      ByteBuffer k, ByteBuffer v, ByteBuffer out) {
    prefillHost("prefill", layer, seqIds, null, cuSeqlens, q, k, v, out);
  }

  /** Chunked prefill from direct buffers (see the float[] overload). */
  public synchronized void prefillChunk(int layer, int[] seqIds, int[] promptLens,
      int[] cuSeqlens, ByteBuffer q, ByteBuffer k, ByteBuffer v, ByteBuffer out) {
    prefillHost("prefillChunk", layer, seqIds, lens("prefillChunk", seqIds, promptLens),
        cuSeqlens, q, k, v, out);
  }

  private void prefillHost(String method, int layer, int[] seqIds, int[] promptLens,
      int[] cuSeqlens, ByteBuffer q, ByteBuffer k, ByteBuffer v, ByteBuffer out) {
    int tokens = hostPrompt(method, config.dtype(), seqIds, cuSeqlens);
    int e = config.dtype().bytes();
    prefillNative(layer, seqIds, promptLens, cuSeqlens,
        direct(method, "q", q, tokens * qRow() * e), direct(method, "k", k, tokens * kvRow() * e),
        direct(method, "v", v, tokens * kvRow() * e), writable(method, "out", out, tokens * qRow() * e), 0);
  }

  /** Append from direct buffers. */
  public synchronized void append(int layer, int[] seqIds, ByteBuffer k, ByteBuffer v) {
    hostCall("append", config.dtype(), seqIds);
    int bytes = seqIds.length * kvRow() * config.dtype().bytes();
    MinikvNative.append(handle, layer, seqIds, direct("append", "k", k, bytes),
        direct("append", "v", v, bytes), 0);
  }

  /** Decode into a direct buffer. */
  public synchronized void decode(int layer, int[] seqIds, ByteBuffer q, ByteBuffer out) {
    hostCall("decode", config.dtype(), seqIds);
    int bytes = seqIds.length * qRow() * config.dtype().bytes();
    MinikvNative.decode(handle, layer, seqIds, direct("decode", "q", q, bytes),
        writable("decode", "out", out, bytes), 0);
  }

  /** Append + decode from and into direct buffers (out may not overlap an input). */
  public synchronized void appendDecode(int layer, int[] seqIds, ByteBuffer q, ByteBuffer k,
      ByteBuffer v, ByteBuffer out) {
    hostCall("appendDecode", config.dtype(), seqIds);
    int e = config.dtype().bytes();
    int qBytes = seqIds.length * qRow() * e, kvBytes = seqIds.length * kvRow() * e;
    MinikvNative.append_decode(handle, layer, seqIds, direct("appendDecode", "q", q, qBytes),
        direct("appendDecode", "k", k, kvBytes), direct("appendDecode", "v", v, kvBytes),
        writable("appendDecode", "out", out, qBytes), 0);
  }

  // ---- device memory (CUDA) ------------------------------------------------------------------

  /**
   * Prefill with device addresses (elements of config().dtype()) and a cudaStream_t (0 =
   * legacy default stream). Asynchronous; sizes cannot be checked here.
   */
  public synchronized void prefillDevice(int layer, int[] seqIds, int[] cuSeqlens, long q, long k,
      long v, long out, long stream) {
    open("prefillDevice");
    prompt("prefillDevice", seqIds, cuSeqlens);
    MinikvNative.prefill(handle, layer, seqIds, cuSeqlens, q, k, v, out, stream);
  }

  /** Chunked prefill with device addresses and a stream (asynchronous). */
  public synchronized void prefillChunkDevice(int layer, int[] seqIds, int[] promptLens,
      int[] cuSeqlens, long q, long k, long v, long out, long stream) {
    open("prefillChunkDevice");
    prompt("prefillChunkDevice", seqIds, cuSeqlens);
    prefillNative(layer, seqIds, lens("prefillChunkDevice", seqIds, promptLens), cuSeqlens, q,
        k, v, out, stream);
  }

  /** Append with device addresses and a stream (asynchronous). */
  public synchronized void appendDevice(int layer, int[] seqIds, long k, long v, long stream) {
    open("appendDevice");
    Objects.requireNonNull(seqIds, "seqIds");
    MinikvNative.append(handle, layer, seqIds, k, v, stream);
  }

  /** Decode with device addresses and a stream (asynchronous). */
  public synchronized void decodeDevice(int layer, int[] seqIds, long q, long out, long stream) {
    open("decodeDevice");
    Objects.requireNonNull(seqIds, "seqIds");
    MinikvNative.decode(handle, layer, seqIds, q, out, stream);
  }

  /**
   * Append + decode with device addresses and a stream (asynchronous): with CUDA one kernel
   * launch where no sequence's residual becomes full with this token.
   */
  public synchronized void appendDecodeDevice(int layer, int[] seqIds, long q, long k, long v,
      long out, long stream) {
    open("appendDecodeDevice");
    Objects.requireNonNull(seqIds, "seqIds");
    MinikvNative.append_decode(handle, layer, seqIds, q, k, v, out, stream);
  }

  // ---- sequences and statistics ------------------------------------------------------------

  /**
   * Frees every block of a sequence (all layers), and the staging of a prompt still mid-way
   * through {@code prefillChunk}; the slot can take a new prompt.
   */
  public synchronized void release(int seqId) {
    open("release");
    MinikvNative.sequence_release(handle, seqId);
  }

  /** Positions seen and tokens kept for one sequence and layer (0, 0 if not prefilled). */
  public synchronized SequenceLength sequenceLength(int seqId, int layer) {
    open("sequenceLength");
    long[] seen = new long[1];
    long[] cached = new long[1];
    MinikvNative.sequence_length(handle, seqId, layer, seen, cached);
    return new SequenceLength(seen[0], cached[0]);
  }

  /** Prompt positions (ascending) that KV head kvHead of layer kept for seqId. */
  public synchronized int[] keptPositions(int seqId, int layer, int kvHead) {
    open("keptPositions");
    int[] count = new int[1];
    MinikvNative.kept_positions(handle, seqId, layer, kvHead, null, count);
    int[] positions = new int[count[0]];
    if (count[0] > 0) {
      MinikvNative.kept_positions(handle, seqId, layer, kvHead, positions, count);
    }
    return positions;
  }

  /** The cache's memory statistics. */
  public synchronized MemoryStats memoryStats() {
    open("memoryStats");
    MemoryStatsStruct st = new MemoryStatsStruct(); // sets struct_size
    try {
      MinikvNative.memory_stats_get(handle, st);
      return new MemoryStats(st.getPool_bytes(), st.getUsed_bytes(), st.getWorkspace_bytes(),
          st.getTokens_seen(), st.getTokens_cached(), st.getFp16_equivalent_bytes(),
          st.getCompression_ratio());
    } finally {
      st.delete();
    }
  }

  // ---- internals ---------------------------------------------------------------------------

  private int qRow() {
    return config.numHeads() * config.headDim();
  }

  private int kvRow() {
    return config.numKvHeads() * config.headDim();
  }

  private void open(String method) {
    if (handle == null) {
      throw new MinikvException(Status.BAD_STATE, "KvCache." + method + ": the cache is closed");
    }
  }

  private static MinikvException invalid(String message) {
    return new MinikvException(Status.INVALID_ARGUMENT, message);
  }

  /** cuSeqlens must have seqIds.length + 1 entries (the library reads that many). */
  private static int prompt(String method, int[] seqIds, int[] cuSeqlens) {
    Objects.requireNonNull(seqIds, "seqIds");
    Objects.requireNonNull(cuSeqlens, "cuSeqlens");
    if (cuSeqlens.length != seqIds.length + 1) {
      throw invalid("KvCache." + method + ": cuSeqlens has " + cuSeqlens.length
          + " entries, want seqIds.length + 1 = " + (seqIds.length + 1));
    }
    return Math.max(0, cuSeqlens[seqIds.length]);
  }

  /** promptLens must have seqIds.length entries (the library reads that many). */
  private static int[] lens(String method, int[] seqIds, int[] promptLens) {
    Objects.requireNonNull(seqIds, "seqIds");
    Objects.requireNonNull(promptLens, "promptLens");
    if (promptLens.length != seqIds.length) {
      throw invalid("KvCache." + method + ": promptLens has " + promptLens.length
          + " entries, want seqIds.length = " + seqIds.length);
    }
    return promptLens;
  }

  /** minikv_prefill, or minikv_prefill_chunk when promptLens is not null. */
  private void prefillNative(int layer, int[] seqIds, int[] promptLens, int[] cuSeqlens, long q,
      long k, long v, long out, long stream) {
    if (promptLens == null) {
      MinikvNative.prefill(handle, layer, seqIds, cuSeqlens, q, k, v, out, stream);
    } else {
      MinikvNative.prefill_chunk(handle, layer, seqIds, cuSeqlens, promptLens, q, k, v, out, stream);
    }
  }

  /** Host calls: open, CPU backend, the array type matches the dtype (null = 16-bit). */
  private void hostCall(String method, Dtype arrayDtype, int[] seqIds) {
    open(method);
    Objects.requireNonNull(seqIds, "seqIds");
    if (backend != Backend.CPU) {
      throw invalid("KvCache." + method + ": host memory needs the CPU backend (this cache "
          + "computes on " + backend + "); use " + method + "Device for device memory");
    }
    boolean wants16 = config.dtype() != Dtype.F32;
    if (arrayDtype == null ? !wants16 : (arrayDtype == Dtype.F32 && wants16)) {
      throw invalid("KvCache." + method + ": the cache's dtype is " + config.dtype() + "; use "
          + (wants16 ? "short[] (16-bit patterns)" : "float[]") + " or direct ByteBuffers");
    }
  }

  private int hostPrompt(String method, Dtype arrayDtype, int[] seqIds, int[] cuSeqlens) {
    hostCall(method, arrayDtype, seqIds);
    int tokens = prompt(method, seqIds, cuSeqlens);
    long widest = (long) tokens * Math.max(qRow(), kvRow()) * config.dtype().bytes();
    if (widest > Integer.MAX_VALUE) {
      throw invalid("KvCache." + method + ": " + tokens + " tokens do not fit Java arrays; use "
          + "several calls or device memory");
    }
    return tokens;
  }

  private static void checkLen(String method, String name, int got, int want) {
    if (got != want) {
      throw invalid("KvCache." + method + ": " + name + " has " + got + " elements, want " + want);
    }
  }

  private ByteBuffer scratch(int slot, int bytes) {
    ByteBuffer b = scratch[slot];
    if (b == null || b.capacity() < bytes) {
      b = ByteBuffer.allocateDirect(Math.max(bytes, 256)).order(ByteOrder.nativeOrder());
      scratch[slot] = b;
    }
    b.clear();
    b.limit(bytes);
    return b;
  }

  private long put(int slot, float[] a) {
    ByteBuffer b = scratch(slot, a.length * 4);
    b.asFloatBuffer().put(a);
    return address(b);
  }

  private long put(int slot, short[] a) {
    ByteBuffer b = scratch(slot, a.length * 2);
    b.asShortBuffer().put(a);
    return address(b);
  }

  private static long address(ByteBuffer b) {
    return MinikvNative.buffer_address(b) + b.position();
  }

  private static long writable(String method, String name, ByteBuffer b, int bytes) {
    Objects.requireNonNull(b, name);
    if (b.isReadOnly()) {
      throw invalid("KvCache." + method + ": " + name + " is a read-only ByteBuffer");
    }
    return direct(method, name, b, bytes);
  }

  private static long direct(String method, String name, ByteBuffer b, int bytes) {
    Objects.requireNonNull(b, name);
    if (!b.isDirect()) {
      throw invalid("KvCache." + method + ": " + name + " is not a direct ByteBuffer");
    }
    if (b.remaining() != bytes) {
      throw invalid("KvCache." + method + ": " + name + " has " + b.remaining()
          + " bytes remaining, want " + bytes);
    }
    return address(b);
  }
}

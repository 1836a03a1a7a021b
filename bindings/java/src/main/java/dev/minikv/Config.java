package dev.minikv;

/**
 * An immutable cache configuration ({@code minikv_config}). Build one with {@link #builder()},
 * which starts from the library's defaults ({@link Preset#BALANCED}: F16, 4-bit keys and 2-bit
 * values, group 32, 4 sink tokens, residual 64 flushed 32 tokens at a time, heavy and recent
 * ratios 0.25, backend AUTO); {@link Builder#preset(Preset)} switches the compression fields to
 * another named setting (the paper's exact MiniKV: {@link Preset#PAPER}); the model dimensions
 * must be set. The library validates it in {@link KvCache#KvCache(Config)}.
 */
public final class Config {
  private final Backend backend;
  private final int deviceId;
  private final Dtype dtype;
  private final int numLayers, numHeads, numKvHeads, headDim, maxSequences, maxSeqLen;
  private final long maxTokens;
  private final float heavyRatio, recentRatio;
  private final BudgetPolicy budgetPolicy;
  private final float pyramidDepth;
  private final ScoreMode scoreMode;
  private final int windowSize, poolKernel, keyBits, valueBits, groupSize, residualLength,
      sinkTokens, prefillStagingTokens, flushTokens;

  private Config(Builder b) {
    backend = b.backend;
    deviceId = b.deviceId;
    dtype = b.dtype;
    numLayers = b.numLayers;
    numHeads = b.numHeads;
    numKvHeads = b.numKvHeads;
    headDim = b.headDim;
    maxSequences = b.maxSequences;
    maxSeqLen = b.maxSeqLen;
    maxTokens = b.maxTokens;
    heavyRatio = b.heavyRatio;
    recentRatio = b.recentRatio;
    budgetPolicy = b.budgetPolicy;
    pyramidDepth = b.pyramidDepth;
    scoreMode = b.scoreMode;
    windowSize = b.windowSize;
    poolKernel = b.poolKernel;
    keyBits = b.keyBits;
    valueBits = b.valueBits;
    groupSize = b.groupSize;
    residualLength = b.residualLength;
    sinkTokens = b.sinkTokens;
    prefillStagingTokens = b.prefillStagingTokens;
    flushTokens = b.flushTokens;
  }

  /** A builder holding the library's defaults ({@code minikv_config_default}). */
  public static Builder builder() {
    return new Builder();
  }

  /** A builder holding this configuration's values. */
  public Builder toBuilder() {
    Builder b = new Builder(false);
    b.backend = backend;
    b.deviceId = deviceId;
    b.dtype = dtype;
    b.numLayers = numLayers;
    b.numHeads = numHeads;
    b.numKvHeads = numKvHeads;
    b.headDim = headDim;
    b.maxSequences = maxSequences;
    b.maxSeqLen = maxSeqLen;
    b.maxTokens = maxTokens;
    b.heavyRatio = heavyRatio;
    b.recentRatio = recentRatio;
    b.budgetPolicy = budgetPolicy;
    b.pyramidDepth = pyramidDepth;
    b.scoreMode = scoreMode;
    b.windowSize = windowSize;
    b.poolKernel = poolKernel;
    b.keyBits = keyBits;
    b.valueBits = valueBits;
    b.groupSize = groupSize;
    b.residualLength = residualLength;
    b.sinkTokens = sinkTokens;
    b.prefillStagingTokens = prefillStagingTokens;
    b.flushTokens = flushTokens;
    return b;
  }

  /** Fills a new C config; the caller deletes it. */
  ConfigStruct toNative() {
    ConfigStruct c = new ConfigStruct(); // calloc + minikv_config_default: struct_size set
    c.setBackend(backend.code);
    c.setDevice_id(deviceId);
    c.setDtype(dtype.code);
    c.setNum_layers(numLayers);
    c.setNum_heads(numHeads);
    c.setNum_kv_heads(numKvHeads);
    c.setHead_dim(headDim);
    c.setMax_sequences(maxSequences);
    c.setMax_seq_len(maxSeqLen);
    c.setMax_tokens(maxTokens);
    c.setHeavy_ratio(heavyRatio);
    c.setRecent_ratio(recentRatio);
    c.setBudget_policy(budgetPolicy.code);
    c.setPyramid_depth(pyramidDepth);
    c.setScore_mode(scoreMode.code);
    c.setWindow_size(windowSize);
    c.setPool_kernel(poolKernel);
    c.setKey_bits(keyBits);
    c.setValue_bits(valueBits);
    c.setGroup_size(groupSize);
    c.setResidual_length(residualLength);
    c.setSink_tokens(sinkTokens);
    c.setPrefill_staging_tokens(prefillStagingTokens);
    c.setFlush_tokens(flushTokens);
    return c;
  }

  static Config fromNative(ConfigStruct c) {
    Builder b = new Builder(false);
    b.backend = Backend.fromCode(c.getBackend());
    b.deviceId = c.getDevice_id();
    b.dtype = Dtype.fromCode(c.getDtype());
    b.numLayers = c.getNum_layers();
    b.numHeads = c.getNum_heads();
    b.numKvHeads = c.getNum_kv_heads();
    b.headDim = c.getHead_dim();
    b.maxSequences = c.getMax_sequences();
    b.maxSeqLen = c.getMax_seq_len();
    b.maxTokens = c.getMax_tokens();
    b.heavyRatio = c.getHeavy_ratio();
    b.recentRatio = c.getRecent_ratio();
    b.budgetPolicy = BudgetPolicy.fromCode(c.getBudget_policy());
    b.pyramidDepth = c.getPyramid_depth();
    b.scoreMode = ScoreMode.fromCode(c.getScore_mode());
    b.windowSize = c.getWindow_size();
    b.poolKernel = c.getPool_kernel();
    b.keyBits = c.getKey_bits();
    b.valueBits = c.getValue_bits();
    b.groupSize = c.getGroup_size();
    b.residualLength = c.getResidual_length();
    b.sinkTokens = c.getSink_tokens();
    b.prefillStagingTokens = c.getPrefill_staging_tokens();
    b.flushTokens = c.getFlush_tokens();
    return b.build();
  }

  public Backend backend() { return backend; }
  public int deviceId() { return deviceId; }
  public Dtype dtype() { return dtype; }
  public int numLayers() { return numLayers; }
  public int numHeads() { return numHeads; }
  public int numKvHeads() { return numKvHeads; }
  public int headDim() { return headDim; }
  public int maxSequences() { return maxSequences; }
  public int maxSeqLen() { return maxSeqLen; }
  public long maxTokens() { return maxTokens; }
  public float heavyRatio() { return heavyRatio; }
  public float recentRatio() { return recentRatio; }
  public BudgetPolicy budgetPolicy() { return budgetPolicy; }
  public float pyramidDepth() { return pyramidDepth; }
  public ScoreMode scoreMode() { return scoreMode; }
  public int windowSize() { return windowSize; }
  public int poolKernel() { return poolKernel; }
  public int keyBits() { return keyBits; }
  public int valueBits() { return valueBits; }
  public int groupSize() { return groupSize; }
  /** R, tokens kept 16-bit before a flush: a multiple of groupSize; 64 (other presets: 128). */
  public int residualLength() { return residualLength; }
  /** Attention sinks: the first prompt positions kept unquantized, inside the budget. */
  public int sinkTokens() { return sinkTokens; }
  /**
   * Chunked prefill ({@link KvCache#prefillChunk}): the most prompt tokens in flight at once
   * across sequences, whose K/V wait in a staging area reserved at creation; 0 = off.
   */
  public int prefillStagingTokens() { return prefillStagingTokens; }
  /**
   * F, how many tokens a flush quantizes: when the residual holds {@link #residualLength()}
   * tokens (the new one included), its oldest F are quantized and the newest
   * residualLength - F stay 16-bit (a sliding flush, every F tokens). Any value is valid: it
   * is rounded up to a multiple of {@link #groupSize()} and capped at residualLength (with
   * groupSize 16, 24 acts as 32; 200 with residualLength 64 as 64); 0 = the whole residual at
   * once (the MiniKV reference). 32 by default (with residualLength 64); the presets other
   * than {@link Preset#BALANCED} set 0 (with residualLength 128).
   */
  public int flushTokens() { return flushTokens; }

  @Override
  public String toString() {
    return "Config{backend=" + backend + ", dtype=" + dtype + ", layers=" + numLayers
        + ", heads=" + numHeads + "/" + numKvHeads + ", headDim=" + headDim
        + ", maxSequences=" + maxSequences + ", maxSeqLen=" + maxSeqLen
        + ", maxTokens=" + maxTokens + ", heavy=" + heavyRatio + ", recent=" + recentRatio
        + ", " + budgetPolicy + ", " + scoreMode + ", bits=" + keyBits + "/" + valueBits
        + ", group=" + groupSize + ", residual=" + residualLength + ", sinks=" + sinkTokens
        + ", prefillStaging=" + prefillStagingTokens + ", flush=" + flushTokens + "}";
  }

  /** Mutable builder; every setter returns {@code this}. Unsigned C fields take Java ints. */
  public static final class Builder {
    private Backend backend;
    private int deviceId;
    private Dtype dtype;
    private int numLayers, numHeads, numKvHeads, headDim, maxSequences, maxSeqLen;
    private long maxTokens;
    private float heavyRatio, recentRatio;
    private BudgetPolicy budgetPolicy;
    private float pyramidDepth;
    private ScoreMode scoreMode;
    private int windowSize, poolKernel, keyBits, valueBits, groupSize, residualLength,
        sinkTokens, prefillStagingTokens, flushTokens;

    private Builder(boolean defaults) {
      if (defaults) {
        ConfigStruct c = new ConfigStruct();
        try {
          Builder d = fromNative(c).toBuilder();
          copyFrom(d);
        } finally {
          c.delete();
        }
      }
    }

    Builder() {
      this(true);
    }

    private void copyFrom(Builder d) {
      backend = d.backend;
      deviceId = d.deviceId;
      dtype = d.dtype;
      numLayers = d.numLayers;
      numHeads = d.numHeads;
      numKvHeads = d.numKvHeads;
      headDim = d.headDim;
      maxSequences = d.maxSequences;
      maxSeqLen = d.maxSeqLen;
      maxTokens = d.maxTokens;
      heavyRatio = d.heavyRatio;
      recentRatio = d.recentRatio;
      budgetPolicy = d.budgetPolicy;
      pyramidDepth = d.pyramidDepth;
      scoreMode = d.scoreMode;
      windowSize = d.windowSize;
      poolKernel = d.poolKernel;
      keyBits = d.keyBits;
      valueBits = d.valueBits;
      groupSize = d.groupSize;
      residualLength = d.residualLength;
      sinkTokens = d.sinkTokens;
      prefillStagingTokens = d.prefillStagingTokens;
      flushTokens = d.flushTokens;
    }

    public Builder backend(Backend v) { backend = java.util.Objects.requireNonNull(v); return this; }
    public Builder deviceId(int v) { deviceId = v; return this; }
    public Builder dtype(Dtype v) { dtype = java.util.Objects.requireNonNull(v); return this; }
    public Builder numLayers(int v) { numLayers = v; return this; }
    public Builder numHeads(int v) { numHeads = v; return this; }
    public Builder numKvHeads(int v) { numKvHeads = v; return this; }
    public Builder headDim(int v) { headDim = v; return this; }
    public Builder maxSequences(int v) { maxSequences = v; return this; }
    public Builder maxSeqLen(int v) { maxSeqLen = v; return this; }
    public Builder maxTokens(long v) { maxTokens = v; return this; }
    public Builder heavyRatio(float v) { heavyRatio = v; return this; }
    public Builder recentRatio(float v) { recentRatio = v; return this; }
    public Builder budgetPolicy(BudgetPolicy v) { budgetPolicy = java.util.Objects.requireNonNull(v); return this; }
    public Builder pyramidDepth(float v) { pyramidDepth = v; return this; }
    public Builder scoreMode(ScoreMode v) { scoreMode = java.util.Objects.requireNonNull(v); return this; }
    public Builder windowSize(int v) { windowSize = v; return this; }
    public Builder poolKernel(int v) { poolKernel = v; return this; }
    public Builder keyBits(int v) { keyBits = v; return this; }
    public Builder valueBits(int v) { valueBits = v; return this; }
    public Builder groupSize(int v) { groupSize = v; return this; }
    public Builder residualLength(int v) { residualLength = v; return this; }
    public Builder sinkTokens(int v) { sinkTokens = v; return this; }
    public Builder prefillStagingTokens(int v) { prefillStagingTokens = v; return this; }
    /**
     * F of {@link Config#flushTokens()}, an unsigned C value: 0 (the whole residual) or any
     * other, rounded up to a multiple of groupSize and capped at residualLength.
     */
    public Builder flushTokens(int v) { flushTokens = v; return this; }

    /**
     * Sets the compression fields (bits, group size, sink tokens, budgets, score mode,
     * residual length, flush tokens) to a named setting ({@code minikv_config_preset});
     * dimensions, backend, dtype and sizes keep their values.
     */
    public Builder preset(Preset p) {
      ConfigStruct c = new Config(this).toNative();
      try {
        MinikvNative.config_preset(c, java.util.Objects.requireNonNull(p).code);
        copyFrom(fromNative(c).toBuilder());
      } finally {
        c.delete();
      }
      return this;
    }

    /** The immutable configuration (validated later, by the library, at cache creation). */
    public Config build() {
      return new Config(this);
    }
  }
}

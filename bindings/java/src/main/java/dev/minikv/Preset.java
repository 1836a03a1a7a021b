package dev.minikv;

/**
 * Named compression settings ({@code minikv_preset}; {@code include/minikv.h} documents each):
 * {@link Config.Builder#preset(Preset)} sets the compression fields to one of them.
 */
public enum Preset {
  /**
   * The default: 4-bit keys, 2-bit values, group 32, 4 sink tokens, pyramid budgets, window
   * (SnapKV-style) scores, a 64-token residual flushed 32 tokens at a time.
   */
  BALANCED(0),
  /**
   * MiniKV exactly: 2-bit keys and values, group 16, pyramid budgets, no sinks, the whole
   * 128-token residual flushed at once.
   */
  PAPER(1),
  /** 8-bit keys and values, group 32, 4 sink tokens, uniform budgets, residual 128 (whole). */
  QUALITY(2),
  /**
   * No quantization (16-bit), no sinks, uniform budgets: H2O-style eviction alone (residual 128,
   * flushed whole).
   */
  EVICTION_ONLY(3);

  final int code;

  Preset(int code) {
    this.code = code;
  }
}

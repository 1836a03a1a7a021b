package dev.minikv;

/** How prompt tokens are scored for eviction ({@code minikv_score_mode}). */
public enum ScoreMode {
  /** H2O: attention each key receives, summed over all prompt queries. */
  CUMULATIVE(0),
  /** SnapKV: summed over the last windowSize queries, max-pooled. */
  WINDOW(1);

  final int code;

  ScoreMode(int code) {
    this.code = code;
  }

  static ScoreMode fromCode(int code) {
    for (ScoreMode m : values()) {
      if (m.code == code) {
        return m;
      }
    }
    throw new IllegalArgumentException("unknown minikv_score_mode " + code);
  }
}

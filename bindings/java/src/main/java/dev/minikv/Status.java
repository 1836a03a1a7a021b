package dev.minikv;

/** A libminikv status ({@code minikv_status}); the codes are pinned by the C ABI. */
public enum Status {
  OK(0),
  /** A bad argument or config field; the message names it. */
  INVALID_ARGUMENT(1),
  /** A host or device allocation failed. */
  OUT_OF_MEMORY(2),
  /** The block pool is full or a sequence reached maxSeqLen; nothing changed. */
  CAPACITY_EXCEEDED(3),
  /** The call is valid but not now (decode before prefill, prefill twice, a closed cache). */
  BAD_STATE(4),
  /** Valid but not built or not supported here (e.g. no CUDA backend). */
  UNSUPPORTED(5),
  /** A CUDA runtime error. */
  DEVICE(6),
  /** A struct size the library cannot read. */
  VERSION_MISMATCH(7),
  /** A bug in libminikv. */
  INTERNAL(8),
  /** A code this binding does not know (from a newer library). */
  UNKNOWN(-1);

  private final int code;

  Status(int code) {
    this.code = code;
  }

  /** The C value. */
  public int code() {
    return code;
  }

  /** The status of a C value; {@link #UNKNOWN} for values this binding does not know. */
  public static Status fromCode(int code) {
    for (Status s : values()) {
      if (s.code == code && s != UNKNOWN) {
        return s;
      }
    }
    return UNKNOWN;
  }

  /** The C name, e.g. {@code MINIKV_ERR_BAD_STATE}. */
  public String cName() {
    return this == OK ? "MINIKV_OK" : "MINIKV_ERR_" + name();
  }
}

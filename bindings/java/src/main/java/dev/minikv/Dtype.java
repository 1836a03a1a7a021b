package dev.minikv;

/** Element type of q/k/v/out and of the 16-bit storage ({@code minikv_dtype}). */
public enum Dtype {
  /** IEEE binary16, as raw bits in {@code short[]} (see {@link Half}). */
  F16(0, 2),
  /** bfloat16, as raw bits in {@code short[]}. */
  BF16(1, 2),
  /** IEEE binary32, {@code float[]}. */
  F32(2, 4);

  final int code;
  final int bytes;

  Dtype(int code, int bytes) {
    this.code = code;
    this.bytes = bytes;
  }

  /** Bytes per element. */
  public int bytes() {
    return bytes;
  }

  static Dtype fromCode(int code) {
    for (Dtype d : values()) {
      if (d.code == code) {
        return d;
      }
    }
    throw new IllegalArgumentException("unknown minikv_dtype " + code);
  }
}

package dev.minikv;

/** Where the cache lives and computes ({@code minikv_backend}). */
public enum Backend {
  /**
   * CUDA when built and a device is present, else CPU; {@link KvCache#backend()} tells which
   * one a cache got, so which methods (host arrays or {@code *Device}) it takes.
   */
  AUTO(0),
  /** Host memory, synchronous calls: arrays or direct ByteBuffers. */
  CPU(1),
  /** Device memory of deviceId: the {@code *Device} methods with addresses and a stream. */
  CUDA(2);

  final int code;

  Backend(int code) {
    this.code = code;
  }

  static Backend fromCode(int code) {
    for (Backend b : values()) {
      if (b.code == code) {
        return b;
      }
    }
    throw new IllegalArgumentException("unknown minikv_backend " + code);
  }
}

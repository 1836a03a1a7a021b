package dev.minikv;

/**
 * A failed libminikv call: the {@link Status} and the library's message, which names the call
 * and the offending argument (read inside the same JNI call as the failure).
 */
public class MinikvException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  private final int code;

  /** Called from the JNI wrapper (signature {@code (ILjava/lang/String;)V}). */
  public MinikvException(int code, String message) {
    super(Status.fromCode(code).cName() + ": " + message);
    this.code = code;
  }

  MinikvException(Status status, String message) {
    this(status.code(), message);
  }

  /** The status of the failure. */
  public Status status() {
    return Status.fromCode(code);
  }

  /** The raw C status value. */
  public int code() {
    return code;
  }
}

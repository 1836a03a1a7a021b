package dev.minikv;

/** Conversions between float and the 16-bit patterns of F16 and BF16 tensors. */
public final class Half {
  private Half() {}

  /** IEEE binary16 bits of f, rounded to nearest even (overflow to Inf, NaN stays NaN). */
  public static short f16Bits(float f) {
    int b = Float.floatToRawIntBits(f);
    int sign = (b >>> 16) & 0x8000;
    int exp = (b >>> 23) & 0xff;
    int mant = b & 0x7fffff;
    if (exp == 0xff) {
      return (short) (sign | (mant != 0 ? 0x7e00 : 0x7c00));
    }
    if (exp > 142) {
      return (short) (sign | 0x7c00); // overflow
    }
    if (exp >= 113) { // normal half
      int h = ((exp - 112) << 10) | (mant >>> 13);
      int rest = mant & 0x1fff;
      if (rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1)) {
        h++; // may carry up to Inf: correct
      }
      return (short) (sign | h);
    }
    if (exp >= 102) { // subnormal half
      int m = mant | 0x800000;
      int shift = 126 - exp;
      int h = m >>> shift;
      int rest = m & ((1 << shift) - 1);
      int half = 1 << (shift - 1);
      if (rest > half || (rest == half && (h & 1) == 1)) {
        h++;
      }
      return (short) (sign | h);
    }
    return (short) sign;
  }

  /** The float value of IEEE binary16 bits (exact). */
  public static float f16Float(short bits) {
    int h = bits & 0xffff;
    int sign = (h & 0x8000) << 16;
    int exp = (h >>> 10) & 0x1f;
    int mant = h & 0x3ff;
    if (exp == 0x1f) {
      return Float.intBitsToFloat(sign | 0x7f800000 | (mant << 13));
    }
    if (exp != 0) {
      return Float.intBitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
    }
    float f = mant * 0x1p-24f; // subnormal or zero
    return sign != 0 ? -f : f;
  }

  /** bfloat16 bits of f, rounded to nearest even (NaN stays NaN). */
  public static short bf16Bits(float f) {
    int b = Float.floatToRawIntBits(f);
    if ((b & 0x7f800000) == 0x7f800000 && (b & 0x7fffff) != 0) {
      return (short) ((b >>> 16) | 0x40);
    }
    b += 0x7fff + ((b >>> 16) & 1);
    return (short) (b >>> 16);
  }

  /** The float value of bfloat16 bits (exact). */
  public static float bf16Float(short bits) {
    return Float.intBitsToFloat((bits & 0xffff) << 16);
  }

  /** {@link #f16Bits(float)} of every element: float data as the short[] an F16 cache takes. */
  public static short[] f16Bits(float[] src) {
    short[] dst = new short[src.length];
    for (int i = 0; i < src.length; i++) {
      dst[i] = f16Bits(src[i]);
    }
    return dst;
  }

  /** {@link #bf16Bits(float)} of every element: float data as the short[] a BF16 cache takes. */
  public static short[] bf16Bits(float[] src) {
    short[] dst = new short[src.length];
    for (int i = 0; i < src.length; i++) {
      dst[i] = bf16Bits(src[i]);
    }
    return dst;
  }

  /** {@link #f16Float(short)} of every element, e.g. an F16 cache's output (exact). */
  public static float[] f16Floats(short[] src) {
    float[] dst = new float[src.length];
    for (int i = 0; i < src.length; i++) {
      dst[i] = f16Float(src[i]);
    }
    return dst;
  }

  /** {@link #bf16Float(short)} of every element, e.g. a BF16 cache's output (exact). */
  public static float[] bf16Floats(short[] src) {
    float[] dst = new float[src.length];
    for (int i = 0; i < src.length; i++) {
      dst[i] = bf16Float(src[i]);
    }
    return dst;
  }
}

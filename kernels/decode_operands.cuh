// Operand helpers the tensor-core decode kernels share (decode_mma.cuh, decode_k4v2.cu):
// fp16 bit arithmetic, powers of two, the probabilities as an mma operand, and the pairing of
// key codes into fp16 subnormal pairs.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace minikv {
namespace kernels {

constexpr uint32_t kFull = 0xffffffffu;
constexpr float kP16Scale = 4096.0f;  // fp16 probabilities ride as p · 2^12 (kept normal)

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
// 2^e for e in [-126, 127].
__device__ __forceinline__ float pow2i(int e) { return __int_as_float((127 + e) << 23); }
// floor(log2 x) of a finite x > 0 in the normal range (-127 for 0 and denormals).
__device__ __forceinline__ int exponent_of(float x) {
  return int((__float_as_uint(x) >> 23) & 0xffu) - 127;
}
__device__ __forceinline__ int clamp_exp(int e, int lim) { return e < -lim ? -lim : e > lim ? lim : e; }
__device__ __forceinline__ uint32_t pack_f16(float a, float b) { return DType<__half>::pack2(a, b); }
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b));
  return *reinterpret_cast<const uint32_t *>(&r);
}
// a · b − c, rounded once.
__device__ __forceinline__ uint32_t hfms2_bits(uint32_t a, uint32_t b, uint32_t c) {
  const __half2 r = __hfma2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b),
                            __hneg2(*reinterpret_cast<const __half2 *>(&c)));
  return *reinterpret_cast<const uint32_t *>(&r);
}
__device__ __forceinline__ uint32_t word_of(const uint4 &v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}
template <typename T> __device__ __forceinline__ float elem_to_float(uint32_t w, int half) {
  const float2 f = word_to_float2(w, T{});
  return half ? f.y : f.x;
}
// p (fp32, <= 1) as the B operand of a 16-bit mma: fp16 · 2^12, or bf16 in two pieces.
template <typename T> struct ProbOperand {
  uint32_t hi[2], lo[2];
  __device__ __forceinline__ ProbOperand(float p0, float p1, float p2, float p3) {
    if constexpr (std::is_same<T, __half>::value) {
      hi[0] = pack_f16(p0 * kP16Scale, p1 * kP16Scale);
      hi[1] = pack_f16(p2 * kP16Scale, p3 * kP16Scale);
    } else {
      hi[0] = DType<T>::pack2(p0, p1);
      hi[1] = DType<T>::pack2(p2, p3);
      const float2 h0 = word_to_float2(hi[0], T{}), h1 = word_to_float2(hi[1], T{});
      lo[0] = DType<T>::pack2(p0 - h0.x, p1 - h0.y);  // exact differences
      lo[1] = DType<T>::pack2(p2 - h1.x, p3 - h1.y);
    }
  }
  static constexpr float kScale = std::is_same<T, __half>::value ? kP16Scale : 1.0f;
  __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4]) const {
    mma_16816<T>(d, a, hi[0], hi[1]);
    if constexpr (!std::is_same<T, __half>::value) mma_16816<T>(d, a, lo[0], lo[1]);
  }
};

// ---- key codes as the QK B operand ------------------------------------------------------
// The lane's quarter i of a key row holds channels [i·D/4, (i+1)·D/4). Its 32-bit words pair
// up codes l and l + 16/KB of a word (low and high half, same offset): pair P of the quarter
// is word P / (16/KB), index l = P % (16/KB), channels lo = word · 32/KB + l and lo + 16/KB,
// code offset (l · KB) mod 8 once the word is shifted right by 8 for l · KB >= 8. k-step ks
// uses pairs 2ks (k rows 2i, 2i+1) and 2ks + 1 (k rows 2i + 8, 2i + 9).
template <int KB> struct KeyPairs {
  static constexpr int kPerWord = 16 / KB;
  static __host__ __device__ constexpr int lo(int P) { return (P / kPerWord) * (32 / KB) + P % kPerWord; }
  static __host__ __device__ constexpr int hi(int P) { return lo(P) + kPerWord; }
  static __host__ __device__ constexpr int offset(int P) { return ((P % kPerWord) * KB) % 8; }
  static __device__ __forceinline__ uint32_t code_pair(uint32_t w, int P) {
    const int l = P % kPerWord;
    const uint32_t src = l * KB >= 8 ? w >> 8 : w;
    return src & ((((1u << KB) - 1u) * 0x00010001u) << offset(P));
  }
};

}  // namespace kernels
}  // namespace minikv

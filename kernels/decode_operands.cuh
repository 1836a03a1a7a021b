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
#ifdef MINIKV_WARP_EMULATION
  r = emulation::prmt(a, b, sel);
#else
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
#endif
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
#ifdef MINIKV_WARP_EMULATION
  return emulation::hmul2(a, b);
#else
  const __half2 r = __hmul2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b));
  return *reinterpret_cast<const uint32_t *>(&r);
#endif
}
// a · b − c, rounded once.
__device__ __forceinline__ uint32_t hfms2_bits(uint32_t a, uint32_t b, uint32_t c) {
#ifdef MINIKV_WARP_EMULATION
  return emulation::hfms2(a, b, c);
#else
  const __half2 r = __hfma2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b),
                            __hneg2(*reinterpret_cast<const __half2 *>(&c)));
  return *reinterpret_cast<const uint32_t *>(&r);
#endif
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

// The code offset of key channel c: KeyPairs<KB>::offset of the pair that holds it.
template <int KB> __host__ __device__ constexpr int key_channel_offset(uint32_t c) {
  return int((c % (32 / KB)) % (16 / KB) * KB % 8);
}
static_assert(key_channel_offset<4>(5) == 4 && key_channel_offset<4>(6) == 0 && key_channel_offset<2>(11) == 6 &&
                  key_channel_offset<8>(3) == 0,
              "a key channel's code offset");

// ---- value codes as the P·V A operand ----------------------------------------------------
// Channel c of each fp16 half of w (VB-bit codes packed from bit 0): the code at its offset
// (c · VB) mod 8 of the half's low byte, the high byte shifted down first; an fp16 subnormal
// code · 2^(offset − 24).
template <int VB> __device__ __forceinline__ uint32_t value_codes(uint32_t w, int c) {
  const uint32_t src = c * VB >= 8 ? w >> 8 : w;
  return src & ((((1u << VB) - 1u) << (c * VB % 8)) * 0x00010001u);
}

// The 32-bit words of n consecutive uint4s at p (16-byte aligned shared memory).
template <int N> __device__ __forceinline__ void load_words(const void *p, uint32_t (&w)[N]) {
  static_assert(N % 4 == 0, "whole uint4s");
#pragma unroll
  for (int v = 0; v < N / 4; ++v) {
    const uint4 u = reinterpret_cast<const uint4 *>(p)[v];
    w[4 * v] = u.x;
    w[4 * v + 1] = u.y;
    w[4 * v + 2] = u.z;
    w[4 * v + 3] = u.w;
  }
}

// The words w as n consecutive uint4s at p (16-byte aligned shared memory).
template <int N> __device__ __forceinline__ void store_words(void *p, const uint32_t (&w)[N]) {
  static_assert(N % 4 == 0, "whole uint4s");
#pragma unroll
  for (int v = 0; v < N / 4; ++v)
    reinterpret_cast<uint4 *>(p)[v] = make_uint4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
}

// The exponent ks of a key group's scales, max s · 2^ks in [2^7, 2^8) (0 for an all-zero
// group), from the lane's words of them (16-bit patterns of scales >= 0, which order as
// integers) and the lanes at xor distances below kLanes that hold the group's other channels.
template <typename T, int kLanes, int N>
__device__ __forceinline__ int key_scale_exponent(const uint32_t (&sw)[N]) {
  uint32_t m2 = sw[0] & 0x7fff7fffu;
#pragma unroll
  for (int j = 1; j < N; ++j) m2 = __vmaxu2(m2, sw[j] & 0x7fff7fffu);
  uint32_t mb = max(m2 & 0xffffu, m2 >> 16);
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) mb = max(mb, __shfl_xor_sync(kFull, mb, o));
  const float mx = elem_to_float<T>(mb, 0);
  return mx > 0.0f ? clamp_exp(7 - exponent_of(mx), 100) : 0;
}

// s' = s · 2^ks of each key pair's channels (KeyPairs<KB> order, lo in the low half) as
// fp16, from the words sw of the scales (channel c in half c % 2 of word c / 2): fp16 scales
// whose 2^ks is an fp16 normal take one PRMT and one HMUL2 a pair.
template <typename T, int KB, int NP, int N>
__device__ __forceinline__ void scaled_key_scales(const uint32_t (&sw)[N], int ks, uint32_t (&s2)[NP]) {
  using KP = KeyPairs<KB>;
  if (std::is_same<T, __half>::value && ks >= -14 && ks <= 15) {
    const uint32_t f2 = pack_f16(pow2i(ks), pow2i(ks));
#pragma unroll
    for (int P = 0; P < NP; ++P) {
      const int lo = KP::lo(P), hi = KP::hi(P);
      const uint32_t sel = (lo & 1 ? 0x32u : 0x10u) | (hi & 1 ? 0x7600u : 0x5400u);
      s2[P] = hmul2_bits(prmt(sw[lo / 2], sw[hi / 2], sel), f2);
    }
  } else {
    const float f = pow2i(ks);
#pragma unroll
    for (int P = 0; P < NP; ++P) {
      const int lo = KP::lo(P), hi = KP::hi(P);
      s2[P] = pack_f16(elem_to_float<T>(sw[lo / 2], lo & 1) * f, elem_to_float<T>(sw[hi / 2], hi & 1) * f);
    }
  }
}

}  // namespace kernels
}  // namespace minikv

// A CPU emulation of the CUDA execution model, for running kernels without a GPU (CI, and a
// machine with no device). Force-included (-include) ahead of a kernel source compiled as
// host C++ with -DMINIKV_WARP_EMULATION: it defines the built-in variables and intrinsics the
// kernels use, and the kernel helpers (kernels/common.cuh, bulk_copy.cuh, decode_operands.cuh,
// prefill_common.cuh, wgmma.cuh, prefill_wgmma.cu's barriers) call the functions below in
// place of their inline PTX.
//
// The model: a launch runs its CTAs one after another; a CTA's threads are fibers on one OS
// thread, each running until it reaches a warp collective (shuffle, __syncwarp, ldmatrix,
// mma), a warpgroup's wgmma, a CTA or named barrier or an mbarrier wait. A collective
// completes once every live lane of the warp has arrived at the same one (a divergent
// collective aborts, naming both), so the code between two collectives runs lane by lane. A
// bulk or TMA copy lands either when it is issued
// (a thread that reads the destination later than it may, before it waits, sees the new
// bytes) or when a thread waits on its mbarrier (a thread that reads it without waiting sees
// the old bytes): the tests run both. Dynamic shared memory is filled with a byte pattern
// before each CTA, not zeros, so that an unwritten read shows.
//
// Arithmetic: mma accumulates the exact products in double and rounds to float once per
// instruction (the tensor cores round differently, within the same error bounds); ex2.approx
// is exp2f with flush-to-zero. Everything else is IEEE as on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

// Whether AddressSanitizer instruments this build (the fibers announce their stack switches
// to it; the tests run lighter under it).
#if defined(__SANITIZE_ADDRESS__)
#define MINIKV_EMULATION_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MINIKV_EMULATION_ASAN 1
#endif
#endif

namespace minikv {
namespace emulation {

#ifdef MINIKV_EMULATION_ASAN
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif

// Where a bulk copy's bytes land (see above).
enum class CopyLanding { kAtIssue, kAtWait };

// Runs `thread_body` for every thread of every CTA of the grid (CTAs in x, y, z order), with
// `smem_bytes` of dynamic shared memory (MINIKV_DYNAMIC_SMEM). Aborts, with a message, on a
// deadlock or a divergent collective.
void launch(dim3 grid, dim3 block, size_t smem_bytes, CopyLanding landing, const std::function<void()> &thread_body);

// The running thread's built-in variables.
const uint3 &thread_idx();
const uint3 &block_idx();
const dim3 &block_dim();
const dim3 &grid_dim();
uint8_t *shared_base();
// A pointer to shared memory as a shared-state-space address, and back. Dynamic shared memory
// maps to offsets from its start; a static __shared__ array (an ordinary static here) to
// addresses from 2^31 on.
uint32_t shared_address(const void *p);
uint8_t *shared_pointer(uint32_t address);

// Collectives of the running thread's warp / CTA.
void syncwarp();
void syncthreads();
uint32_t shfl(uint32_t v, int src_lane);       // __shfl_sync, width 32
uint32_t shfl_xor(uint32_t v, int lane_mask);  // __shfl_xor_sync, width 32
uint32_t shfl_down(uint32_t v, int delta);     // __shfl_down_sync, width 32
uint32_t shfl_up(uint32_t v, int delta);       // __shfl_up_sync, width 32
uint32_t match_any(uint32_t v);                // __match_any_sync over the live lanes
uint32_t ballot(bool predicate);               // __ballot_sync over the live lanes
void ldmatrix_x4(uint32_t (&r)[4], const void *smem, bool trans);
// d += a · b of mma.sync.m16n8k16.row.col.f32.{f16,bf16}; c0/c2 of the "even" form share it.
void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16);

// mbarriers and bulk copies at shared addresses (offsets into the dynamic shared memory).
void mbar_init(uint32_t bar, uint32_t count);
void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes);
void mbar_arrive(uint32_t bar);
void mbar_wait(uint32_t bar, uint32_t parity);
void bulk_copy(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar);

// cp.async of 16 bytes (zeros where !valid, without reading src), its groups and their waits:
// the running thread's own, landing as the bulk copies do (at issue, or at the wait that
// covers their group).
void cp_async(uint32_t dst, const void *src, uint32_t bytes, bool valid);  // 4 or 16 bytes
void cp_async_commit();
void cp_async_wait(int newest_pending);

// bar.sync / bar.arrive id, count: named barrier `id` (< 16) completes when `count` threads
// have arrived; bar.sync waits for that, bar.arrive does not.
void named_barrier(uint32_t id, uint32_t count);
void named_arrive(uint32_t id, uint32_t count);

// TMA (cp.async.bulk.tensor) over a tensor map that encode_tensor_map wrote (the emulation's
// own encoding in the CUtensorMap's bytes, not the driver's): a 3-D tensor of elem_bytes
// elements at base, dims[0] innermost, strides of dims 1 and 2 in bytes; boxes of box[0..2]
// elements, rows box[0] · elem_bytes apart in shared memory, the 128-byte swizzle applied
// to the shared address (16-byte chunk bits 4-6 ^= bits 7-9) where swizzle_128b; elements
// outside the tensor land as zeros. A box's bytes complete on `bar` as a bulk copy's do.
void encode_tensor_map(void *map, const void *base, uint32_t elem_bytes, const uint64_t (&dims)[3],
                       const uint64_t (&strides)[2], const uint32_t (&box)[3], bool swizzle_128b);
void tma_load_3d(uint32_t dst, const void *map, uint32_t bar, int c0, int c1, int c2);

// wgmma.mma_async m64nNk16: A = 64 x 16, in registers (a: the warpgroup's 64 rows, 16 per
// warp in the mma.sync A-fragment layout) or, where a is nullptr, a K-major shared-memory
// operand (desc_a); B = 16 x N from shared memory (desc_b), K-major or MN-major (b_mn_major:
// element (k, n) at (n / 64) LBO + (k / 8) SBO + (k % 8) 128 B + 2 (n % 64)). Operands are
// 128-byte swizzled. The warpgroup's 128 threads meet, and each thread's d[4i + 2r + c] (row
// 16 warp + lane / 4 + 8r, column 8i + 2 (lane % 4) + c) is to become (accumulate ? d : 0) +
// A · B in double, rounded to float (d as issued: a pending product into the same registers
// counts, as the hardware chains them). The product is computed when the last thread
// arrives, from the shared memory of that moment, but lands in d only at the thread's
// wgmma_wait that covers its commit group (wgmma_commit): until then d reads NaN, and a
// thread whose A registers, or shared-memory operand elements, change before that wait, or
// that ends with a product not waited for, aborts.
void wgmma(float *d, uint32_t n, const uint32_t *a, uint64_t desc_a, uint64_t desc_b, bool accumulate,
           bool b_mn_major, bool bf16);
void wgmma_commit();                    // wgmma.commit_group
void wgmma_wait(int newest_pending);    // wgmma.wait_group newest_pending

// Scalar bit helpers of PTX.
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t bytes = (uint64_t(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 0xfu;
    uint32_t byte = uint32_t(bytes >> (8 * (s & 7u))) & 0xffu;
    if (s & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;  // sign replication
    r |= byte << (8 * i);
  }
  return r;
}
inline float ex2_approx_ftz(float x) {
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}
// a · b − c per fp16 half, rounded once (fma.rn.f16x2 with a negated c).
uint32_t hfms2(uint32_t a, uint32_t b, uint32_t c);
uint32_t hmul2(uint32_t a, uint32_t b);

}  // namespace emulation
}  // namespace minikv

// ---- the CUDA built-ins a kernel source uses -------------------------------------------------
#define threadIdx (::minikv::emulation::thread_idx())
#define blockIdx (::minikv::emulation::block_idx())
#define blockDim (::minikv::emulation::block_dim())
#define gridDim (::minikv::emulation::grid_dim())
// A static __shared__ array is one object for every thread; CTAs run one at a time.
#undef __shared__
#define __shared__ static
#undef __grid_constant__
#define __grid_constant__
#undef __launch_bounds__
#define __launch_bounds__(...)
// nvcc's keyword; empty here (a library's __attribute__((__noinline__)) stays well-formed).
#undef __noinline__
#define __noinline__

inline void __syncwarp(unsigned = 0xffffffffu) { ::minikv::emulation::syncwarp(); }
inline void __syncthreads() { ::minikv::emulation::syncthreads(); }
inline void __threadfence() {}
template <typename To, typename From> inline To minikv_emulation_bits(From x) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To t;
  std::memcpy(&t, &x, sizeof t);
  return t;
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src, int = 32) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  return minikv_emulation_bits<T>(::minikv::emulation::shfl(minikv_emulation_bits<uint32_t>(v), src));
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  return minikv_emulation_bits<T>(::minikv::emulation::shfl_xor(minikv_emulation_bits<uint32_t>(v), mask));
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, int delta, int = 32) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  return minikv_emulation_bits<T>(::minikv::emulation::shfl_down(minikv_emulation_bits<uint32_t>(v), delta));
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, int delta, int = 32) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  return minikv_emulation_bits<T>(::minikv::emulation::shfl_up(minikv_emulation_bits<uint32_t>(v), delta));
}
inline unsigned __match_any_sync(unsigned, unsigned v) { return ::minikv::emulation::match_any(v); }
inline unsigned __ballot_sync(unsigned, int predicate) { return ::minikv::emulation::ballot(predicate != 0); }
inline int __any_sync(unsigned, int predicate) { return ::minikv::emulation::ballot(predicate != 0) != 0; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// Fibers share one OS thread: an atomic is a plain read-modify-write.
template <typename T> inline T __ldg(const T *p) { return *p; }
inline unsigned atomicAdd(unsigned *p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
template <typename T> inline T __ldcg(const T *p) { return *p; }
inline size_t __cvta_generic_to_shared(const void *p) { return ::minikv::emulation::shared_address(p); }
inline float __int_as_float(int x) { return minikv_emulation_bits<float>(x); }
inline float __uint_as_float(unsigned x) { return minikv_emulation_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return minikv_emulation_bits<unsigned>(x); }
inline int __float_as_int(float x) { return minikv_emulation_bits<int>(x); }
inline unsigned __vmaxu2(unsigned a, unsigned b) {
  const unsigned lo = std::max(a & 0xffffu, b & 0xffffu), hi = std::max(a >> 16, b >> 16);
  return lo | (hi << 16);
}
// The integer min / max overloads of CUDA's device math (mixed signedness compares unsigned).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min(unsigned(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, unsigned(b)); }
inline unsigned max(int a, unsigned b) { return max(unsigned(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, unsigned(b)); }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
// CUDA's global isnan (the host's lives in std).
inline bool isnan(float x) { return std::isnan(x); }

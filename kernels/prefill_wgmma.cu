// Prefill attention forward on Hopper warpgroup MMA (wgmma, sm_90a): the same result as
// prefill_attention_kernel (out and the row LSE in log2 units), for H100/H200.
//
// One CTA = one warpgroup (4 warps, 128 threads) = 64 query rows of one query head; two CTAs
// per SM. Q (64 × D) and three stages of K/V tiles (64 keys × D each) sit in shared memory in
// the 128-byte-swizzled layout wgmma reads through descriptors; cp.async fills them (tile
// j + 2 is in flight while tile j is consumed). Per K/V tile:
//   S_{j+1} = Q·K_{j+1}ᵀ is issued (async) before the softmax of S_j, so the tensor cores
//   work on the next tile while the CUDA cores run this one's softmax; then O += P_j·V_j
//   with P_j straight from registers (the accumulator layout of S is the register A layout
//   of the next wgmma, as with mma.sync) and V as an MN-major (transposed) operand.
// The other CTA on the SM fills the gaps that remain (its softmax during our P·V).
// Everything else — causal and length masks, online softmax in log2 units on raw scores,
// the LSE, the longest-tiles-first order, ragged batches, chunks of a prompt over its staged
// keys (params.h PrefillKeys) — is prefill_attention_kernel's.
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "dispatch.cuh"
#include "prefill_common.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

constexpr int kWgThreads = 128;  // one warpgroup
constexpr int kWgRows = 64;      // query rows per CTA
constexpr int kWgKeys = 64;      // keys per K/V tile
constexpr int kWgStages = 3;
static_assert(kPrefillQueryTile == 2 * kWgRows, "two CTAs per host query tile");

// Shared memory, bytes; every block 1024-byte aligned (the 128-byte swizzle repeats every
// 8 rows × 128 B). A [rows][D] tile is stored as D / 64 column blocks of [rows][64]
// elements (128 B per row); 16-byte chunk c of row r sits at chunk c ^ (r mod 8).
template <typename T, int D> struct WgSmem {
  static constexpr int kTile = kWgKeys * D * int(sizeof(T));  // one K or V tile
  static constexpr int kK = kWgRows * D * int(sizeof(T));  // Q first, at 0
  static constexpr int kV = kK + kWgStages * kTile;
  static constexpr int kBytes = kV + kWgStages * kTile;
  static constexpr int kLaunchBytes = kBytes + 1024;  // + the alignment slack
};

// The device helpers exist for the sm_90a device pass (and the host pass, which only parses
// them); an sm_80 image compiles the kernel below as an empty body that is never launched.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
constexpr int kColBlock = 64 * 128;  // bytes of one [64 rows][64 elements] column block

__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk16) {
  // chunk16 = 16-byte chunk of the row (D / 8 of them); column block chunk16 / 8.
  return uint32_t((chunk16 >> 3) * kColBlock + row * 128 + (((chunk16 & 7) ^ (row & 7)) << 4));
}

// cp.async of rows [0, 64) of a tile into its swizzled shared block; rows >= valid_rows are
// zero-filled without reading memory.
template <typename T, int D>
__device__ __forceinline__ void load_swizzled(uint8_t *smem, const T *base, int64_t row_stride,
                                              int valid_rows) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int it = 0; it < 64 * kChunks / kWgThreads; ++it) {
    const int i = it * kWgThreads + threadIdx.x;
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid_rows;
    cp_async_16(smem + swizzled_offset(r, c), ok ? base + r * row_stride + c * 8 : base, ok);
  }
}

// Matrix descriptor of a 128-byte-swizzled operand (PTX ISA, "Matrix Descriptor Format"):
// start address, leading and stride byte offsets (all >> 4), swizzle mode 1 (128 B).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_address, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_address & 0x3FFFF) >> 4) | uint64_t((lbo & 0x3FFFF) >> 4) << 16 |
         uint64_t((sbo & 0x3FFFF) >> 4) << 32 | uint64_t(1) << 62;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes through the generic proxy; wgmma reads through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d (+)= A · Bᵀ, A = 64×16 and B = 64×16, both K-major in shared memory (descriptors); TN is
// the PTX name of the element type.
#define MINIKV_WGMMA_SS_M64N64K16(TN) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TN "." TN " " \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
template <typename T>
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
  if constexpr (std::is_same<T, __half>::value) MINIKV_WGMMA_SS_M64N64K16("f16");
  else MINIKV_WGMMA_SS_M64N64K16("bf16");
}

// d += A · B, A = 64×16 in registers (the mma.sync A-fragment layout per warp), B = 16×N
// MN-major in shared memory (descriptor, transposed).
#define MINIKV_WGMMA_RS_M64N64K16(TN) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TN "." TN " " \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
template <typename T>
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[32], const uint32_t (&a)[4],
                                                    uint64_t desc_b) {
  if constexpr (std::is_same<T, __half>::value) MINIKV_WGMMA_RS_M64N64K16("f16");
  else MINIKV_WGMMA_RS_M64N64K16("bf16");
}

#define MINIKV_WGMMA_RS_M64N128K16(TN) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TN "." TN " " \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
template <typename T>
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t desc_b) {
  if constexpr (std::is_same<T, __half>::value) MINIKV_WGMMA_RS_M64N128K16("f16");
  else MINIKV_WGMMA_RS_M64N128K16("bf16");
}


// S = Q·K_tileᵀ for the CTA's 64 rows: D / 16 k-steps of m64n64k16 (issued, not waited).
template <typename T, int D>
__device__ __forceinline__ void issue_qk(float (&s)[32], uint32_t q_addr, uint32_t k_addr) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t off = uint32_t((kk / 4) * kColBlock + (kk % 4) * 32);  // column block, +32 B
    wgmma_ss_m64n64k16<T>(s, sw128_desc(q_addr + off, 16, 1024),
                          sw128_desc(k_addr + off, 16, 1024), kk > 0);
  }
  wgmma_commit();
}

// O += P·V_tile: 4 k-steps of 16 keys; V is [64 keys][D] swizzled = MN-major B with the
// next 64 channels one column block (8 KB) on (LBO) and the next 8 keys 1 KB on (SBO).
template <typename T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const float (&s)[32], uint32_t v_addr) {
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < kWgKeys / 16; ++kc) {
    const uint32_t a[4] = {DType<T>::pack2(s[8 * kc + 0], s[8 * kc + 1]),
                           DType<T>::pack2(s[8 * kc + 2], s[8 * kc + 3]),
                           DType<T>::pack2(s[8 * kc + 4], s[8 * kc + 5]),
                           DType<T>::pack2(s[8 * kc + 6], s[8 * kc + 7])};
    const uint64_t desc = sw128_desc(v_addr + kc * 2048, kColBlock, 1024);
    if constexpr (D == 128) wgmma_rs_m64n128k16<T>(o, a, desc);
    else wgmma_rs_m64n64k16<T>(o, a, desc);
  }
  wgmma_commit();
}

// Pins accumulator registers around the async wgmma (as CUTLASS's warpgroup_fence_operand):
// the compiler may not move their reads or writes across these points.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
#endif  // wgmma helpers

/// \tparam T dtype of q/k/v/out (__half or __nv_bfloat16)
/// \tparam D head_dim (64 or 128)
template <typename T, int D>
__global__ void __launch_bounds__(kWgThreads, 2)
    prefill_wgmma_kernel(const __grid_constant__ PrefillAttnParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Sm = WgSmem<T, D>;
  // The swizzle pattern repeats on 1024-byte boundaries: the base is rounded up to one (the
  // launch asks for Sm::kBytes + 1024).
  extern __shared__ uint8_t smem_dyn[];
  uint8_t *const smem_raw = smem_dyn + ((1024u - (smem_addr(smem_dyn) & 1023u)) & 1023u);
  uint8_t *const q_s = smem_raw;
  const uint32_t q_addr = smem_addr(q_s), k_addr0 = smem_addr(smem_raw + Sm::kK),
                 v_addr0 = smem_addr(smem_raw + Sm::kV);

  // blockIdx.x = (host tile, head, half): halves of one tile adjacent, the later (longer)
  // half first, the longest tiles first.
  const uint32_t host_tile = blockIdx.x / (2 * p.num_heads);
  const int h = static_cast<int>((blockIdx.x / 2) % p.num_heads);
  const int half = 1 - static_cast<int>(blockIdx.x % 2);
  const uint32_t seq = find_seq(p.seqs, host_tile);
  // n query rows at prompt positions [qp, qp + n) over the keys [0, L) (params.h PrefillKeys).
  const int n = static_cast<int>(p.seqs.len[seq]), qp = static_cast<int>(p.keys.q_pos[seq]);
  const int L = qp + n;
  const uint32_t last = p.seqs.tile_begin[seq + 1] - 1;
  const int q0 = static_cast<int>(last - host_tile) * int(kPrefillQueryTile) + half * kWgRows;
  if (q0 >= n) return;  // the second half of a sequence's last, short tile
  const int qa = qp + q0;  // prompt position of the CTA's first row
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const int64_t tb = p.seqs.token_begin[seq], kb = p.keys.kv_begin[seq];
  const int64_t q_stride = int64_t(p.num_heads) * D, kv_stride = int64_t(p.num_kv_heads) * D;
  const T *q = static_cast<const T *>(p.q) + tb * q_stride + int64_t(h) * D;
  const T *k = static_cast<const T *>(p.k) + kb * kv_stride + int64_t(kvh) * D;
  const T *v = static_cast<const T *>(p.v) + kb * kv_stride + int64_t(kvh) * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int wrow = 16 * warp;  // this warp's rows: wrow + g, wrow + g + 8
  const float scale = p.scale_log2;
  const int n_kv = min((L + kWgKeys - 1) / kWgKeys, (qa + kWgRows - 1) / kWgKeys + 1);  // up to the diagonal

  auto load_kv = [&](int j) {
    const int st = j % kWgStages, k0 = j * kWgKeys;
    load_swizzled<T, D>(smem_raw + Sm::kK + st * Sm::kTile, k + k0 * kv_stride, kv_stride, L - k0);
    load_swizzled<T, D>(smem_raw + Sm::kV + st * Sm::kTile, v + k0 * kv_stride, kv_stride, L - k0);
  };
  load_swizzled<T, D>(q_s, q + q0 * q_stride, q_stride, n - q0);
  load_kv(0);
  cp_async_commit();
  if (n_kv > 1) load_kv(1);
  cp_async_commit();  // (possibly empty): one group per tile keeps the wait counts uniform

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g, g + 8 of the warp
  float s[32], s_next[32];

  cp_async_wait<1>();  // Q and tile 0
  fence_proxy_async();
  __syncthreads();
  issue_qk<T, D>(s, q_addr, k_addr0);
  wgmma_wait<0>();
  fence_regs(s);

  for (int j = 0; j < n_kv; ++j) {
    const int k0 = j * kWgKeys;
    // Tile j + 2 into the stage of tile j − 1, whose P·V finished at the end of iteration j − 1.
    if (j + 2 < n_kv) load_kv(j + 2);
    cp_async_commit();
    const bool next = j + 1 < n_kv;
    if (next) {
      cp_async_wait<1>();  // tile j + 1 (tile j + 2 may be in flight)
      fence_proxy_async();
      __syncthreads();
      issue_qk<T, D>(s_next, q_addr, k_addr0 + ((j + 1) % kWgStages) * Sm::kTile);
      fence_regs(s_next);
    }

    // Mask where the tile reaches past this warp's first row or past L, then softmax.
    if (k0 + kWgKeys - 1 > qa + wrow || k0 + kWgKeys > L) mask_mtile(s, qa + wrow, k0, L, g, tq);
    online_softmax_mtile<D>(s, o, m, l, scale);

    fence_regs(o);
    issue_pv<T, D>(o, s, v_addr0 + (j % kWgStages) * Sm::kTile);
    fence_regs(o);
    wgmma_wait<0>();  // S_{j+1} and this P·V
    fence_regs(o);
    fence_regs(s_next);
    if (next) {
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = s_next[i];
    }
  }
  cp_async_wait<0>();  // no cp.async may still target the staging area below

  // Normalize, stage the rows in the (free) V stages with a padded stride, store 16 B chunks.
  __syncthreads();
  constexpr int kStride = D + 8;
  T *stage = reinterpret_cast<T *>(smem_raw + Sm::kV);
  static_assert(kWgRows * kStride * int(sizeof(T)) <= kWgStages * Sm::kTile, "staging fits");
  float *lse = p.lse + int64_t(h) * p.ws_tokens + p.seqs.ws_offset[seq];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = wrow + g + 8 * r;
    const float inv = 1.0f / sum;
    uint32_t *dst = reinterpret_cast<uint32_t *>(stage + row * kStride + 2 * tq);
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dst[4 * i] = output_pair<T>(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    const float base = m[r] == -INFINITY ? 0.0f : m[r] * scale;
    if (tq == 0 && q0 + row < n) lse[q0 + row] = base + log2f(sum);
  }
  __syncthreads();
  T *out = static_cast<T *>(p.out) + tb * q_stride + int64_t(h) * D;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int it = 0; it < kWgRows * kChunks / kWgThreads; ++it) {
    const int i = it * kWgThreads + threadIdx.x;
    const int r = i / kChunks, c = (i % kChunks) * 8;
    if (q0 + r < n)
      *reinterpret_cast<uint4 *>(out + int64_t(q0 + r) * q_stride + c) =
          *reinterpret_cast<const uint4 *>(stage + r * kStride + c);
  }
#endif
}

}  // namespace

bool prefill_wgmma_usable(minikv_dtype dtype, uint32_t head_dim) {
#if defined(MINIKV_BUILD_SM90A)
  if (const char *e = std::getenv("MINIKV_PREFILL_KERNEL")) {
    if (std::strcmp(e, "mma") == 0) return false;  // the sm_80 kernel, for comparisons
  }
  // Other head_dim values (80, 96, 256) run the mma.sync forward.
  if (!in_list(WgmmaHeadDims{}, head_dim)) return false;
  bool usable = false;
  dispatch_dtype_head_dim<WgmmaHeadDims>(dtype, head_dim, "minikv_cache_create",
                                         [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    cudaFuncAttributes attr{};
    // The sm_90a image is the one loaded on a compute-capability-9.0 device.
    if (cudaFuncGetAttributes(&attr, prefill_wgmma_kernel<T, D>) == cudaSuccess &&
        attr.binaryVersion == 90) {
      MINIKV_CUDA_CHECK(cudaFuncSetAttribute(prefill_wgmma_kernel<T, D>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             WgSmem<T, D>::kLaunchBytes));
      usable = true;
    }
  });
  (void)cudaGetLastError();  // a failed attribute query leaves no sticky error
  return usable;
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

void launch_prefill_wgmma(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                          cudaStream_t stream) {
  dispatch_dtype_head_dim<WgmmaHeadDims>(dtype, head_dim, "minikv_prefill",
                                         [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    const uint32_t grid = p.seqs.tile_begin[p.seqs.n] * p.num_heads * 2;
    prefill_wgmma_kernel<T, D><<<grid, kWgThreads, WgSmem<T, D>::kLaunchBytes, stream>>>(p);
    check_launch_error("prefill_wgmma_kernel");
  });
}

}  // namespace kernels
}  // namespace minikv

// Prefill attention with importance scores, for ragged batches (sequences packed back to
// back), tensor cores through mma.sync m16n8k16 (sm_80+), fp32 accumulation.
//
// Pass 1 (prefill_attention_kernel): FlashAttention-2 forward. One CTA = 64 query rows of
//   one query head (4 warps × 16 rows); K/V tiles of 64 keys up to the causal diagonal;
//   online softmax in log2 units; writes out and the row LSE (fp32, log2 units) to a
//   workspace.
// Pass 2 (prefill_scores_kernel): one CTA = 64 key columns of one KV head. It recomputes
//   QKᵀ for every query tile on or below the diagonal (tiles above it are never visited),
//   for each query head of the GQA group, and adds exp2(s - LSE) — the exact normalized
//   probabilities — into per-column sums held in registers. Each column is owned by one
//   CTA and summed in a fixed order: deterministic, no atomics, no L×L buffer.
//   WINDOW mode is the same pass restricted to the last window_size query rows.
#include "common.cuh"
#include "dispatch.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

constexpr int kTile = static_cast<int>(kPrefillTile);  // query rows = key rows per tile
constexpr int kThreads = 128;                           // 4 warps × 16 query rows

template <int D> __host__ __device__ constexpr int smem_stride() { return D + 8; }  // +16 B: conflict-free ldmatrix

// cp.async of rows [0, 64) of a tile (row r at base + r * row_stride elements) into shared
// [64][D + 8]; rows >= valid_rows are zero-filled without reading memory.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T *smem, const T *base, int64_t row_stride,
                                          int valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool ok = r < valid_rows;
    cp_async_16(smem + r * smem_stride<D>() + c, ok ? base + r * row_stride + c : base, ok);
  }
}

// Sequence of a launch-wide tile index.
__device__ __forceinline__ uint32_t find_seq(const PrefillSeqs &s, uint32_t tile) {
  uint32_t i = 0;
  while (i + 1 < s.n && s.tile_begin[i + 1] <= tile) ++i;
  return i;
}

// A fragments (16 rows × D) of rows [row0, row0 + 16) of a shared tile.
template <typename T, int D>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[D / 16][4], const T *tile, int row0,
                                             int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(a[kk], tile + (row0 + (lane % 8) + ((lane / 8) % 2) * 8) * smem_stride<D>() +
                           kk * 16 + (lane / 16) * 8);
}

// s[nt] (16 rows × 64 keys, 8 n-tiles) = A · Kᵀ with K a shared [64][D + 8] tile.
template <typename T, int D>
__device__ __forceinline__ void qk_tile(float (&s)[8][4], const uint32_t (&a)[D / 16][4],
                                        const T *k_tile, int lane) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k_tile + (np * 16 + (lane % 8) + (lane / 16) * 8) * smem_stride<D>() +
                         kk * 16 + ((lane / 8) % 2) * 8);
      mma_16816<T>(s[2 * np], a[kk], b[0], b[1]);
      mma_16816<T>(s[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

/// \tparam T dtype of q/k/v/out (__half or __nv_bfloat16)
/// \tparam D head_dim (64 or 128)
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prefill_attention_kernel(const __grid_constant__ PrefillAttnParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  constexpr int S = smem_stride<D>();
  T *q_s = reinterpret_cast<T *>(smem_raw);
  T *k_s = q_s + kTile * S;
  T *v_s = k_s + kTile * S;

  const uint32_t seq = find_seq(p.seqs, blockIdx.x);
  const int L = static_cast<int>(p.seqs.len[seq]);
  const int q0 = static_cast<int>(blockIdx.x - p.seqs.tile_begin[seq]) * kTile;
  const int h = blockIdx.y;
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const int64_t tb = p.seqs.token_begin[seq];
  const int64_t q_stride = int64_t(p.num_heads) * D, kv_stride = int64_t(p.num_kv_heads) * D;
  const T *q = static_cast<const T *>(p.q) + tb * q_stride + int64_t(h) * D;
  const T *k = static_cast<const T *>(p.k) + tb * kv_stride + int64_t(kvh) * D;
  const T *v = static_cast<const T *>(p.v) + tb * kv_stride + int64_t(kvh) * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;

  load_tile<T, D>(q_s, q + q0 * q_stride, q_stride, L - q0);
  cp_async_commit();
  load_tile<T, D>(k_s, k, kv_stride, L);
  cp_async_commit();

  const int n_kv = min((L + kTile - 1) / kTile, q0 / kTile + 1);  // up to the diagonal
  uint32_t qa[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int j = 0; j < n_kv; ++j) {
    const int k0 = j * kTile;
    load_tile<T, D>(v_s, v + k0 * kv_stride, kv_stride, L - k0);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K_j have landed
    __syncthreads();
    if (j == 0) load_a_frags<T, D>(qa, q_s, warp * 16, lane);

    float s[8][4];
    qk_tile<T, D>(s, qa, k_s, lane);

    // Scale, causal + length mask, online softmax (rows g and g + 8 of the warp).
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + nt * 8 + 2 * tq + (e & 1);
        const int row = e < 2 ? row_a : row_b;
        const float x = (col > row || col >= L) ? -INFINITY : s[nt][e] * p.scale_log2;
        s[nt][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    float base[2], corr[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // fully masked row (past L): keep 0s
      corr[r] = exp2f(m[r] - base[r]);
      m[r] = mx[r];
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = exp2f(s[nt][e] - base[e / 2]);
        s[nt][e] = pr;
        rs[e / 2] += pr;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
      rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
      l[r] = l[r] * corr[r] + rs[r];
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= corr[0];
      o[dt][1] *= corr[0];
      o[dt][2] *= corr[1];
      o[dt][3] *= corr[1];
    }

    __syncthreads();  // every warp is done with k_s
    if (j + 1 < n_kv) {
      load_tile<T, D>(k_s, k + (k0 + kTile) * kv_stride, kv_stride, L - k0 - kTile);
      cp_async_commit();
      cp_async_wait<1>();  // V_j has landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // O += P · V_j, P straight from the score registers.
#pragma unroll
    for (int kc = 0; kc < kTile / 16; ++kc) {
      uint32_t a[4];
      a[0] = DType<T>::pack2(s[2 * kc][0], s[2 * kc][1]);
      a[1] = DType<T>::pack2(s[2 * kc][2], s[2 * kc][3]);
      a[2] = DType<T>::pack2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
      a[3] = DType<T>::pack2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + (kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * S + dp * 16 +
                                 (lane / 16) * 8);
        mma_16816<T>(o[2 * dp], a, b[0], b[1]);
        mma_16816<T>(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with v_s
  }

  T *out = static_cast<T *>(p.out) + tb * q_stride + int64_t(h) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r ? row_b : row_a;
    if (row >= L) continue;
    const float inv = 1.0f / l[r];
    uint32_t *dst = reinterpret_cast<uint32_t *>(out + row * q_stride);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      dst[(dt * 8 + 2 * tq) / 2] = DType<T>::pack2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    if (tq == 0)
      p.lse[int64_t(h) * p.ws_tokens + p.seqs.ws_offset[seq] + row] = m[r] + log2f(l[r]);
  }
}

/// \tparam T dtype of q/k (__half or __nv_bfloat16)
/// \tparam D head_dim (64 or 128)
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prefill_scores_kernel(const __grid_constant__ PrefillScoreParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  constexpr int S = smem_stride<D>();
  T *k_s = reinterpret_cast<T *>(smem_raw);
  T *q_s = k_s + kTile * S;  // two buffers
  float *red = reinterpret_cast<float *>(q_s + 2 * kTile * S);  // [4][64]

  const uint32_t seq = find_seq(p.seqs, blockIdx.x);
  const int L = static_cast<int>(p.seqs.len[seq]);
  const int k0 = static_cast<int>(blockIdx.x - p.seqs.tile_begin[seq]) * kTile;
  const int kvh = blockIdx.y;
  const int n_rep = p.num_heads / p.num_kv_heads;
  const int row_begin = static_cast<int>(p.row_begin[seq]);
  const int64_t tb = p.seqs.token_begin[seq];
  const uint32_t ws_off = p.seqs.ws_offset[seq];
  const int64_t q_stride = int64_t(p.num_heads) * D, kv_stride = int64_t(p.num_kv_heads) * D;
  const T *k = static_cast<const T *>(p.k) + (tb + k0) * kv_stride + int64_t(kvh) * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;

  // Query tiles with a row >= max(row_begin, k0): on or below the diagonal, in the window.
  const int qt0 = max(row_begin, k0) / kTile;
  const int per_head = (L + kTile - 1) / kTile - qt0;
  const int total = n_rep * per_head;
  auto q_tile_ptr = [&](int it, int &qt, int &h) {
    h = kvh * n_rep + it / per_head;
    qt = qt0 + it % per_head;
    return static_cast<const T *>(p.q) + (tb + int64_t(qt) * kTile) * q_stride + int64_t(h) * D;
  };

  load_tile<T, D>(k_s, k, kv_stride, L - k0);
  cp_async_commit();
  if (total > 0) {
    int qt, h;
    const T *src = q_tile_ptr(0, qt, h);
    load_tile<T, D>(q_s, src, q_stride, L - qt * kTile);
    cp_async_commit();
  }

  float cs[8][2];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) cs[nt][0] = cs[nt][1] = 0.0f;

  for (int it = 0; it < total; ++it) {
    if (it + 1 < total) {
      int qt, h;
      const T *src = q_tile_ptr(it + 1, qt, h);
      load_tile<T, D>(q_s + ((it + 1) & 1) * kTile * S, src, q_stride, L - qt * kTile);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    int qt, h;
    q_tile_ptr(it, qt, h);
    uint32_t qa[D / 16][4];
    load_a_frags<T, D>(qa, q_s + (it & 1) * kTile * S, warp * 16, lane);
    float s[8][4];
    qk_tile<T, D>(s, qa, k_s, lane);

    const int row_a = qt * kTile + warp * 16 + g, row_b = row_a + 8;
    const float *lse = p.lse + int64_t(h) * p.ws_tokens + ws_off;
    // Rows outside [row_begin, L) contribute nothing: LSE = +inf gives exp2(-inf) = 0.
    const float lse_a = (row_a < L && row_a >= row_begin) ? lse[row_a] : INFINITY;
    const float lse_b = (row_b < L && row_b >= row_begin) ? lse[row_b] : INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + nt * 8 + 2 * tq + (e & 1);
        const int row = e < 2 ? row_a : row_b;
        const float x = s[nt][e] * p.scale_log2 - (e < 2 ? lse_a : lse_b);
        cs[nt][e & 1] += (col <= row && col < L) ? exp2f(x) : 0.0f;
      }
    __syncthreads();  // the buffer is refilled by iteration it + 1's prefetch of it + 2
  }

  // Column totals: lanes sharing tq hold the same columns (8 row groups × 2 rows), then the
  // four warps in order.
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float x = cs[nt][e];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (g == 0) red[warp * kTile + nt * 8 + 2 * tq + e] = x;
    }
  __syncthreads();
  if (threadIdx.x < kTile) {
    const int c = threadIdx.x;
    const float total_c = ((red[c] + red[kTile + c]) + red[2 * kTile + c]) + red[3 * kTile + c];
    if (k0 + c < static_cast<int>(p.col_end[seq]))
      p.scores[int64_t(kvh) * p.ws_tokens + ws_off + k0 + c] = total_c;
  }
}

template <typename T, int D> constexpr size_t attention_smem() { return 3u * kTile * smem_stride<D>() * sizeof(T); }
template <typename T, int D> constexpr size_t scores_smem() {
  return 3u * kTile * smem_stride<D>() * sizeof(T) + 4u * kTile * sizeof(float);
}

}  // namespace

bool head_dim_supported(uint32_t head_dim) { return head_dim == 64 || head_dim == 128; }

void configure_prefill_kernels(minikv_dtype dtype, uint32_t head_dim) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_cache_create", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_kernel<T, D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(attention_smem<T, D>())));
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(prefill_scores_kernel<T, D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(scores_smem<T, D>())));
  });
}

void launch_prefill_attention(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                              cudaStream_t stream) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_prefill", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    const dim3 grid(p.seqs.tile_begin[p.seqs.n], p.num_heads);
    prefill_attention_kernel<T, D><<<grid, kThreads, attention_smem<T, D>(), stream>>>(p);
    check_launch_error("prefill_attention_kernel");
  });
}

void launch_prefill_scores(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &p,
                           cudaStream_t stream) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_prefill", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    const dim3 grid(p.seqs.tile_begin[p.seqs.n], p.num_kv_heads);
    prefill_scores_kernel<T, D><<<grid, kThreads, scores_smem<T, D>(), stream>>>(p);
    check_launch_error("prefill_scores_kernel");
  });
}

}  // namespace kernels
}  // namespace minikv

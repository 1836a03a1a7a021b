// The combine of split-K decode partials: each split wrote (max, sum) in log2 units and its
// unnormalized output per query head; out = Σ_s 2^(m_s - m) o_s / Σ_s 2^(m_s - m) l_s.
// Used by both decode strategies (decode_fast.cu, decode_generic.cu).
#include "common.cuh"
#include "dispatch.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

// Threads of a merge CTA: one per channel, in whole warps (head_dim 80: 96 threads).
template <int D> constexpr int kMergeThreads = (D + 31) / 32 * 32;

/// \tparam T dtype of out
/// \tparam D head_dim
/// Weights of all splits first (in parallel, into shared memory), then one thread per
/// channel sums the splits with independent loads in flight.
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads<D>)
    decode_merge_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kThreads = kMergeThreads<D>, kWarps = kThreads / 32;
  __shared__ float w_s[kDecodeMaxSplits];
  __shared__ float red_s[2][kWarps];
  const uint32_t seq = blockIdx.x, h = blockIdx.y, c = threadIdx.x, warp = c / 32, lane = c % 32;
  const uint64_t part0 = (uint64_t(seq) * p.num_heads + h) * p.splits;
  float m = -INFINITY;
  for (uint32_t s = c; s < p.splits; s += kThreads) m = fmaxf(m, p.part_ml[(part0 + s) * 2]);
  m = warp_max(m);
  if (lane == 0) red_s[0][warp] = m;
  __syncthreads();
  m = red_s[0][0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red_s[0][w]);
  float l = 0.0f;
  for (uint32_t s = c; s < p.splits; s += kThreads) {
    const float ms = p.part_ml[(part0 + s) * 2];
    const float w = ms == -INFINITY ? 0.0f : exp2f(ms - m);  // empty split: weight 0
    w_s[s] = w;
    l += w * p.part_ml[(part0 + s) * 2 + 1];
  }
  l = warp_sum(l);
  if (lane == 0) red_s[1][warp] = l;
  __syncthreads();
  l = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) l += red_s[1][w];
  if (c >= uint32_t(D)) return;  // the last warp's spare lanes (D not a multiple of 32)
  float o = 0.0f;
#pragma unroll 8
  for (uint32_t s = 0; s < p.splits; ++s) o = fmaf(w_s[s], p.part_o[(part0 + s) * D + c], o);
  static_cast<T *>(p.out)[(uint64_t(seq) * p.num_heads + h) * D + c] = output_value<T>(o / l);
}

}  // namespace

void launch_decode_merge(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                         cudaStream_t stream) {
  if (p.splits > kDecodeMaxSplits)
    fail(MINIKV_ERR_INTERNAL, "minikv_decode: %u splits (at most %u)", p.splits, kDecodeMaxSplits);
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_decode", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    decode_merge_kernel<T, D><<<dim3(p.n, p.num_heads), kMergeThreads<D>, 0, stream>>>(p);
    check_launch_error("decode_merge_kernel");
  });
}

}  // namespace kernels
}  // namespace minikv

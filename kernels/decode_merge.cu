// The combine of split-K decode partials: each split wrote (max, sum) in log2 units and its
// unnormalized output per query head; out = Σ_s 2^(m_s - m) o_s / Σ_s 2^(m_s - m) l_s.
// Launched after every decode kernel whose split partials are not merged inside it.
#include "common.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "programmatic_launch.h"

namespace minikv {
namespace kernels {
namespace {

// A merge CTA: four channels per thread (one float4 of a partial) times kMergeGroups<D>
// groups of splits, so a thread keeps ~splits / groups independent loads in flight instead
// of walking every split (B = 1 under GQA merges 128 splits per head).
template <int D> constexpr int kMergeQuads = D / 4;
template <int D> constexpr int kMergeGroups = D > 128 ? 4 : 8;
template <int D> constexpr int kMergeThreads = kMergeQuads<D> * kMergeGroups<D>;

/// \tparam T dtype of out
/// \tparam D head_dim (a multiple of 4)
/// The splits' weights first (in parallel, into shared memory), then thread (quad, group)
/// sums the splits s ≡ group (mod groups) of its four channels in ascending order, and the
/// groups' sums are added in group order: deterministic, independent of timing.
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads<D>)
    decode_merge_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kThreads = kMergeThreads<D>, kWarps = (kThreads + 31) / 32;
  constexpr int kQuads = kMergeQuads<D>, kGroups = kMergeGroups<D>;
  // Splits whose outputs a thread loads up front: all of kDecodeMaxSplits at head_dim <= 128
  // (16 float4), a quarter at 256 (8 of 32), within the registers of 256 threads.
  constexpr int kPre = int(kDecodeMaxSplits) / kGroups > 16 ? 8 : int(kDecodeMaxSplits) / kGroups;
  __shared__ float w_s[kDecodeMaxSplits];
  __shared__ float red_s[2][kWarps];
  __shared__ float4 sum_s[kGroups][kQuads];
  const uint32_t seq = blockIdx.x, h = blockIdx.y, t = threadIdx.x, warp = t / 32, lane = t % 32;
  const uint64_t part0 = (uint64_t(seq) * p.num_heads + h) * p.splits;
  pdl_wait();  // launched early behind an sm_90 decode kernel: its partials are complete from here
  // The thread's first kPre partial outputs are loaded before the weights are known, so their
  // memory latency overlaps the (max, sum) passes instead of following them.
  const uint32_t quad = t % kQuads, group = t / kQuads;
  float4 pre[kPre];
#pragma unroll
  for (int i = 0; i < kPre; ++i) {
    const uint32_t s = group + i * kGroups;
    pre[i] = s < p.splits ? reinterpret_cast<const float4 *>(p.part_o + (part0 + s) * D)[quad]
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  float m = -INFINITY;
  for (uint32_t s = t; s < p.splits; s += kThreads) m = fmaxf(m, p.part_ml[(part0 + s) * 2]);
  m = warp_max(m);
  if (lane == 0) red_s[0][warp] = m;
  __syncthreads();
  m = red_s[0][0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red_s[0][w]);
  float l = 0.0f;
  for (uint32_t s = t; s < p.splits; s += kThreads) {
    const float ms = p.part_ml[(part0 + s) * 2];
    const float w = ms == -INFINITY ? 0.0f : exp2f(ms - m);  // empty split: weight 0
    w_s[s] = w;
    l += w * p.part_ml[(part0 + s) * 2 + 1];
  }
  l = warp_sum(l);
  if (lane == 0) red_s[1][warp] = l;
  __syncthreads();
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < kPre; ++i) {
    const uint32_t s = group + i * kGroups;
    if (s < p.splits) {
      const float w = w_s[s];
      o.x = fmaf(w, pre[i].x, o.x);
      o.y = fmaf(w, pre[i].y, o.y);
      o.z = fmaf(w, pre[i].z, o.z);
      o.w = fmaf(w, pre[i].w, o.w);
    }
  }
#pragma unroll 8
  for (uint32_t s = group + kPre * kGroups; s < p.splits; s += kGroups) {
    const float w = w_s[s];
    const float4 v = reinterpret_cast<const float4 *>(p.part_o + (part0 + s) * D)[quad];
    o.x = fmaf(w, v.x, o.x);
    o.y = fmaf(w, v.y, o.y);
    o.z = fmaf(w, v.z, o.z);
    o.w = fmaf(w, v.w, o.w);
  }
  sum_s[group][quad] = o;
  __syncthreads();
  if (t >= uint32_t(D)) return;
  l = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) l += red_s[1][w];
  const float *sums = reinterpret_cast<const float *>(&sum_s[0][0]);
  float out = 0.0f;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) out += sums[g * D + t];
  static_cast<T *>(p.out)[(uint64_t(seq) * p.num_heads + h) * D + t] = output_value<T>(out / l);
}

}  // namespace

#ifndef MINIKV_WARP_EMULATION  // a CPU emulation (tests/emulation) runs the kernel itself
void launch_decode_merge(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                         cudaStream_t stream, bool programmatic) {
  if (p.splits > kDecodeMaxSplits)
    fail(MINIKV_ERR_INTERNAL, "minikv_decode: %u splits (at most %u)", p.splits, kDecodeMaxSplits);
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_decode", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    launch_kernel(decode_merge_kernel<T, D>, dim3(p.n, p.num_heads), kMergeThreads<D>, 0, stream, programmatic,
                  "decode_merge_kernel", p);
  });
}
#endif

}  // namespace kernels
}  // namespace minikv

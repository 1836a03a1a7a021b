// Decode attention over the compressed cache: flash-decoding with fused dequantization.
//
// decode_split_kernel: one CTA per (split, KV head × head chunk, sequence). The cached
//   tokens [0, quantized + residual) of a sequence are cut into `splits` contiguous ranges;
//   a CTA walks its range in tiles of 128 tokens: each thread dequantizes one token's key
//   once and scores it against every query head of its chunk (one KV load serves the GQA
//   group), the tile's online-softmax update runs per head in shared memory, and each
//   thread then accumulates one channel of P·V̂ for every head. Quantized tokens
//   (pool blocks through the block-table mirror) and residual tokens (16-bit) share one
//   softmax. fp32 throughout, logits in log2 units. Writes (max, sum, unnormalized out).
// decode_merge_kernel: one CTA per (sequence, query head) merges the splits.
#include "common.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "../src/quant.h"

namespace minikv {
namespace kernels {
namespace {

constexpr int kThreads = static_cast<int>(kDecodeTile);

/// \tparam T   dtype of q/out and of 16-bit storage (__half or __nv_bfloat16)
/// \tparam D   head_dim (64 or 128)
/// \tparam HPC query heads per CTA (a divisor of the GQA group size: 1, 2, 4 or 8)
template <typename T, int D, int HPC>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const __grid_constant__ DecodeParams p) {
  using Tr = DType<T>;
  constexpr int kTpc = kThreads / D;  // threads per output channel (1 or 2)
  __shared__ float q_s[HPC][D];
  __shared__ float p_s[HPC][kThreads];
  __shared__ float m_s[HPC], l_s[HPC], corr_s[HPC];

  const uint32_t split = blockIdx.x, seq = blockIdx.z;
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  const uint32_t chunks = n_rep / HPC;
  const uint32_t kvh = blockIdx.y / chunks;
  const uint32_t h0 = kvh * n_rep + (blockIdx.y % chunks) * HPC;
  const uint32_t nq = p.quantized[seq], n = nq + p.residual[seq];
  const uint32_t per = (n + p.splits - 1) / p.splits;
  const uint32_t begin = min(n, split * per), end = min(n, begin + per);

  const BlockLayout &bl = p.st.block;
  const ResidualLayout &rl = p.st.res;
  const uint32_t R = bl.tokens, G = bl.group, kb = bl.key_bits, vb = bl.value_bits;
  const uint32_t slot = p.slot[seq];
  const int32_t *table = p.st.block_table + uint64_t(slot) * p.st.max_blocks_per_seq;
  const uint8_t *res_slot = p.st.residual + uint64_t(slot) * rl.bytes;
  const T *k_res = reinterpret_cast<const T *>(res_slot + rl.k) + uint64_t(kvh) * R * D;
  const T *v_res = reinterpret_cast<const T *>(res_slot + rl.v) + uint64_t(kvh) * R * D;

  const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T *q = static_cast<const T *>(p.q) + (uint64_t(seq) * p.num_heads + h0) * D;
  for (uint32_t i = tid; i < HPC * D; i += kThreads)
    q_s[i / D][i % D] = Tr::to_float(q[i]) * p.scale_log2;
  if (tid < HPC) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  __syncthreads();

  const uint32_t c = tid % D, sub = tid / D;
  float acc[HPC];
#pragma unroll
  for (int h = 0; h < HPC; ++h) acc[h] = 0.0f;

  for (uint32_t tile = begin; tile < end; tile += kThreads) {
    // ---- logits: thread = token ----
    const uint32_t t = tile + tid;
    float lg[HPC];
#pragma unroll
    for (int h = 0; h < HPC; ++h) lg[h] = t < end ? 0.0f : -INFINITY;
    if (t < end) {
      if (t < nq) {
        const uint8_t *block = p.st.pool + uint64_t(table[t / R]) * bl.bytes;
        const uint32_t row = t % R;
        const uint8_t *k_row = block + bl.k_codes + kvh * bl.k_codes_head() + row * bl.k_row_bytes;
        if (kb == 16) {
          const T *kr = reinterpret_cast<const T *>(k_row);
          for (int cc = 0; cc < D; ++cc) {
            const float kc = Tr::to_float(kr[cc]);
#pragma unroll
            for (int h = 0; h < HPC; ++h) lg[h] += q_s[h][cc] * kc;
          }
        } else {
          const T *ks = reinterpret_cast<const T *>(block + bl.k_scale + kvh * bl.k_scale_head()) + (row / G) * D;
          const T *km = reinterpret_cast<const T *>(block + bl.k_min + kvh * bl.k_scale_head()) + (row / G) * D;
          const uint32_t *words = reinterpret_cast<const uint32_t *>(k_row);
          const uint32_t per_word = 32u / kb, levels = quant_levels(kb);
          for (uint32_t w = 0; w < D / per_word; ++w) {
            const uint32_t word = words[w];
            for (uint32_t j = 0; j < per_word; ++j) {
              const uint32_t cc = w * per_word + j;
              const float kc = dequantize_code((word >> (j * kb)) & levels, Tr::to_float(km[cc]),
                                               Tr::to_float(ks[cc]));
#pragma unroll
              for (int h = 0; h < HPC; ++h) lg[h] += q_s[h][cc] * kc;
            }
          }
        }
      } else {
        const T *kr = k_res + uint64_t(t - nq) * D;
        for (int cc = 0; cc < D; ++cc) {
          const float kc = Tr::to_float(kr[cc]);
#pragma unroll
          for (int h = 0; h < HPC; ++h) lg[h] += q_s[h][cc] * kc;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < HPC; ++h) p_s[h][tid] = lg[h];
    __syncthreads();

    // ---- online softmax per head: warp w updates heads w, w + 4, ... ----
    for (uint32_t h = warp; h < HPC; h += kThreads / 32) {
      float mx = -INFINITY;
      for (uint32_t i = lane; i < kThreads; i += 32) mx = fmaxf(mx, p_s[h][i]);
      mx = warp_max(mx);
      const float m_new = fmaxf(m_s[h], mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      float sum = 0.0f;
      for (uint32_t i = lane; i < kThreads; i += 32) {
        const float e = exp2f(p_s[h][i] - base);
        p_s[h][i] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const float corr = exp2f(m_s[h] - base);
        corr_s[h] = corr;
        l_s[h] = l_s[h] * corr + sum;
        m_s[h] = m_new;
      }
    }
    __syncthreads();

    // ---- P · V̂: thread = channel c (and token parity `sub` when D < 128) ----
#pragma unroll
    for (int h = 0; h < HPC; ++h) acc[h] *= corr_s[h];
    const uint32_t n_tile = min(uint32_t(kThreads), end - tile);
    for (uint32_t i = sub; i < n_tile; i += kTpc) {
      const uint32_t tt = tile + i;
      float vc;
      if (tt < nq) {
        const uint8_t *block = p.st.pool + uint64_t(table[tt / R]) * bl.bytes;
        const uint32_t row = tt % R;
        const uint8_t *v_row = block + bl.v_codes + kvh * bl.v_codes_head() + row * bl.v_row_bytes;
        if (vb == 16) {
          vc = Tr::to_float(reinterpret_cast<const T *>(v_row)[c]);
        } else {
          const uint32_t per_word = 32u / vb, groups = D / G;
          const uint32_t code = unpack_code(reinterpret_cast<const uint32_t *>(v_row), c, vb);
          const uint64_t gi = uint64_t(row) * groups + c / G;
          const T *vs = reinterpret_cast<const T *>(block + bl.v_scale + kvh * bl.v_scale_head());
          const T *vm = reinterpret_cast<const T *>(block + bl.v_min + kvh * bl.v_scale_head());
          (void)per_word;
          vc = dequantize_code(code, Tr::to_float(vm[gi]), Tr::to_float(vs[gi]));
        }
      } else {
        vc = Tr::to_float(v_res[uint64_t(tt - nq) * D + c]);
      }
#pragma unroll
      for (int h = 0; h < HPC; ++h) acc[h] += p_s[h][i] * vc;
    }
    __syncthreads();  // p_s is rewritten by the next tile
  }

  // ---- partial results ----
  if (kTpc > 1) {  // fold the token-parity halves (p_s is free now)
    if (sub == 1)
#pragma unroll
      for (int h = 0; h < HPC; ++h) p_s[h][c] = acc[h];
    __syncthreads();
  }
  if (sub == 0) {
#pragma unroll
    for (int h = 0; h < HPC; ++h) {
      const float a = kTpc > 1 ? acc[h] + p_s[h][c] : acc[h];
      const uint64_t part = (uint64_t(seq) * p.num_heads + h0 + h) * p.splits + split;
      p.part_o[part * D + c] = a;
      if (c == 0) {
        p.part_ml[part * 2] = m_s[h];
        p.part_ml[part * 2 + 1] = l_s[h];
      }
    }
  }
}

/// \tparam T dtype of out
/// \tparam D head_dim
template <typename T, int D>
__global__ void __launch_bounds__(D) decode_merge_kernel(const __grid_constant__ DecodeParams p) {
  const uint32_t seq = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
  const uint64_t part0 = (uint64_t(seq) * p.num_heads + h) * p.splits;
  float m = -INFINITY;
  for (uint32_t s = 0; s < p.splits; ++s) m = fmaxf(m, p.part_ml[(part0 + s) * 2]);
  float l = 0.0f, o = 0.0f;
  for (uint32_t s = 0; s < p.splits; ++s) {
    const float ms = p.part_ml[(part0 + s) * 2];
    if (ms == -INFINITY) continue;  // empty split
    const float w = exp2f(ms - m);
    l += p.part_ml[(part0 + s) * 2 + 1] * w;
    o += p.part_o[(part0 + s) * D + c] * w;
  }
  static_cast<T *>(p.out)[(uint64_t(seq) * p.num_heads + h) * D + c] = DType<T>::from_float(o / l);
}

template <typename T, int D, int HPC>
void launch_impl(const DecodeParams &p, cudaStream_t stream) {
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  const dim3 grid(p.splits, p.num_kv_heads * (n_rep / HPC), p.n);
  decode_split_kernel<T, D, HPC><<<grid, kThreads, 0, stream>>>(p);
  check_launch_error("decode_split_kernel");
  decode_merge_kernel<T, D><<<dim3(p.n, p.num_heads), D, 0, stream>>>(p);
  check_launch_error("decode_merge_kernel");
}

}  // namespace

void launch_decode(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                   cudaStream_t stream) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_decode", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    switch (p.heads_per_cta) {
      case 8: launch_impl<T, D, 8>(p, stream); return;
      case 4: launch_impl<T, D, 4>(p, stream); return;
      case 2: launch_impl<T, D, 2>(p, stream); return;
      case 1: launch_impl<T, D, 1>(p, stream); return;
      default:
        fail(MINIKV_ERR_INTERNAL, "minikv_decode: heads_per_cta %u not compiled", p.heads_per_cta);
    }
  });
}

}  // namespace kernels
}  // namespace minikv

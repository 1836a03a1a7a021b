// Append of one token's K/V per sequence into its 16-bit residual slot and, when the slot
// becomes full, the flush in the same launch: the oldest F of its R tokens are quantized into
// pool blocks (the same store_group as the prefill, so the bytes equal the CPU backend's) and
// the other R - F move to the front of the slot.
// One CTA per (sequence, KV head). The block-table mirror is updated by the launch itself
// from its parameters, so the step stays capturable in a CUDA graph.
#include "common.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "quantize.cuh"

namespace minikv {
namespace kernels {
namespace {

constexpr int kAppendThreads = 128;

/// \tparam T dtype of k/v and of the residual (__half or __nv_bfloat16)
template <typename T>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const __grid_constant__ AppendParams p) {
  const uint32_t i = blockIdx.x, head = blockIdx.y;
  const AppendItemParams &it = p.items[i];
  const BlockLayout &bl = p.st.block;
  const ResidualLayout &rl = p.st.res;
  const uint32_t D = bl.head_dim, R = bl.tokens, G = bl.group, Hkv = bl.kv_heads;

  uint8_t *slot = p.st.residual + uint64_t(it.slot) * rl.bytes;
  T *k_res = reinterpret_cast<T *>(slot + rl.k) + uint64_t(head) * R * D;
  T *v_res = reinterpret_cast<T *>(slot + rl.v) + uint64_t(head) * R * D;
  int32_t *pos = reinterpret_cast<int32_t *>(slot + rl.positions) + uint64_t(head) * R;
  const T *k = static_cast<const T *>(p.k) + (uint64_t(it.input) * Hkv + head) * D;
  const T *v = static_cast<const T *>(p.v) + (uint64_t(it.input) * Hkv + head) * D;

  for (uint32_t c = threadIdx.x; c < D; c += kAppendThreads) {
    k_res[uint64_t(it.row) * D + c] = k[c];
    v_res[uint64_t(it.row) * D + c] = v[c];
  }
  if (threadIdx.x == 0) pos[it.row] = it.position;
  if (!it.flush) return;
  __syncthreads();  // the full residual (this token included) is visible to the CTA

  const uint32_t q = it.quantized, F = p.flush_tokens;
  if (head == 0 && threadIdx.x == 0) {
    int32_t *table = p.st.block_table + uint64_t(it.slot) * p.st.max_blocks_per_seq;
    table[q / R] = it.block_lo;
    table[(q + F - 1) / R] = it.block_hi;
  }
  for (uint32_t g0 = 0; g0 < F; g0 += G) {
    const uint32_t t0 = q + g0;  // cached-token index of the group (groups never straddle blocks)
    const int32_t block_id = t0 / R == q / R ? it.block_lo : it.block_hi;
    uint8_t *block = p.st.pool + uint64_t(block_id) * bl.bytes;
    store_group<T>(
        bl, block, head, t0 % R, [&](uint32_t t) -> const T * { return k_res + uint64_t(g0 + t) * D; },
        [&](uint32_t t) -> const T * { return v_res + uint64_t(g0 + t) * D; },
        [&](uint32_t t) { return pos[g0 + t]; });
  }
  // store_group ends with a barrier: rows [0, F) are read. Rows [F, R) move down F rows at
  // a time, in order: a step's source and destination never overlap (at most F rows), and
  // the barrier orders its reads before the next step overwrites them.
  const uint32_t vecs = D * sizeof(T) / sizeof(uint4);  // 16-byte vectors per row
  uint4 *k_vec = reinterpret_cast<uint4 *>(k_res), *v_vec = reinterpret_cast<uint4 *>(v_res);
  for (uint32_t first = 0; first + F < R; first += F) {
    const uint32_t rows = min(F, R - F - first);
    for (uint32_t i = threadIdx.x; i < rows * vecs; i += kAppendThreads) {
      const uint64_t dst = uint64_t(first) * vecs + i, src = dst + uint64_t(F) * vecs;
      k_vec[dst] = k_vec[src];
      v_vec[dst] = v_vec[src];
    }
    for (uint32_t r = threadIdx.x; r < rows; r += kAppendThreads) pos[first + r] = pos[first + r + F];
    __syncthreads();
  }
}

}  // namespace

#ifndef MINIKV_WARP_EMULATION  // a CPU emulation (tests/emulation) runs the kernel itself
void launch_append(minikv_dtype dtype, const AppendParams &p, cudaStream_t stream) {
  dispatch_dtype(dtype, "minikv_append", [&](auto tag) {
    using T = decltype(tag);
    append_kernel<T><<<dim3(p.n, p.st.block.kv_heads), kAppendThreads, 0, stream>>>(p);
    check_launch_error("append_kernel");
  });
}
#endif

}  // namespace kernels
}  // namespace minikv

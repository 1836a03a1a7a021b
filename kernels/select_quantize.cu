// Selection of the kept tokens on the GPU (no host round trip of the scores) and their
// quantized store into the pool.
//
// select_kernel: one CTA per (sequence, KV head). The kept list starts with the sinks
//   [0, n_sink); the n_heavy best candidates of [n_sink, candidates) are found by a
//   4-pass radix select (8-bit digits) on order-preserving 32-bit keys of the scores
//   (the WINDOW max-pool applied once, by the first pass, which parks the keys in the kept
//   list for the others; one warp finds each digit), which yields the exact key of the
//   n_heavy-th best and how many of the candidates equal to it are still needed; a
//   compaction in position order then writes them ascending, followed by the protected
//   suffix. The order is the one of src/policy.cpp select_kept: higher score first, ties
//   to the lower position, NaN lowest (as -inf), -0 equal to +0.
// store_kept_kernel: one CTA per (sequence, KV head, group of G kept tokens after the
//   sinks): gathers the rows from the caller's k/v, quantizes and packs them into their
//   pool block (quantize.cuh); the task after the last group copies the sinks into the
//   slot's sink region and the tail (< G tokens) into the 16-bit residual.
#include "common.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "quantize.cuh"

namespace minikv {
namespace kernels {
namespace {

constexpr int kSelectThreads = 512;
constexpr int kStoreThreads = 128;

// Larger key = better: order-preserving map of the float, NaN as -inf, -0 as +0.
__device__ __forceinline__ uint32_t order_key(float s) {
  if (isnan(s)) s = -INFINITY;
  if (s == 0.0f) s = 0.0f;
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Score of candidate j; with pooling, the max over [j - k/2, j + k/2] ∩ [0, prefix) scanned
// left to right like std::max (policy.cpp max_pool_1d).
__device__ __forceinline__ float candidate_score(const float *sc, uint32_t j, uint32_t pool,
                                                 uint32_t prefix) {
  if (pool <= 1) return sc[j];
  const uint32_t half = pool / 2;
  const uint32_t lo = j >= half ? j - half : 0;
  const uint32_t hi = min(j + half, prefix - 1);
  float m = sc[lo];
  for (uint32_t i = lo + 1; i <= hi; ++i) m = m < sc[i] ? sc[i] : m;
  return m;
}

// Exclusive prefix count of `flag` over the CTA (in thread order) and the CTA total.
// scratch: shared [kSelectThreads / 32]. Contains __syncthreads().
__device__ __forceinline__ void block_count(bool flag, uint32_t &before, uint32_t &total,
                                            uint32_t *scratch) {
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) scratch[warp] = __popc(ballot);
  __syncthreads();
  uint32_t off = 0, sum = 0;
  for (uint32_t w = 0; w < kSelectThreads / 32; ++w) {
    off += w < warp ? scratch[w] : 0;
    sum += scratch[w];
  }
  before = off + __popc(ballot & ((1u << lane) - 1u));
  total = sum;
  __syncthreads();
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const __grid_constant__ SelectParams p) {
  __shared__ uint32_t hist[256];
  __shared__ uint32_t scan_a[kSelectThreads / 32], scan_b[kSelectThreads / 32];
  __shared__ uint32_t s_prefix, s_need;

  const uint32_t seq = blockIdx.x, kvh = blockIdx.y;
  const uint32_t L = p.seqs.len[seq], off = p.seqs.ws_offset[seq];
  const uint32_t n = p.candidates[seq], k = p.n_heavy[seq], first = p.n_sink[seq];
  int32_t *kept = p.kept + uint64_t(kvh) * p.ws_tokens + off;
  const uint32_t tid = threadIdx.x;

  if (p.mode[seq] == 0) {  // keep everything (the sinks are its first positions)
    for (uint32_t t = tid; t < L; t += kSelectThreads) kept[t] = static_cast<int32_t>(t);
    return;
  }
  for (uint32_t t = tid; t < first; t += kSelectThreads) kept[t] = static_cast<int32_t>(t);
  uint32_t heavy = 0;
  if (p.mode[seq] == 2) {
    const float *sc = p.scores + uint64_t(kvh) * p.ws_tokens + off;
    const uint32_t pool = p.pool_kernel, prefix = p.scored_prefix[seq];
    // A pooled key costs `pool` loads. The first pass parks each candidate's key in its own
    // slot of `kept` (as bits), which later passes and the compaction read instead; the
    // compaction overwrites slot j only after every key up to j has been read (it writes
    // positions < the end of the 512 candidates it has read).
    uint32_t *parked = reinterpret_cast<uint32_t *>(kept);
    const bool park = pool > 1;
    auto key_of = [&](uint32_t j, bool parked_yet) {
      return park && parked_yet ? parked[j] : order_key(candidate_score(sc, j, pool, prefix));
    };
    // Radix select of the k-th largest key.
    uint32_t prefix_key = 0, mask = 0, need = k;
    for (int pass = 0; pass < 4; ++pass) {
      const int shift = 24 - 8 * pass;
      for (uint32_t b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
      __syncthreads();
      for (uint32_t j = first + tid; j < n; j += kSelectThreads) {
        const uint32_t key = key_of(j, pass > 0);
        if (park && pass == 0) parked[j] = key;
        if ((key & mask) == prefix_key) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      // The digit: the highest bin b with (keys in bins > b) < need <= (keys in bins >= b),
      // found by warp 0 (8 bins per lane, a suffix sum across lanes); bin 0 if fewer than
      // `need` keys match, as a scan down from bin 255 would end. need >= 1 throughout
      // (mode 2 has n_heavy >= 1, and each pass leaves need - cum >= 1), so one lane writes.
      if (tid < 32) {
        uint32_t count[8], lane_keys = 0;
        for (int i = 0; i < 8; ++i) {
          count[i] = hist[tid * 8 + i];
          lane_keys += count[i];
        }
        uint32_t from_lane = lane_keys;  // keys in this lane's bins and every higher lane's
        for (uint32_t d = 1; d < 32; d <<= 1) {
          const uint32_t up = __shfl_down_sync(0xffffffffu, from_lane, d);
          if (tid + d < 32) from_lane += up;
        }
        uint32_t cum = from_lane - lane_keys;  // keys in higher lanes' bins
        if ((cum < need && from_lane >= need) || (tid == 0 && from_lane < need)) {
          for (int i = 7; i >= 0; --i) {
            if (cum + count[i] >= need || (tid == 0 && i == 0)) {
              s_prefix = prefix_key | (uint32_t(tid * 8 + i) << shift);
              s_need = need - cum;
              break;
            }
            cum += count[i];
          }
        }
      }
      __syncthreads();
      prefix_key = s_prefix;
      need = s_need;
      mask |= 255u << shift;
      __syncthreads();
    }
    // Keys > threshold are kept; of the keys == threshold, the `need` lowest positions.
    uint32_t out = first, eq_seen = 0;
    for (uint32_t base = first; base < n; base += kSelectThreads) {
      const uint32_t j = base + tid;
      const uint32_t key = j < n ? key_of(j, true) : 0u;
      const bool gt = j < n && key > prefix_key, eq = j < n && key == prefix_key;
      uint32_t eq_before, eq_total;
      block_count(eq, eq_before, eq_total, scan_a);
      const bool keep = gt || (eq && eq_seen + eq_before < need);
      uint32_t keep_before, keep_total;
      block_count(keep, keep_before, keep_total, scan_b);
      if (keep) kept[out + keep_before] = static_cast<int32_t>(j);
      out += keep_total;
      eq_seen += eq_total;
    }
    heavy = k;
  }
  // The protected suffix [candidates, L).
  for (uint32_t t = tid; t < L - n; t += kSelectThreads) kept[first + heavy + t] = static_cast<int32_t>(n + t);
}

/// \tparam T dtype of k/v and of 16-bit storage (__half or __nv_bfloat16)
template <typename T>
__global__ void __launch_bounds__(kStoreThreads) store_kept_kernel(const __grid_constant__ StoreParams p) {
  const uint32_t task = blockIdx.x, head = blockIdx.y, seq = blockIdx.z;
  const BlockLayout &bl = p.st.block;
  const uint32_t G = bl.group, D = bl.head_dim, R = bl.tokens, Hkv = bl.kv_heads;
  const uint32_t sinks = p.sinks[seq], quantized = p.quantized[seq], n_keep = p.n_keep[seq];
  const int32_t *kept = p.kept + uint64_t(head) * p.ws_tokens + p.seqs.ws_offset[seq];
  const int64_t tb = p.seqs.token_begin[seq];
  const T *k = static_cast<const T *>(p.k);
  const T *v = static_cast<const T *>(p.v);
  auto src_row = [&](const T *x, uint32_t t) { return x + ((tb + kept[t]) * Hkv + head) * D; };

  if (task < quantized / G) {
    const uint32_t t0 = task * G;  // block index; kept index sinks + t0
    const int32_t block_id = p.st.block_table[uint64_t(p.slot[seq]) * p.st.max_blocks_per_seq + t0 / R];
    uint8_t *block = p.st.pool + uint64_t(block_id) * bl.bytes;
    const int32_t *group = kept + sinks + t0;
    store_group<T>(
        bl, block, head, t0 % R, [&](uint32_t t) { return src_row(k, sinks + t0 + t); },
        [&](uint32_t t) { return src_row(v, sinks + t0 + t); }, [&](uint32_t t) { return group[t]; });
  } else if (task == quantized / G && n_keep > quantized) {
    const ResidualLayout &rl = p.st.res;
    uint8_t *slot = p.st.residual + uint64_t(p.slot[seq]) * rl.bytes;
    const uint64_t S = rl.sink_tokens;
    T *k_sink = reinterpret_cast<T *>(slot + rl.sink_k) + uint64_t(head) * S * D;
    T *v_sink = reinterpret_cast<T *>(slot + rl.sink_v) + uint64_t(head) * S * D;
    for (uint32_t i = threadIdx.x; i < sinks * D; i += kStoreThreads) {
      const uint32_t t = i / D, c = i % D;
      k_sink[uint64_t(t) * D + c] = src_row(k, t)[c];
      v_sink[uint64_t(t) * D + c] = src_row(v, t)[c];
    }
    T *k_res = reinterpret_cast<T *>(slot + rl.k) + uint64_t(head) * R * D;
    T *v_res = reinterpret_cast<T *>(slot + rl.v) + uint64_t(head) * R * D;
    int32_t *pos = reinterpret_cast<int32_t *>(slot + rl.positions) + uint64_t(head) * R;
    const uint32_t first = sinks + quantized, tail = n_keep - first;
    for (uint32_t i = threadIdx.x; i < tail * D; i += kStoreThreads) {
      const uint32_t t = i / D, c = i % D;
      k_res[uint64_t(t) * D + c] = src_row(k, first + t)[c];
      v_res[uint64_t(t) * D + c] = src_row(v, first + t)[c];
    }
    for (uint32_t t = threadIdx.x; t < tail; t += kStoreThreads) pos[t] = kept[first + t];
  }
}

__global__ void set_block_table_kernel(const __grid_constant__ TableParams p) {
  for (uint32_t i = threadIdx.x; i < p.count; i += blockDim.x)
    p.block_table[uint64_t(p.slot) * p.max_blocks_per_seq + p.first + i] = p.ids[i];
}

}  // namespace

void launch_select(const SelectParams &p, uint32_t num_kv_heads, cudaStream_t stream) {
  select_kernel<<<dim3(p.seqs.n, num_kv_heads), kSelectThreads, 0, stream>>>(p);
  check_launch_error("select_kernel");
}

void launch_store_kept(minikv_dtype dtype, const StoreParams &p, uint32_t max_tasks,
                       cudaStream_t stream) {
  if (max_tasks == 0) return;
  dispatch_dtype(dtype, "minikv_prefill", [&](auto tag) {
    using T = decltype(tag);
    store_kept_kernel<T><<<dim3(max_tasks, p.st.block.kv_heads, p.seqs.n), kStoreThreads, 0, stream>>>(p);
    check_launch_error("store_kept_kernel");
  });
}

void launch_set_block_table(const TableParams &p, cudaStream_t stream) {
  if (p.count == 0) return;
  set_block_table_kernel<<<1, 256, 0, stream>>>(p);
  check_launch_error("set_block_table_kernel");
}

}  // namespace kernels
}  // namespace minikv

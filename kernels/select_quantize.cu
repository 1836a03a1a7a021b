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
//   suffix. Every sweep over the candidates gives each thread 8 keys whose loads go out
//   together (a sweep waits for memory about once), histogram adds are aggregated per warp,
//   and the compaction places a sweep's 8,192 keys with two CTA-wide prefix sums. The order
//   is the one of src/policy.cpp select_kept: higher score first, ties to the lower
//   position, NaN lowest (as -inf), -0 equal to +0.
// store_kept_kernel: one CTA per (sequence, KV head, group of G kept tokens after the
//   sinks): gathers the rows from the caller's k/v, quantizes and packs them into their
//   pool block (quantize.cuh); the task after the last group copies the sinks into the
//   slot's sink region and the tail (< G tokens) into the 16-bit residual. The tasks of the
//   protected suffix (and of everything when all is kept) know their positions without the
//   selection: they run first and store while the score pass and the selection still run,
//   on the SMs those leave idle; the others wait for the selection.
#include "common.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "programmatic_launch.h"
#include "quantize.cuh"

namespace minikv {
namespace kernels {
namespace {

constexpr int kSelectThreads = 1024;
constexpr int kSelectWarps = kSelectThreads / 32;
// Keys a thread takes per sweep of the candidates: their loads are issued together, so a
// sweep of 8,192 keys waits for memory about once.
constexpr int kSelectKeys = 8;
constexpr uint32_t kSelectSweep = kSelectThreads * kSelectKeys;
constexpr uint32_t kNoBin = 256;  // a key outside the histogram
constexpr int kStoreThreads = 128;
static_assert(kSelectWarps == 32, "block_exclusive_sum scans the warp totals with one warp's lanes");

// Larger key = better: order-preserving map of the float, NaN as -inf, -0 as +0.
__device__ __forceinline__ uint32_t order_key(float s) {
  if (isnan(s)) s = -INFINITY;
  if (s == 0.0f) s = 0.0f;
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Keys of candidates j[i]: with pooling (pool > 1), the max of the scores over
// [j - pool/2, j + pool/2] ∩ [0, prefix) scanned left to right like std::max
// (policy.cpp max_pool_1d). Each window is walked as `pool` loads from its first index,
// clamped to its last: a repeat of the last score leaves the scan's result as it was
// (m < x is false once m is x, NaN included), and every step issues all K loads at once.
template <int K>
__device__ __forceinline__ void candidate_keys(const float *sc, const uint32_t (&j)[K], uint32_t pool,
                                               uint32_t prefix, uint32_t (&key)[K]) {
  if (pool <= 1) {
#pragma unroll
    for (int i = 0; i < K; ++i) key[i] = order_key(sc[j[i]]);
    return;
  }
  const uint32_t half = pool / 2;
  uint32_t lo[K], hi[K];
  float m[K];
#pragma unroll
  for (int i = 0; i < K; ++i) {
    lo[i] = j[i] >= half ? j[i] - half : 0;
    hi[i] = min(j[i] + half, prefix - 1);
    m[i] = sc[lo[i]];
  }
  for (uint32_t d = 1; d < pool; ++d)
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const float x = sc[min(lo[i] + d, hi[i])];
      m[i] = m[i] < x ? x : m[i];
    }
#pragma unroll
  for (int i = 0; i < K; ++i) key[i] = order_key(m[i]);
}

// Exclusive prefix sum of x over the CTA in thread order; *total gets the CTA's sum.
// scratch: shared [kSelectWarps], written here and read after this call's barrier by every
// warp, so consecutive calls must alternate between two scratch arrays (the barrier of the
// call in between orders one call's reads before the next one's writes).
__device__ __forceinline__ uint32_t block_exclusive_sum(uint32_t x, uint32_t *total, uint32_t *scratch) {
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t inc = x;
#pragma unroll
  for (uint32_t d = 1; d < 32; d <<= 1) {
    const uint32_t up = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += up;
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  // Every warp scans the warp totals itself: lane w holds the totals of warps <= w.
  const uint32_t w_total = scratch[lane];
  uint32_t w_inc = w_total;
#pragma unroll
  for (uint32_t d = 1; d < 32; d <<= 1) {
    const uint32_t up = __shfl_up_sync(0xffffffffu, w_inc, d);
    if (lane >= d) w_inc += up;
  }
  *total = __shfl_sync(0xffffffffu, w_inc, 31);
  return __shfl_sync(0xffffffffu, w_inc - w_total, warp) + inc - x;
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const __grid_constant__ SelectParams p) {
  __shared__ uint32_t hist[256];
  __shared__ uint32_t scan_a[kSelectWarps], scan_b[kSelectWarps];
  __shared__ uint32_t s_prefix, s_need, s_whole;

  pdl_launch_dependents();
  pdl_wait();  // the score pass's sums (and `kept`, which nothing before writes, is written only after)
  const uint32_t seq = blockIdx.x, kvh = blockIdx.y;
  const uint32_t L = p.seqs.len[seq], off = p.seqs.ws_offset[seq];
  const uint32_t n = p.candidates[seq], k = p.n_heavy[seq], first = p.n_sink[seq];
  int32_t *kept = p.kept + uint64_t(kvh) * p.ws_tokens + off;
  const uint32_t tid = threadIdx.x, lane = tid % 32;

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
    // compaction of a sweep writes positions below the sweep's end only after every key of
    // the sweep has been read (its first barrier), and later sweeps read beyond that end.
    uint32_t *parked = reinterpret_cast<uint32_t *>(kept);
    const bool park = pool > 1;
    // The keys of candidates j[i] (clamped into [first, n): callers mask the rest).
    auto load_keys = [&](const uint32_t (&j)[kSelectKeys], bool parked_yet, uint32_t (&key)[kSelectKeys]) {
      uint32_t jc[kSelectKeys];
#pragma unroll
      for (int i = 0; i < kSelectKeys; ++i) jc[i] = min(j[i], n - 1);
      if (park && parked_yet) {
#pragma unroll
        for (int i = 0; i < kSelectKeys; ++i) key[i] = parked[jc[i]];
      } else {
        candidate_keys<kSelectKeys>(sc, jc, pool, prefix, key);
      }
    };
    // Radix select of the k-th largest key: each pass counts the keys that match the digits
    // found so far by their next digit (lanes of a warp with the same digit add once).
    uint32_t prefix_key = 0, mask = 0, need = k;
    for (int pass = 0; pass < 4; ++pass) {
      const int shift = 24 - 8 * pass;
      for (uint32_t b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
      __syncthreads();
      for (uint32_t base = first; base < n; base += kSelectSweep) {
        uint32_t j[kSelectKeys], key[kSelectKeys];
#pragma unroll
        for (int i = 0; i < kSelectKeys; ++i) j[i] = base + i * kSelectThreads + tid;
        load_keys(j, pass > 0, key);
#pragma unroll
        for (int i = 0; i < kSelectKeys; ++i) {
          const bool in = j[i] < n;
          if (park && pass == 0 && in) parked[j[i]] = key[i];
          const uint32_t bin = in && (key[i] & mask) == prefix_key ? (key[i] >> shift) & 255u : kNoBin;
          const uint32_t peers = __match_any_sync(0xffffffffu, bin);
          if (bin != kNoBin && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
        }
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
              s_whole = count[i] == need - cum;
              break;
            }
            cum += count[i];
          }
        }
      }
      // The next pass clears hist only after this barrier (warp 0 has read it), and s_prefix
      // is written again only two barriers later.
      __syncthreads();
      prefix_key = s_prefix;
      need = s_need;
      mask |= 255u << shift;
      // Every key of the chosen bin is kept: the later digits would change nothing. The
      // threshold's unresolved digits are 0, so the bin's keys compare > or == to it, and
      // `need` covers all of them. (On distinct scores this often saves the last pass.)
      if (s_whole) break;
    }
    // Keys > threshold are kept; of the keys == threshold, the `need` lowest positions. A
    // thread takes kSelectKeys consecutive candidates of each sweep, so thread order is
    // position order and two CTA-wide prefix sums place every kept position.
    uint32_t out = first, eq_seen = 0;
    for (uint32_t base = first; base < n; base += kSelectSweep) {
      uint32_t j[kSelectKeys], key[kSelectKeys];
#pragma unroll
      for (int i = 0; i < kSelectKeys; ++i) j[i] = base + tid * kSelectKeys + i;
      load_keys(j, true, key);
      uint32_t gt = 0, eq = 0;  // bit i: candidate j[i]
#pragma unroll
      for (int i = 0; i < kSelectKeys; ++i) {
        gt |= uint32_t(j[i] < n && key[i] > prefix_key) << i;
        eq |= uint32_t(j[i] < n && key[i] == prefix_key) << i;
      }
      uint32_t eq_total, keep_total;
      uint32_t rank = eq_seen + block_exclusive_sum(__popc(eq), &eq_total, scan_a);
      uint32_t keep = gt;
#pragma unroll
      for (int i = 0; i < kSelectKeys; ++i)
        if (eq >> i & 1u) keep |= uint32_t(rank++ < need) << i;
      uint32_t at = out + block_exclusive_sum(__popc(keep), &keep_total, scan_b);
#pragma unroll
      for (int i = 0; i < kSelectKeys; ++i)
        if (keep >> i & 1u) kept[at++] = static_cast<int32_t>(j[i]);
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
  // blockIdx.x = (task from the last, KV head): every head's tasks of the protected suffix,
  // whose positions are known (StoreParams::chosen_end), come before any that waits.
  const uint32_t Hkv = p.st.block.kv_heads, seq = blockIdx.y;
  const uint32_t head = blockIdx.x % Hkv, task = gridDim.x / Hkv - 1 - blockIdx.x / Hkv;
  const BlockLayout &bl = p.st.block;
  const uint32_t G = bl.group, D = bl.head_dim, R = bl.tokens;
  const uint32_t sinks = p.sinks[seq], quantized = p.quantized[seq], n_keep = p.n_keep[seq];
  const uint32_t chosen_end = p.chosen_end[seq];
  const int32_t *kept = p.kept + uint64_t(head) * p.ws_tokens + p.seqs.ws_offset[seq];
  // Kept index i's position: the selection's only for [sinks, chosen_end).
  auto position = [&](uint32_t i) {
    return i < sinks ? static_cast<int32_t>(i)
           : i >= chosen_end ? static_cast<int32_t>(p.suffix_begin[seq] + (i - chosen_end))
                             : kept[i];
  };
  const int64_t tb = p.seqs.token_begin[seq];
  const T *k = static_cast<const T *>(p.k);
  const T *v = static_cast<const T *>(p.v);
  auto src_row = [&](const T *x, uint32_t i) { return x + ((tb + position(i)) * Hkv + head) * D; };

  // A task of chosen positions waits for the selection first; the others store, then wait,
  // so that the store's completion still implies the chain's (programmatic_launch.h).
  const bool has_group = task < quantized / G, has_rest = task == quantized / G && n_keep > quantized;
  const uint32_t lo = sinks + (has_group ? task * G : quantized);  // the task's first kept index
  const bool chosen = (has_group || has_rest) && lo < chosen_end;
  if (chosen) pdl_wait();
  if (has_group) {
    const uint32_t t0 = task * G;  // block index; kept index sinks + t0
    const int32_t block_id = p.st.block_table[uint64_t(p.slot[seq]) * p.st.max_blocks_per_seq + t0 / R];
    uint8_t *block = p.st.pool + uint64_t(block_id) * bl.bytes;
    store_group<T>(
        bl, block, head, t0 % R, [&](uint32_t t) { return src_row(k, sinks + t0 + t); },
        [&](uint32_t t) { return src_row(v, sinks + t0 + t); }, [&](uint32_t t) { return position(sinks + t0 + t); });
  } else if (has_rest) {
    const ResidualLayout &rl = p.st.res;
    uint8_t *slot = p.st.residual + uint64_t(p.slot[seq]) * rl.bytes;
    const uint64_t S = rl.sink_tokens;
    T *k_sink = reinterpret_cast<T *>(slot + rl.sink_k) + uint64_t(head) * S * D;
    T *v_sink = reinterpret_cast<T *>(slot + rl.sink_v) + uint64_t(head) * S * D;
    T *k_res = reinterpret_cast<T *>(slot + rl.k) + uint64_t(head) * R * D;
    T *v_res = reinterpret_cast<T *>(slot + rl.v) + uint64_t(head) * R * D;
    int32_t *pos = reinterpret_cast<int32_t *>(slot + rl.positions) + uint64_t(head) * R;
    const uint32_t first = sinks + quantized, tail = n_keep - first;
    // Rows of kept index from .. from + n − 1 into dst_k, dst_v, 16 bytes a thread (a row is
    // D · 2 bytes, a multiple of 32; rows 16-byte aligned as store_group's): this CTA copies up
    // to S + G − 1 rows of a head while the others quantize.
    const uint32_t U = D * sizeof(T) / 16;
    auto copy_rows = [&](T *dst_k, T *dst_v, uint32_t from, uint32_t n) {
#pragma unroll 4
      for (uint32_t i = threadIdx.x; i < n * U; i += kStoreThreads) {
        const uint32_t t = i / U, u = i % U;
        const uint4 kx = reinterpret_cast<const uint4 *>(src_row(k, from + t))[u];
        const uint4 vx = reinterpret_cast<const uint4 *>(src_row(v, from + t))[u];
        reinterpret_cast<uint4 *>(dst_k + uint64_t(t) * D)[u] = kx;
        reinterpret_cast<uint4 *>(dst_v + uint64_t(t) * D)[u] = vx;
      }
    };
    copy_rows(k_sink, v_sink, 0, sinks);
    copy_rows(k_res, v_res, first, tail);
    for (uint32_t t = threadIdx.x; t < tail; t += kStoreThreads) pos[t] = position(first + t);
  }
  if (!chosen) pdl_wait();
}

__global__ void set_block_table_kernel(const __grid_constant__ TableParams p) {
  for (uint32_t i = threadIdx.x; i < p.count; i += blockDim.x)
    p.block_table[uint64_t(p.slot) * p.max_blocks_per_seq + p.first + i] = p.ids[i];
}

}  // namespace

#ifndef MINIKV_WARP_EMULATION  // a CPU emulation (tests/emulation) runs the kernels themselves
void launch_select(const SelectParams &p, uint32_t num_kv_heads, cudaStream_t stream, bool programmatic) {
  launch_kernel(select_kernel, dim3(p.seqs.n, num_kv_heads), kSelectThreads, 0, stream, programmatic,
                "select_kernel", p);
}

void launch_store_kept(minikv_dtype dtype, const StoreParams &p, uint32_t max_tasks,
                       cudaStream_t stream, bool programmatic) {
  if (max_tasks == 0) return;
  dispatch_dtype(dtype, "minikv_prefill", [&](auto tag) {
    using T = decltype(tag);
    launch_kernel(store_kept_kernel<T>, dim3(max_tasks * p.st.block.kv_heads, p.seqs.n), kStoreThreads, 0, stream,
                  programmatic, "store_kept_kernel", p);
  });
}

void launch_set_block_table(const TableParams &p, cudaStream_t stream) {
  if (p.count == 0) return;
  set_block_table_kernel<<<1, 256, 0, stream>>>(p);
  check_launch_error("set_block_table_kernel");
}
#endif

}  // namespace kernels
}  // namespace minikv

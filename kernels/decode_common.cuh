// What every decode kernel (decode_fast.cu, decode_generic.cuh, decode_mma.cu) shares about
// the token minikv_append_decode appends in the decode launch itself.
//
// The appended token: the contract of a decode kernel launched with p.new_k != nullptr.
//   - p.residual[b] already counts the token. Where appended_row(p, b, kvh).row is a row
//     index (not kNoAppendedRow), that residual row of sequence b is NOT in its slot yet:
//     every CTA that reads it takes its K/V from appended_row(...).k / .v, the caller's
//     buffers (same bytes as the slot will hold). Every other residual row comes from the
//     slot as in a plain decode.
//   - Exactly one CTA per (sequence, KV head) calls store_appended_row with all of its
//     threads (any count): it copies the row into the slot and sets its position, which
//     makes the slot what minikv_append would have left. Readers never read that row from
//     the slot during the launch, so the writer needs no ordering with them; later
//     launches on the stream see it.
//   - Sequences with p.new_position[b] < 0 (a flush stored their token before the launch)
//     and plain decodes (p.new_k == nullptr) read every row from the slot.
// Results are then bit for bit those of minikv_append followed by minikv_decode.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "decode_tiles.cuh"
#include "params.h"

namespace minikv {
namespace kernels {

constexpr uint32_t kNoAppendedRow = 0xffffffffu;

// The appended token of (sequence seq, KV head kvh) as the decode reads it: residual row
// `row` (kNoAppendedRow: none this launch), whose K and V rows (head_dim elements each) are
// at k and v in the caller's buffers.
struct AppendedRow {
  const uint8_t *k, *v;
  uint32_t row;
};

__device__ __forceinline__ AppendedRow appended_row(const DecodeParams &p, uint32_t seq,
                                                    uint32_t kvh) {
  AppendedRow a{nullptr, nullptr, kNoAppendedRow};
  if (p.new_k == nullptr || p.new_position[seq] < 0) return a;
  const ResidualLayout &rl = p.st.res;
  const uint64_t at = (uint64_t(seq) * rl.kv_heads + kvh) * rl.head_dim * rl.elem_bytes;
  a.k = static_cast<const uint8_t *>(p.new_k) + at;
  a.v = static_cast<const uint8_t *>(p.new_v) + at;
  a.row = p.residual[seq] - 1;
  return a;
}

// The one writer per (sequence, KV head): copies the appended K/V rows into the slot's
// residual row and records the token's position, with threads tid = 0 .. nthreads-1 of the
// calling CTA (16-byte chunks). A no-op where the launch appends nothing for `seq`.
__device__ __forceinline__ void store_appended_row(const DecodeParams &p, uint32_t seq,
                                                   uint32_t kvh, uint32_t tid,
                                                   uint32_t nthreads) {
  const AppendedRow a = appended_row(p, seq, kvh);
  if (a.row == kNoAppendedRow) return;
  const ResidualLayout &rl = p.st.res;
  const uint64_t row_bytes = uint64_t(rl.head_dim) * rl.elem_bytes;  // a multiple of 16
  uint8_t *slot = p.st.residual + uint64_t(p.slot[seq]) * rl.bytes;
  const uint64_t at = kvh * rl.kv_head_stride() + a.row * row_bytes;
  uint8_t *k = slot + rl.k + at, *v = slot + rl.v + at;
  for (uint32_t c = tid; c < row_bytes / 16; c += nthreads) {
    reinterpret_cast<uint4 *>(k)[c] = reinterpret_cast<const uint4 *>(a.k)[c];
    reinterpret_cast<uint4 *>(v)[c] = reinterpret_cast<const uint4 *>(a.v)[c];
  }
  if (tid == 0)
    reinterpret_cast<int32_t *>(slot + rl.positions)[uint64_t(kvh) * rl.tokens + a.row] =
        p.new_position[seq];
}

// What a decode CTA of a tensor-core or generic launch covers: grid (splits, KV heads ×
// head chunks, sequences), p.heads_per_cta query heads per chunk; query heads h0 .. h0 + nh
// (nh < heads_per_cta in a group's last chunk).
struct DecodeCta {
  uint32_t split, seq, kvh, chunk, h0, nh;
  __device__ explicit DecodeCta(const DecodeParams &p) : split(blockIdx.x), seq(blockIdx.z) {
    const uint32_t n_rep = p.num_heads / p.num_kv_heads, per = p.heads_per_cta;
    const uint32_t chunks = (n_rep + per - 1) / per;
    kvh = blockIdx.y / chunks;
    chunk = blockIdx.y % chunks;
    h0 = kvh * n_rep + chunk * per;
    nh = min(per, n_rep - chunk * per);
  }
};

// The tiles [begin, end) of `total` that split `split` of `splits` walks (empty past the end).
struct SplitTiles {
  uint32_t begin, end;
  __device__ SplitTiles(uint32_t total, uint32_t splits, uint32_t split) {
    const uint32_t per_split = (total + splits - 1) / splits;
    begin = min(total, split * per_split);
    end = min(total, begin + per_split);
  }
};

// Sequence seq's block table row and residual slot.
struct SequenceSlot {
  const int32_t *table;
  const uint8_t *residual;
  __device__ SequenceSlot(const DecodeParams &p, uint32_t seq) {
    const uint32_t slot = p.slot[seq];
    table = p.st.block_table + uint64_t(slot) * p.st.max_blocks_per_seq;
    residual = p.st.residual + uint64_t(slot) * p.st.res.bytes;
  }
};

// Byte offsets inside a block of the CTA's KV head's regions (a block is far below 4 GB).
struct HeadRegions {
  uint32_t k_codes, v_codes, k_scale, k_min, v_scale, v_min;
  __device__ HeadRegions(const BlockLayout &bl, uint32_t kvh)
      : k_codes(uint32_t(bl.k_codes + kvh * bl.k_codes_head())),
        v_codes(uint32_t(bl.v_codes + kvh * bl.v_codes_head())),
        k_scale(uint32_t(bl.k_scale + kvh * bl.k_scale_head())),
        k_min(uint32_t(bl.k_min + kvh * bl.k_scale_head())),
        v_scale(uint32_t(bl.v_scale + kvh * bl.v_scale_head())),
        v_min(uint32_t(bl.v_min + kvh * bl.v_scale_head())) {}
};

// Channel ch of query head `head` (sequence-major: seq · num_heads + h) once a CTA has its
// (max m, sum l, unnormalized output o): the normalized output where the launch has one
// split, else the split's partial for decode_merge.cu (m and l written with channel 0).
template <typename T, int D>
__device__ __forceinline__ void store_decode_result(const DecodeParams &p, uint64_t head,
                                                    uint32_t split, uint32_t ch, float m, float o,
                                                    float l) {
  if (p.splits == 1) {
    static_cast<T *>(p.out)[head * D + ch] = output_value<T>(o / l);
  } else {
    const uint64_t part = head * p.splits + split;
    p.part_o[part * D + ch] = o;
    if (ch == 0) {
      p.part_ml[part * 2] = m;
      p.part_ml[part * 2 + 1] = l;
    }
  }
}

// What store_decode_result stores for every channel of heads head0 .. head0 + nh − 1, from
// shared memory (their outputs o_s[h · D + c], fp32, 16-byte aligned; their max and sum
// ml_s[2h], ml_s[2h + 1]), by threads tid = 0 .. nthreads − 1 with 16-byte stores. Rolled
// loops: the kernels that call it are large already.
template <typename T, int D>
__device__ __forceinline__ void store_decode_rows(const DecodeParams &p, uint64_t head0, uint32_t nh,
                                                  uint32_t split, const float *o_s, const float *ml_s,
                                                  uint32_t tid, uint32_t nthreads) {
  const float4 *o4 = reinterpret_cast<const float4 *>(o_s);
  if (p.splits == 1) {
#pragma unroll 1
    for (uint32_t x = tid; x < nh * (D / 8); x += nthreads) {  // 8 outputs of the dtype a store
      const uint32_t h = x / (D / 8), c8 = x % (D / 8);
      const float l = ml_s[2 * h + 1];
      const float4 a = o4[2 * x], b = o4[2 * x + 1];
      const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      alignas(16) T v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = output_value<T>(f[e] / l);
      reinterpret_cast<uint4 *>(static_cast<T *>(p.out) + (head0 + h) * D)[c8] = *reinterpret_cast<const uint4 *>(v);
    }
  } else {
#pragma unroll 1
    for (uint32_t x = tid; x < nh * (D / 4); x += nthreads) {
      const uint32_t h = x / (D / 4), c4 = x % (D / 4);
      reinterpret_cast<float4 *>(p.part_o + ((head0 + h) * p.splits + split) * D)[c4] = o4[x];
    }
    if (tid < nh) {
      const uint64_t part = (head0 + tid) * p.splits + split;
      p.part_ml[part * 2] = ml_s[2 * tid];
      p.part_ml[part * 2 + 1] = ml_s[2 * tid + 1];
    }
  }
}

// atomicAdd at GPU scope with acquire-release semantics: the writes this thread has seen (its
// warp's too, through a __syncwarp before it) are ordered before it, its later reads after it.
__device__ __forceinline__ uint32_t atomic_add_acq_rel_gpu(uint32_t *address, uint32_t value) {
#ifdef MINIKV_WARP_EMULATION
  return atomicAdd(address, value);
#else
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(address), "r"(value) : "memory");
  return old;
#endif
}

// The split merge inside a decode kernel (decode_merge.cu's combine, run by one warp): the
// CTA whose arrival at `counter` completes the launch's splits merges them, and resets the
// counter to zero for the next launch or graph replay. The warp barrier hands every lane's
// partials to lane 0, whose release orders them before the arrival; its acquire orders the
// other CTAs' partials before the merging warp's reads (from L2: __ldcg). One atomic instead
// of a fence on each side of it.
__device__ __forceinline__ bool arrive_last_split(uint32_t *counter, uint32_t splits, uint32_t lane) {
  __syncwarp();
  uint32_t arrived = 0;
  if (lane == 0) arrived = atomic_add_acq_rel_gpu(counter, 1u);
  arrived = __shfl_sync(0xffffffffu, arrived, 0);
  if (arrived + 1 != splits) return false;
  __syncwarp();  // lane 0's acquire before every lane's reads
  if (lane == 0) *counter = 0;
  return true;
}

// Output of query head `head` from its splits' partials: Σ_s w_s[s] · o_s / l, the sum over
// the splits in order (the result does not depend on which CTA merges); lane = D / 32
// channels. w_s (shared) may be rewritten once this returns.
template <typename T, int D>
__device__ __forceinline__ void store_merged_head(const DecodeParams &p, uint64_t head, const float *w_s, float l,
                                                  uint32_t lane) {
  constexpr int kCh = D / 32;
  const uint32_t S = p.splits;
  const uint64_t part0 = head * S;
  float o[kCh];
#pragma unroll
  for (int c = 0; c < kCh; ++c) o[c] = 0.0f;
#pragma unroll 8
  for (uint32_t s = 0; s < S; ++s) {
    const float ws = w_s[s];
    const float *po = p.part_o + (part0 + s) * D + lane * kCh;
    if constexpr (kCh % 4 == 0) {  // head_dim 128 and 256
#pragma unroll
      for (int c = 0; c < kCh; c += 4) {
        const float4 v = __ldcg(reinterpret_cast<const float4 *>(po + c));
        o[c] = fmaf(ws, v.x, o[c]);
        o[c + 1] = fmaf(ws, v.y, o[c + 1]);
        o[c + 2] = fmaf(ws, v.z, o[c + 2]);
        o[c + 3] = fmaf(ws, v.w, o[c + 3]);
      }
    } else {
      static_assert(kCh == 2, "head_dim 64, 128 or 256");
      const float2 v = __ldcg(reinterpret_cast<const float2 *>(po));
      o[0] = fmaf(ws, v.x, o[0]);
      o[1] = fmaf(ws, v.y, o[1]);
    }
  }
  __syncwarp();  // every lane is done with w_s
  T *out = static_cast<T *>(p.out) + head * D + lane * kCh;
#pragma unroll
  for (int c = 0; c < kCh; ++c) out[c] = output_value<T>(o[c] / l);
}

// Where a 16-bit tile (sinks or residual, decode_tiles.cuh) of KV head kvh reads its rows:
// the slot's K and V rows from the tile's first, and the tile row (kNoAppendedRow: none) that
// comes from the caller's k/v instead, the appended token.
struct RowTileSource {
  const uint8_t *k, *v;          // row 0 of the tile
  uint32_t sub;                  // tile row of the appended token, or kNoAppendedRow
  const uint8_t *sub_k, *sub_v;  // its K and V rows
};

__device__ __forceinline__ RowTileSource row_tile_source(const DecodeParams &p, const TileRef &tr,
                                                         const uint8_t *res_slot, uint32_t kvh) {
  const ResidualLayout &rl = p.st.res;
  const uint64_t first = uint64_t(tr.first) * rl.head_dim * rl.elem_bytes;
  RowTileSource s{};
  if (tr.segment == kSegSinks) {
    s.k = res_slot + rl.sink_k + kvh * rl.sink_head_stride() + first;
    s.v = res_slot + rl.sink_v + kvh * rl.sink_head_stride() + first;
    s.sub = kNoAppendedRow;
  } else {
    s.k = res_slot + rl.k + kvh * rl.kv_head_stride() + first;
    s.v = res_slot + rl.v + kvh * rl.kv_head_stride() + first;
    const AppendedRow a = appended_row(p, blockIdx.z, kvh);
    s.sub = a.row - tr.first;  // none (kNoAppendedRow) or an earlier row: wraps past the tile
    s.sub_k = a.k;
    s.sub_v = a.v;
  }
  return s;
}

}  // namespace kernels
}  // namespace minikv

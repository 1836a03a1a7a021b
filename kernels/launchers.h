// Host launchers of the CUDA kernel families: plain C++ declarations (no CUDA templates
// leak out of the .cu files). Each dispatches on dtype and head_dim, launches on `stream`,
// checks the launch, and throws Error(MINIKV_ERR_DEVICE) on a CUDA error or
// Error(MINIKV_ERR_UNSUPPORTED) for a size that is not compiled.
#pragma once

#include <cuda_runtime.h>

#include "../include/minikv.h"
#include "params.h"

namespace minikv {
namespace kernels {

// Raises the dynamic shared-memory limits of the prefill kernels on the current device.
void configure_prefill_kernels(minikv_dtype dtype, uint32_t head_dim);

// Prefill's kernels run in stream order: the forward, a score pass, the selection, the store.
// With `programmatic` (sm_90 and a 12.3+ driver: CudaBackend::programmatic_prefill_) each
// launcher after the forward starts its kernel as a programmatic dependent of the one before
// (programmatic_launch.h): its launch and what it reads before pdl_wait (the caller's q and k)
// overlap the previous kernel's tail. Every prefill kernel before the store calls
// pdl_launch_dependents first.
//
// The score passes (launch_prefill_scores, launch_prefill_scores_wgmma) split a short
// launch's key tiles over up to kScoreMaxParts CTAs each when that evens out the CTAs' work
// (prefill_common.cuh): p.part_sums and p.part_counters (zeroed once) are the scratch of
// prefill_score_part_ctas(num_sms) (key tile, KV head) pairs; a launch of more pairs, or
// with p.part_sums null, is not split. Two waves of two CTAs an SM: longer launches even
// out by themselves.
constexpr uint32_t kScoreMaxParts = 4;
constexpr uint32_t prefill_score_part_ctas(uint32_t num_sms) { return 4 * num_sms; }

// prefill_attention.cu: grid over the query tiles (kPrefillQueryTile rows) / key tiles
// (kPrefillKeyTile columns) of `p.seqs`; the forwards and the score passes order it by
// prefill_common.cuh head_chunk for a device of `num_sms` SMs.
void launch_prefill_attention(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                              uint32_t num_sms, cudaStream_t stream);
void launch_prefill_scores(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &p,
                           uint32_t num_sms, cudaStream_t stream, bool programmatic);
// WINDOW mode's score pass (prefill_attention.cu prefill_window_scores_kernel, sm_80+): the
// same sums as launch_prefill_scores where every row of p is a window row after every
// scored key (row_begin >= col_end), streaming each KV head's keys once past its window rows
// held in shared memory. For configurations where prefill_window_scores_fit.
bool prefill_window_scores_fit(uint32_t head_dim, uint32_t n_rep, uint32_t window_size);
void launch_prefill_window_scores(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &p,
                                  uint32_t num_sms, cudaStream_t stream, bool programmatic);
// prefill_wgmma.cu: the same forward as launch_prefill_attention on Hopper warpgroup MMA.
// Usable for head_dim 64, 128 and 256 (WgmmaHeadDims) when the library carries an sm_90a
// image and the current device loads it (and MINIKV_PREFILL_KERNEL is not "mma"); raises the
// kernel's shared-memory limit when it is. Otherwise the mma.sync forward runs.
bool prefill_wgmma_usable(minikv_dtype dtype, uint32_t head_dim);
void launch_prefill_wgmma(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                          uint32_t num_sms, cudaStream_t stream);
// prefill_scores_wgmma.cu: the same score pass as launch_prefill_scores on Hopper warpgroup
// MMA, under the same conditions as the wgmma forward (head_dim 64/128/256, an sm_90a image
// the device loads, MINIKV_PREFILL_KERNEL not "mma"); raises its shared-memory limit when
// usable.
bool prefill_scores_wgmma_usable(minikv_dtype dtype, uint32_t head_dim);
void launch_prefill_scores_wgmma(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &p,
                                 uint32_t num_sms, cudaStream_t stream, bool programmatic);

// select_quantize.cu
void launch_select(const SelectParams &p, uint32_t num_kv_heads, cudaStream_t stream, bool programmatic);
void launch_store_kept(minikv_dtype dtype, const StoreParams &p, uint32_t max_tasks,
                       cudaStream_t stream, bool programmatic);
void launch_set_block_table(const TableParams &p, cudaStream_t stream);

// append_flush.cu
void launch_append(minikv_dtype dtype, const AppendParams &p, cudaStream_t stream);

// Decode: three strategies and one combine. The backend picks one at create (its plan) and
// sizes splits and workspaces from it.
// decode_fast.cu: 2-bit keys and values, G = 16, head_dim 64/128, 16-bit dtype, GQA group
// 1/2/4/8, no sinks: one-warp CTAs over tiles of kDecodeFastTile quantized tokens; splits
// divide each sequence's tiles; partials merged in the kernel or by launch_decode_merge.
bool decode_fast_path(const BlockLayout &bl, const ResidualLayout &rl, uint32_t n_rep);
// Resident fast-path CTAs per SM (occupancy of the kernel instance), at least 1.
uint32_t decode_fast_ctas_per_sm(minikv_dtype dtype, uint32_t head_dim, uint32_t n_rep);
void launch_decode_fast(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                        cudaStream_t stream);
// decode_generic.cu: every other storage configuration of a compiled dtype and head_dim
// (kGenericThreads-thread CTAs over the tiles of decode_generic_plan.h, p.heads_per_cta
// query heads each).
// Query heads per CTA for a GQA group of n_rep (the group in the fewest chunks of at most
// kGenericMaxHeads).
uint32_t decode_generic_heads_per_cta(uint32_t n_rep);
// Raises the kernel's shared-memory limit on the current device; returns resident CTAs per SM.
uint32_t configure_decode_generic(minikv_dtype dtype, const BlockLayout &bl, uint32_t n_rep);
void launch_decode_generic(minikv_dtype dtype, const DecodeParams &p, cudaStream_t stream);
// The kernel for dtype T (__half or __nv_bfloat16), head_dim D and NR query heads per CTA:
// decode_generic_hd<D>.cu instantiates those of one compiled head_dim (decode_generic.cuh).
using DecodeGenericKernel = void (*)(DecodeParams);
template <typename T, int D, int NR> DecodeGenericKernel decode_generic_kernel_for();
// decode_mma.cu: every storage configuration on tensor cores (made for GQA groups), four-warp
// CTAs of at most kMmaMaxHeads query heads over the tiles of decode_mma_plan.h.
bool decode_mma_path(const BlockLayout &bl, uint32_t n_rep);
uint32_t decode_mma_heads_per_cta(uint32_t n_rep);
// Raises the kernel's shared-memory limit on the current device; returns resident CTAs per SM.
uint32_t configure_decode_mma(minikv_dtype dtype, const BlockLayout &bl);
// plan: make_mma_launch_plan(p.st.block), made once at create (decode_mma_plan.h).
struct MmaLaunchPlan;
void launch_decode_mma(minikv_dtype dtype, const DecodeParams &p, const MmaLaunchPlan &plan,
                       cudaStream_t stream);
// decode_k4v2.cu: the default storage (4-bit keys, 2-bit values, G = 32, head_dim 64/128) on
// sm_90, four-warp CTAs of 4 or 8 query-head slots over the tiles of decode_k4v2_plan.h.
bool decode_k4v2_path(const BlockLayout &bl, uint32_t n_rep);
// Raises the kernel's shared-memory limit; returns resident CTAs per SM, or 0 where this
// device cannot run it (no sm_90 image loaded).
uint32_t configure_decode_k4v2(minikv_dtype dtype, const BlockLayout &bl, uint32_t heads_per_cta);
// plan: make_k4v2_launch_plan(p.st.block, driver version), made once at create.
struct K4V2LaunchPlan;
void launch_decode_k4v2(minikv_dtype dtype, const DecodeParams &p, const K4V2LaunchPlan &plan,
                        cudaStream_t stream);
// decode_k4v2_warp.cu: the same storage and the other storage of k4v2_warp_storage
// (decode_k4v2_plan.h), head_dim 64/128, on sm_90; any GQA group, one-warp CTAs of 1, 2 or 4
// query heads over the same tiles and plan.
bool decode_k4v2_warp_path(const BlockLayout &bl, uint32_t n_rep);
uint32_t decode_k4v2_warp_heads_per_cta(uint32_t n_rep);
// Raises the kernel's shared-memory limit; returns resident CTAs per SM, or 0 where this
// device cannot run it (no sm_90 image loaded).
uint32_t configure_decode_k4v2_warp(minikv_dtype dtype, const BlockLayout &bl, uint32_t n_rep);
// early: launched as a programmatic dependent of the kernel before it on `stream`: each CTA's
// first quantized tile is read (block table, bulk copies) before pdl_wait, everything else
// after it. Only where no launch that may still run has written the cache's blocks or block
// table (cuda_backend.cpp tracks that), and where the driver (12.3+) captures the edge.
void launch_decode_k4v2_warp(minikv_dtype dtype, const DecodeParams &p, const K4V2LaunchPlan &plan,
                             cudaStream_t stream, bool early = false);
// decode_merge.cu: out = the combine of p.splits partials per (sequence, query head).
// programmatic: launched as a programmatic dependent of the decode kernel just launched on
// `stream`, which must call pdl_launch_dependents (common.cuh) after its last tile and be an
// sm_90 kernel: the merge's CTAs start behind the decode's last ones instead of after the
// launch gap, and wait (pdl_wait) for its partials. Only where the driver (12.3+) can also
// capture the edge into a graph (K4V2LaunchPlan::programmatic_merge).
void launch_decode_merge(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                         cudaStream_t stream, bool programmatic = false);

// Tile sizes the host needs for grids and workspaces.
constexpr uint32_t kPrefillQueryTile = 128;  // query rows per prefill attention CTA
constexpr uint32_t kPrefillKeyTile = 128;    // key columns per prefill score CTA
constexpr uint32_t kDecodeFastTile = 128;  // quantized tokens per fast-path tile (8 key groups)
constexpr uint32_t kDecodeMaxSplits = 128; // splits per decode launch (merge kernel bound)
constexpr uint32_t kDecodeMaxLanes = 4;    // decode launches of one call that run side by side

}  // namespace kernels
}  // namespace minikv

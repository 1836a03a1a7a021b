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

// head_dim values the kernels are compiled for.
bool head_dim_supported(uint32_t head_dim);

// Raises the dynamic shared-memory limits of the prefill kernels on the current device.
void configure_prefill_kernels(minikv_dtype dtype, uint32_t head_dim);

// prefill_attention.cu: grid over the query tiles (kPrefillQueryTile rows) / key tiles
// (kPrefillKeyTile columns) of `p.seqs`.
void launch_prefill_attention(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                              cudaStream_t stream);
void launch_prefill_scores(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &p,
                           cudaStream_t stream);
// prefill_wgmma.cu: the same forward as launch_prefill_attention on Hopper warpgroup MMA.
// Usable when the library carries an sm_90a image and the current device loads it (and
// MINIKV_PREFILL_KERNEL is not "mma"); raises the kernel's shared-memory limit when it is.
bool prefill_wgmma_usable(minikv_dtype dtype, uint32_t head_dim);
void launch_prefill_wgmma(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                          cudaStream_t stream);

// select_quantize.cu
void launch_select(const SelectParams &p, uint32_t num_kv_heads, cudaStream_t stream);
void launch_store_kept(minikv_dtype dtype, const StoreParams &p, uint32_t max_tasks,
                       cudaStream_t stream);
void launch_set_block_table(const TableParams &p, cudaStream_t stream);

// append_flush.cu
void launch_append(minikv_dtype dtype, const AppendParams &p, cudaStream_t stream);

// decode_attention.cu: split-K attention + merge into p.out (the merge is skipped on the
// fast path when p.splits == 1).
void launch_decode(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                   cudaStream_t stream);
// The fast decode path (2-bit keys and values, G = 16, head_dim 64/128, 16-bit dtype, GQA
// group 1/2/4/8) runs one-warp CTAs over tiles of kDecodeFastTile quantized tokens; splits
// there divide each sequence's tiles.
bool decode_fast_path(const BlockLayout &bl, uint32_t n_rep);
// Resident fast-path CTAs per SM (occupancy of the kernel instance), at least 1.
uint32_t decode_fast_ctas_per_sm(minikv_dtype dtype, uint32_t head_dim, uint32_t n_rep);

// Tile sizes the host needs for grids and workspaces.
constexpr uint32_t kPrefillQueryTile = 128;  // query rows per prefill attention CTA
constexpr uint32_t kPrefillKeyTile = 128;    // key columns per prefill score CTA
constexpr uint32_t kDecodeTile = 128;   // cached tokens per decode iteration (= threads)
constexpr uint32_t kDecodeFastTile = 128;  // quantized tokens per fast-path tile (8 key groups)
constexpr uint32_t kDecodeMaxSplits = 128; // splits per decode launch (merge kernel bound)

}  // namespace kernels
}  // namespace minikv

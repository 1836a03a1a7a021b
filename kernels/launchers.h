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

// prefill_attention.cu: grid over the query tiles / key tiles of `p.seqs`.
void launch_prefill_attention(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                              cudaStream_t stream);
void launch_prefill_scores(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &p,
                           cudaStream_t stream);

// select_quantize.cu
void launch_select(const SelectParams &p, uint32_t num_kv_heads, cudaStream_t stream);
void launch_store_kept(minikv_dtype dtype, const StoreParams &p, uint32_t max_tasks,
                       cudaStream_t stream);
void launch_set_block_table(const TableParams &p, cudaStream_t stream);

// append_flush.cu
void launch_append(minikv_dtype dtype, const AppendParams &p, cudaStream_t stream);

// decode_attention.cu: split-K attention + merge into p.out.
void launch_decode(minikv_dtype dtype, uint32_t head_dim, const DecodeParams &p,
                   cudaStream_t stream);

// Tile sizes the host needs for grids and workspaces.
constexpr uint32_t kPrefillTile = 64;   // query and key rows per prefill tile
constexpr uint32_t kDecodeTile = 128;   // cached tokens per decode iteration (= threads)

}  // namespace kernels
}  // namespace minikv

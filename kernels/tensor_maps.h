// Host side of the sm_90a prefill kernels' TMA loads (bulk_copy.cuh's tma_load_3d): tensor
// maps over the caller's Q/K/V, encoded per launch (they hold the pointers). Defined in
// prefill_wgmma.cu.
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cstdint>

#include "minikv.h"
#include "params.h"

namespace minikv {
namespace kernels {

// False when the driver lacks cuTensorMapEncodeTiled (the sm_90a prefill kernels then do not
// run).
bool tensor_maps_available();
// [rows][heads][D] 16-bit elements at base, read in boxes of {64 elements, 1 head, box_rows
// rows} with the 128-byte swizzle; rows past `rows` read as zeros.
CUtensorMap rows_tensor_map(minikv_dtype dtype, const void *base, uint32_t heads, uint32_t D, uint64_t rows,
                            uint32_t box_rows);
// Query rows a launch's map must span: up to the end of its last packed sequence (at least 1).
inline uint64_t launch_query_rows(const PrefillSeqs &seqs) {
  uint64_t rows = 1;
  for (uint32_t i = 0; i < seqs.n; ++i) rows = std::max<uint64_t>(rows, uint64_t(seqs.token_begin[i]) + seqs.len[i]);
  return rows;
}

}  // namespace kernels
}  // namespace minikv

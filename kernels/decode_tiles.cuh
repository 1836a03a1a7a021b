// The tiles a decode split walks, in cache order: the sink rows, the quantized blocks, the
// residual rows (src/layout.h). Tile sizes come from the kernel's plan (qtile for quantized
// storage, ptile for 16-bit rows); shared by the generic and the tensor-core decode kernels.
#pragma once

#include <cstdint>

namespace minikv {
namespace kernels {

enum : uint32_t { kSegSinks = 0, kSegQuantized = 1, kSegResidual = 2 };

struct TileRef {
  uint32_t segment;
  uint32_t first;  // first token of the tile inside its segment
  uint32_t count;  // tokens of the tile (the last tile of a segment may be short)
};

// The tiles of one sequence's cache, in cache order.
template <typename Plan> struct SequenceTiles {
  uint32_t sinks, quantized, residual;
  uint32_t sink_tiles, quant_tiles, total;

  __device__ SequenceTiles(uint32_t s, uint32_t q, uint32_t r, const Plan &g)
      : sinks(s), quantized(q), residual(r) {
    sink_tiles = (s + g.ptile - 1) / g.ptile;
    quant_tiles = (q + g.qtile - 1) / g.qtile;
    total = sink_tiles + quant_tiles + (r + g.ptile - 1) / g.ptile;
  }
  __device__ TileRef tile(uint32_t i, const Plan &g) const {
    if (i < sink_tiles) return {kSegSinks, i * g.ptile, min(g.ptile, sinks - i * g.ptile)};
    i -= sink_tiles;
    if (i < quant_tiles) return {kSegQuantized, i * g.qtile, min(g.qtile, quantized - i * g.qtile)};
    i -= quant_tiles;
    return {kSegResidual, i * g.ptile, min(g.ptile, residual - i * g.ptile)};
  }
};

}  // namespace kernels
}  // namespace minikv

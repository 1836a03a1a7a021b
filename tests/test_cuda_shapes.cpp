// minikv-test: white-box (links minikv_core: a CUDA build's MINIKV_CUDA_HEAD_DIMS list)
// The CUDA backend's create-time shape check (kernels/cuda_shapes.h), without a GPU: which
// dtype and head_dim pairs the build compiles, and the MINIKV_ERR_UNSUPPORTED message for
// the rest (it names the value and lists what is supported). minikv_cache_create runs the
// same check before it looks for a device; the GPU suite checks it through the C API.
#include <doctest/doctest.h>

#include <string>

#include "../kernels/cuda_shapes.h"
#include "minikv.h"

namespace {

using minikv::kernels::compiled_head_dims_text;
using minikv::kernels::cuda_unsupported;
using minikv::kernels::head_dim_compiled;

minikv_config config(minikv_dtype dtype, uint32_t head_dim) {
  minikv_config c;
  minikv_config_default(&c);
  c.dtype = dtype;
  c.num_layers = 1;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = head_dim;
  return c;
}

bool contains(const std::string &text, const std::string &part) {
  return text.find(part) != std::string::npos;
}

// The values a build without MINIKV_CUDA_HEAD_DIMS compiles.
constexpr uint32_t kDefaultHeadDims[] = {64, 80, 96, 128, 256};

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("cuda shapes: the compiled head_dim values in F16 and BF16") {
  uint32_t compiled = 0;
  for (uint32_t d : kDefaultHeadDims) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
      CAPTURE(d);
      const std::string why = cuda_unsupported(config(dt, d));
      if (head_dim_compiled(d)) {
        CHECK(why.empty());
      } else {  // left out by MINIKV_CUDA_HEAD_DIMS
        CHECK(contains(why, "head_dim " + std::to_string(d) + " is not compiled"));
      }
    }
    compiled += head_dim_compiled(d) ? 1 : 0;
  }
  CHECK(compiled >= 1);
#if !defined(MINIKV_NO_HEAD_DIM_64) && !defined(MINIKV_NO_HEAD_DIM_80) && \
    !defined(MINIKV_NO_HEAD_DIM_96) && !defined(MINIKV_NO_HEAD_DIM_128) && \
    !defined(MINIKV_NO_HEAD_DIM_256)
  CHECK(compiled == 5);
  CHECK(compiled_head_dims_text() == "64, 80, 96, 128, 256");
#endif
}

TEST_CASE("cuda shapes: other head_dim values are UNSUPPORTED with the supported list") {
  // Multiples of 16 up to 256 (valid configurations, run by the CPU backend) that no CUDA
  // kernel is written for.
  for (uint32_t d : {16u, 32u, 48u, 112u, 144u, 160u, 192u, 208u, 224u, 240u}) {
    CAPTURE(d);
    CHECK_FALSE(head_dim_compiled(d));
    const std::string why = cuda_unsupported(config(MINIKV_DTYPE_F16, d));
    CHECK(contains(why, "head_dim " + std::to_string(d) + " is not compiled"));
    CHECK(contains(why, "(supported: " + compiled_head_dims_text() + ";"));
    CHECK(contains(why, "CPU backend"));
  }
}

TEST_CASE("cuda shapes: F32 is UNSUPPORTED with the supported dtypes") {
  const std::string why = cuda_unsupported(config(MINIKV_DTYPE_F32, 128));
  CHECK(contains(why, "F32"));
  CHECK(contains(why, "F16, BF16"));
}

}  // TEST_SUITE

// Built when libminikv is configured without CUDA: the CUDA backend is reported as absent.
#include "backend.h"
#include "error.h"

namespace minikv {

bool cuda_backend_available(int) { return false; }

std::unique_ptr<Backend> make_cuda_backend(const StorageSpec &) {
  fail(MINIKV_ERR_UNSUPPORTED,
       "minikv_cache_create: backend MINIKV_BACKEND_CUDA requested, but this libminikv was "
       "built without CUDA (configure with -DMINIKV_CUDA=ON)");
}

}  // namespace minikv

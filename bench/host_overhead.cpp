// Host time per call of the decode step's calls: how long minikv_append, minikv_decode,
// the two in a row, and minikv_append_decode take to return, per layer, on a small cache
// whose arithmetic is negligible (one KV head, head_dim 64, short contexts), so what is left
// is the library's host path: argument checks, bookkeeping, parameter building, launches.
//
//   CPU backend (MINIKV_NUM_THREADS=1): the whole call, compute included (tiny here).
//   CUDA backend: the time to queue the work (no synchronization inside a sample; each
//   sample is one batch of calls that fits CUDA's launch queue, then the stream is drained
//   outside the timed region), i.e. the host cost that a CUDA graph would remove.
//
//   minikv_host_overhead [--backend cpu|cuda] [--seqs N] [--context T] [--calls N]
//                        [--samples N] [--json PATH]
// Prints one line per call kind: median and min microseconds per layer-call over the samples.
// Each kind runs on a fresh cache with the same prompts; the kinds that append grow the
// context by calls x (samples + 1) / 4 tokens per layer over their run (decode alone does
// not), which matters on the CPU only.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "minikv.h"

#ifdef MINIKV_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

struct Options {
  minikv_backend backend = MINIKV_BACKEND_CPU;
  uint32_t seqs = 8, context = 512, calls = 100, samples = 21;
  const char *json = nullptr;
};

[[noreturn]] void usage(const char *why) {
  std::fprintf(stderr,
               "minikv_host_overhead: %s\nusage: minikv_host_overhead [--backend cpu|cuda] "
               "[--seqs N] [--context T] [--calls N] [--samples N] [--json PATH]\n",
               why);
  std::exit(2);
}

Options parse(int argc, char **argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") usage("host time per call of append / decode / append_decode");
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    const char *v = argv[++i];
    if (a == "--backend") {
      if (std::strcmp(v, "cpu") == 0) o.backend = MINIKV_BACKEND_CPU;
      else if (std::strcmp(v, "cuda") == 0) o.backend = MINIKV_BACKEND_CUDA;
      else usage("--backend is cpu or cuda");
    } else if (a == "--seqs") o.seqs = static_cast<uint32_t>(std::atoi(v));
    else if (a == "--context") o.context = static_cast<uint32_t>(std::atoi(v));
    else if (a == "--calls") o.calls = static_cast<uint32_t>(std::atoi(v));
    else if (a == "--samples") o.samples = static_cast<uint32_t>(std::atoi(v));
    else if (a == "--json") o.json = v;
    else usage(("unknown option " + a).c_str());
  }
  if (o.seqs == 0 || o.context == 0 || o.calls == 0 || o.samples == 0) usage("sizes must be >= 1");
  return o;
}

void require(minikv_status st, const char *what) {
  if (st == MINIKV_OK) return;
  std::fprintf(stderr, "minikv_host_overhead: %s: %s (%s)\n", what, minikv_status_string(st),
               minikv_last_error_message());
  std::exit(1);
}

// Tensor buffers in the backend's memory, filled with small finite values.
class Buffer {
 public:
  Buffer(minikv_backend backend, size_t elems) : backend_(backend), host_(elems) {
    for (size_t i = 0; i < elems; ++i) host_[i] = uint16_t(0x3000 + (i * 37) % 512);  // fp16 ~0.1-0.2
#ifdef MINIKV_BENCH_CUDA
    if (backend == MINIKV_BACKEND_CUDA) {
      if (cudaMalloc(&device_, elems * 2) != cudaSuccess ||
          cudaMemcpy(device_, host_.data(), elems * 2, cudaMemcpyHostToDevice) != cudaSuccess) {
        std::fprintf(stderr, "minikv_host_overhead: cudaMalloc/cudaMemcpy failed\n");
        std::exit(1);
      }
    }
#endif
  }
  ~Buffer() {
#ifdef MINIKV_BENCH_CUDA
    if (device_) cudaFree(device_);
#endif
  }
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;
  void *data() { return backend_ == MINIKV_BACKEND_CUDA ? device_ : host_.data(); }

 private:
  minikv_backend backend_;
  std::vector<uint16_t> host_;
  void *device_ = nullptr;
};

void drain(minikv_backend backend) {
#ifdef MINIKV_BENCH_CUDA
  if (backend == MINIKV_BACKEND_CUDA && cudaDeviceSynchronize() != cudaSuccess) {
    std::fprintf(stderr, "minikv_host_overhead: cudaDeviceSynchronize failed\n");
    std::exit(1);
  }
#else
  (void)backend;
#endif
}

struct Result {
  const char *name;
  double median_us, min_us;
};

}  // namespace

int main(int argc, char **argv) {
  const Options o = parse(argc, argv);
#ifndef MINIKV_BENCH_CUDA
  if (o.backend == MINIKV_BACKEND_CUDA) usage("built without CUDA (configure with MINIKV_CUDA=ON)");
#endif
  setenv("MINIKV_NUM_THREADS", "1", 0);  // CPU: no thread-pool wake-ups in the measurement
  constexpr uint32_t kLayers = 4, kHeads = 4, kKvHeads = 1, kDim = 64;
  // Appends to one cache (one kind of call): calls per sample, samples plus one warm-up.
  const uint64_t appends = uint64_t(o.calls) * (o.samples + 1);

  minikv_config cfg;
  minikv_config_default(&cfg);
  cfg.backend = o.backend;
  cfg.dtype = MINIKV_DTYPE_F16;
  cfg.num_layers = kLayers;
  cfg.num_heads = kHeads;
  cfg.num_kv_heads = kKvHeads;
  cfg.head_dim = kDim;
  cfg.max_sequences = o.seqs;
  cfg.max_seq_len = static_cast<uint32_t>(o.context + appends);

  std::vector<uint32_t> ids(o.seqs);
  for (uint32_t i = 0; i < o.seqs; ++i) ids[i] = i;
  Buffer q(o.backend, size_t(o.seqs) * kHeads * kDim), k(o.backend, size_t(o.seqs) * kKvHeads * kDim),
      v(o.backend, size_t(o.seqs) * kKvHeads * kDim), out(o.backend, size_t(o.seqs) * kHeads * kDim);

  // Each kind of call gets a fresh cache with the same prompts, so that no kind runs over
  // the tokens another appended (on the CPU the compute grows with the context).
  minikv_cache *cache = nullptr;
  auto fresh_cache = [&] {
    minikv_cache_destroy(cache);
    cache = nullptr;
    require(minikv_cache_create(&cfg, &cache), "minikv_cache_create");
    std::vector<int32_t> cu(o.seqs + 1, 0);
    for (uint32_t i = 0; i < o.seqs; ++i) cu[i + 1] = cu[i] + static_cast<int32_t>(o.context);
    const size_t T = size_t(o.seqs) * o.context;
    Buffer pq(o.backend, T * kHeads * kDim), pk(o.backend, T * kKvHeads * kDim),
        pv(o.backend, T * kKvHeads * kDim), pout(o.backend, T * kHeads * kDim);
    for (uint32_t layer = 0; layer < kLayers; ++layer)
      require(minikv_prefill(cache, layer, o.seqs, ids.data(), cu.data(), pq.data(), pk.data(),
                             pv.data(), pout.data(), nullptr),
              "minikv_prefill");
    drain(o.backend);
  };

  uint32_t layer = 0;  // the calls rotate over the layers, as an engine's step does
  auto next = [&] { return layer = (layer + 1) % kLayers; };
  const std::pair<const char *, std::function<void()>> kinds[] = {
      {"append", [&] { require(minikv_append(cache, next(), o.seqs, ids.data(), k.data(), v.data(), nullptr), "append"); }},
      {"decode", [&] { require(minikv_decode(cache, next(), o.seqs, ids.data(), q.data(), out.data(), nullptr), "decode"); }},
      {"append + decode", [&] {
         const uint32_t l = next();
         require(minikv_append(cache, l, o.seqs, ids.data(), k.data(), v.data(), nullptr), "append");
         require(minikv_decode(cache, l, o.seqs, ids.data(), q.data(), out.data(), nullptr), "decode");
       }},
      {"append_decode", [&] {
         require(minikv_append_decode(cache, next(), o.seqs, ids.data(), q.data(), k.data(),
                                      v.data(), out.data(), nullptr),
                 "append_decode");
       }},
  };
  std::vector<Result> results;
  for (const auto &kind : kinds) {
    fresh_cache();
    std::vector<double> us;
    for (uint32_t s = 0; s <= o.samples; ++s) {  // sample 0 warms up
      drain(o.backend);
      const auto t0 = std::chrono::steady_clock::now();
      for (uint32_t c = 0; c < o.calls; ++c) kind.second();
      const auto t1 = std::chrono::steady_clock::now();
      if (s > 0) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / o.calls);
    }
    drain(o.backend);
    std::sort(us.begin(), us.end());
    results.push_back({kind.first, us[us.size() / 2], us.front()});
  }
  minikv_cache_destroy(cache);

  std::printf("host time per layer-call: %s backend, %u sequences, context %u, %u calls x %u samples\n",
              o.backend == MINIKV_BACKEND_CUDA ? "CUDA" : "CPU (1 thread)", o.seqs, o.context,
              o.calls, o.samples);
  for (const Result &r : results)
    std::printf("  %-16s median %8.2f us   min %8.2f us\n", r.name, r.median_us, r.min_us);
  if (o.json) {
    FILE *f = std::fopen(o.json, "w");
    if (!f) usage("cannot write --json");
    std::fprintf(f, "{\"backend\": \"%s\", \"seqs\": %u, \"context\": %u, \"calls\": %u, \"samples\": %u, \"library\": \"%s\", \"results\": [",
                 o.backend == MINIKV_BACKEND_CUDA ? "cuda" : "cpu", o.seqs, o.context, o.calls,
                 o.samples, minikv_version_string());
    for (size_t i = 0; i < results.size(); ++i)
      std::fprintf(f, "%s{\"call\": \"%s\", \"median_us\": %.3f, \"min_us\": %.3f}", i ? ", " : "",
                   results[i].name, results[i].median_us, results[i].min_us);
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}

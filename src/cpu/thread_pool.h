// A small persistent worker pool for the CPU backend. parallel_for(n, fn) runs fn(i, worker)
// for i in [0, n) on the pool and the calling thread; work items write disjoint outputs,
// so results do not depend on the number of threads or on scheduling.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <type_traits>
#include <mutex>
#include <thread>
#include <vector>

namespace minikv::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(unsigned num_threads);  // total threads including the caller
  ~ThreadPool();
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;

  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }
  // fn(item, worker_index); worker_index in [0, size()). Exceptions from fn are rethrown
  // (the first one) after every item has finished or been skipped.
  // The callable is borrowed, not copied: no allocation per call.
  template <typename Fn>
  void parallel_for(uint64_t n, Fn &&fn) {
    using F = std::remove_reference_t<Fn>;
    run(n, Job{const_cast<void *>(static_cast<const void *>(&fn)),
               [](void *f, uint64_t i, unsigned w) { (*static_cast<F *>(f))(i, w); }});
  }

 private:
  struct Job {
    void *fn;
    void (*call)(void *fn, uint64_t item, unsigned worker);
  };
  void run(uint64_t n, Job job);
  void worker_loop(unsigned index);
  void run_items(unsigned worker);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  unsigned busy_ = 0;
  bool stop_ = false;
  Job job_{nullptr, nullptr};
  uint64_t job_size_ = 0;
  std::atomic<uint64_t> next_{0};
  std::exception_ptr error_;
};

// Threads to use: MINIKV_NUM_THREADS if set (>= 1), else the hardware concurrency.
unsigned default_thread_count();

}  // namespace minikv::cpu

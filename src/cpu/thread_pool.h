// A small persistent worker pool for the CPU backend. parallel_for(n, fn) runs fn(i, worker)
// for i in [0, n) on the pool and the calling thread; work items write disjoint outputs,
// so results do not depend on the number of threads or on scheduling.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
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
  void parallel_for(uint64_t n, const std::function<void(uint64_t, unsigned)> &fn);

 private:
  void worker_loop(unsigned index);
  void run_items(unsigned worker);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  unsigned busy_ = 0;
  bool stop_ = false;
  const std::function<void(uint64_t, unsigned)> *job_ = nullptr;
  uint64_t job_size_ = 0;
  std::atomic<uint64_t> next_{0};
  std::exception_ptr error_;
};

// Threads to use: MINIKV_NUM_THREADS if set (>= 1), else the hardware concurrency.
unsigned default_thread_count();

}  // namespace minikv::cpu

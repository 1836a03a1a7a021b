// A small persistent worker pool for the CPU backend. parallel_for(n, fn) runs fn(i, worker)
// for i in [0, n) on the pool and the calling thread; work items write disjoint outputs,
// so results do not depend on the number of threads or on scheduling.
//
// fork(): the child of a process that forked has only the forking thread, so a pool made
// before the fork has no workers there, and its mutex and condition variables may record
// waiters that will never run. The pool notices (a pthread_atfork counter) and, in the
// child, abandons that state (leaked, never joined or destroyed) and starts new workers on
// its next use, so a handle created before fork() keeps working in the child.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
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

  unsigned size() const { return num_threads_; }
  // fn(item, worker_index); worker_index in [0, size()). Exceptions from fn are rethrown
  // (the first one) after every item has finished or been skipped.
  // The callable is borrowed, not copied: no allocation per call (except the first call
  // in a forked child, which starts the workers again).
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
  // What the workers of one process share.
  struct Workers {
    std::vector<std::thread> threads;
    std::mutex mutex;
    std::condition_variable wake, done;
    uint64_t generation = 0;
    unsigned busy = 0;
    bool stop = false;
    Job job{nullptr, nullptr};
    uint64_t job_size = 0;
    std::atomic<uint64_t> next{0};
    std::exception_ptr error;

    void loop(unsigned index);
    void run_items(unsigned worker);
    void stop_and_join() noexcept;
  };

  void start();  // new Workers, num_threads_ - 1 threads
  void run(uint64_t n, Job job);

  unsigned num_threads_;
  std::unique_ptr<Workers> workers_;
  uint64_t forks_at_start_ = 0;  // the process's fork count when workers_ was started
};

// Threads to use: MINIKV_NUM_THREADS if set (>= 1), else the hardware concurrency.
unsigned default_thread_count();

}  // namespace minikv::cpu

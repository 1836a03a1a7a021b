// A small persistent worker pool for the CPU backend. parallel_for(n, fn) runs fn(i, worker)
// for i in [0, n) on the pool and the calling thread; work items write disjoint outputs,
// so results do not depend on the number of threads or on scheduling.
//
// The caller returns as soon as every item has run: it never waits for a worker that has
// not claimed one. On a machine whose other cores are busy a woken worker may get a core
// only milliseconds later; the caller then runs the items itself meanwhile, and the late
// worker finds nothing left (items are claimed with the job's number, so a worker of an
// earlier job cannot take an item of the next).
//
// Waiting: a worker that has run its items polls for the next job, and the caller for the
// workers' last items, for up to 100 us (yielding now and then) before sleeping on a
// condition variable. A futex wake costs about as much as a short decode call; with
// polling, a run of calls (layer after layer) keeps the workers awake. On a machine whose
// cores are all busy the polling competes for them: a 4K decode with 2 threads on 2 cores
// next to a busy loop took 0-30% longer than with sleeping at once (on a quiet machine:
// half the time).
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
  // fn(item, worker_index); worker_index in [0, size()); n < 2^32. Exceptions from fn are
  // rethrown (the first one) after every item has finished or been skipped.
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
    uint32_t generation = 0;  // the job's number (under mutex)
    bool stop = false;
    Job job{nullptr, nullptr};  // stable while one of its items is claimed and not finished
    std::atomic<uint32_t> job_size{0};
    // (generation << 32) | the next item to claim. A claim is a compare-exchange that keeps
    // the job's number, of an item below job_size; a new job first closes the old one
    // (its number, item 2^32 - 1), then sets job_size, so that a claim that read the new
    // job_size cannot succeed on the old job.
    std::atomic<uint64_t> next{0};
    std::atomic<uint32_t> finished{0};  // items of the current job run or skipped
    std::exception_ptr error;

    void loop(unsigned index);
    void run_items(uint32_t generation, unsigned worker);
    void finish(uint32_t items);
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

#include "thread_pool.h"

#include <cstdlib>

namespace minikv::cpu {

unsigned default_thread_count() {
  if (const char *env = std::getenv("MINIKV_NUM_THREADS")) {
    const long n = std::strtol(env, nullptr, 10);
    if (n >= 1 && n <= 1024) return static_cast<unsigned>(n);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : hw;
}

ThreadPool::ThreadPool(unsigned num_threads) {
  // If a worker cannot be started (out of memory, thread limit), stop and join those already
  // running before rethrowing: destroying a joinable std::thread during unwinding would
  // terminate the process (found by tests/reliability/test_oom).
  try {
    workers_.reserve(num_threads > 1 ? num_threads - 1 : 0);
    for (unsigned i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread &t : workers_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread &t : workers_) t.join();
}

void ThreadPool::run_items(unsigned worker) {
  for (;;) {
    const uint64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= job_size_) return;
    try {
      job_.call(job_.fn, i, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(job_size_, std::memory_order_relaxed);  // skip the rest
    }
  }
}

void ThreadPool::worker_loop(unsigned index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_items(index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::run(uint64_t n, Job job) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (uint64_t i = 0; i < n; ++i) job.call(job.fn, i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = job;
    job_size_ = n;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    busy_ = static_cast<unsigned>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  run_items(0);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return busy_ == 0; });
    job_ = Job{nullptr, nullptr};
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace minikv::cpu

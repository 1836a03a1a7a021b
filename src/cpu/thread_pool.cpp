#include "thread_pool.h"

#include <pthread.h>

#include <chrono>
#include <cstdlib>

namespace minikv::cpu {

namespace {

// How long a thread polls before it sleeps: a worker that has run its items, for the next
// job; the caller, for the workers' last items. Waking a thread that sleeps on a condition
// variable costs tens of microseconds (a futex wake, then the scheduler), as much as the
// whole of a short decode call; one layer's call follows the previous one within
// microseconds, so polling briefly keeps the workers awake through a run of calls and
// costs a core for at most this long after the last one.
constexpr auto kSpin = std::chrono::microseconds(100);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls done() for up to kSpin; true when it held. It yields the core now and then, so
// that where threads outnumber free cores the thread polled for (or the caller's own
// work between calls) gets it.
template <typename Done>
bool spin_until(Done done) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::yield();
  }
}

// Forks this process has gone through, as seen by the current process (incremented in
// every child). pthread_atfork handlers of a shared library are removed when it is unloaded.
std::atomic<uint64_t> g_forks{0};

uint64_t forks_so_far() {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] { g_forks.fetch_add(1, std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  return g_forks.load(std::memory_order_relaxed);
}

}  // namespace

unsigned default_thread_count() {
  if (const char *env = std::getenv("MINIKV_NUM_THREADS")) {
    const long n = std::strtol(env, nullptr, 10);
    if (n >= 1 && n <= 1024) return static_cast<unsigned>(n);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : hw;
}

ThreadPool::ThreadPool(unsigned num_threads) : num_threads_(num_threads > 1 ? num_threads : 1) {
  start();
}

ThreadPool::~ThreadPool() {
  // In a forked child the workers do not exist: leave their state alone.
  if (forks_so_far() != forks_at_start_) {
    (void)workers_.release();
    return;
  }
  workers_->stop_and_join();
}

void ThreadPool::start() {
  const uint64_t forks = forks_so_far();
  auto w = std::make_unique<Workers>();
  // If a worker cannot be started (out of memory, thread limit), stop and join those already
  // running before rethrowing: destroying a joinable std::thread during unwinding would
  // terminate the process (found by tests/reliability/test_oom).
  try {
    w->threads.reserve(num_threads_ - 1);
    Workers *shared = w.get();
    for (unsigned i = 1; i < num_threads_; ++i)
      w->threads.emplace_back([shared, i] { shared->loop(i); });
  } catch (...) {
    w->stop_and_join();
    throw;
  }
  workers_ = std::move(w);
  forks_at_start_ = forks;
}

void ThreadPool::Workers::stop_and_join() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stop = true;
  }
  wake.notify_all();
  for (std::thread &t : threads) t.join();
}

void ThreadPool::Workers::finish(uint32_t items) {
  const uint32_t size = job_size.load(std::memory_order_relaxed);  // before the job may end
  if (finished.fetch_add(items, std::memory_order_acq_rel) + items == size) {
    // The caller may be about to wait: take the mutex so that the notification cannot
    // fall between its check and its wait.
    { std::lock_guard<std::mutex> lock(mutex); }
    done.notify_one();
  }
}

void ThreadPool::Workers::run_items(uint32_t gen, unsigned worker) {
  const uint64_t tag = uint64_t(gen) << 32;
  uint64_t cur = next.load(std::memory_order_acquire);
  for (;;) {
    if ((cur >> 32) != gen) return;
    const uint32_t size = job_size.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(cur) >= size) return;
    if (!next.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire))
      continue;
    uint32_t skipped = 0;
    try {
      job.call(job.fn, static_cast<uint32_t>(cur), worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::current_exception();
      // Skip the rest: claim every unclaimed item at once and count it as finished.
      uint64_t rest = next.load(std::memory_order_acquire);
      while (static_cast<uint32_t>(rest) < size &&
             !next.compare_exchange_weak(rest, tag | size, std::memory_order_acq_rel)) {
      }
      if (static_cast<uint32_t>(rest) < size) skipped = size - static_cast<uint32_t>(rest);
    }
    finish(1 + skipped);
    cur = next.load(std::memory_order_acquire);
  }
}

void ThreadPool::Workers::loop(unsigned index) {
  uint32_t seen = 0;
  for (;;) {
    // A job is open once `next` carries its number and a claimable item (a new job first
    // closes the old one with item 2^32 - 1).
    uint32_t polled = seen;
    if (spin_until([&] {
          const uint64_t cur = next.load(std::memory_order_acquire);
          polled = static_cast<uint32_t>(cur >> 32);
          return polled != seen && static_cast<uint32_t>(cur) != 0xffffffffu;
        })) {
      seen = polled;
      run_items(seen, index);
      continue;
    }
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stop || generation != seen; });
      if (stop) return;
      seen = generation;
    }
    run_items(seen, index);
  }
}

void ThreadPool::run(uint64_t n, Job job) {
  if (n == 0) return;
  if (forks_so_far() != forks_at_start_) {
    // A forked child: the parent's workers are not here. Abandon their state (never joined
    // or destroyed) and start this process's own.
    Workers *abandoned = workers_.release();
    try {
      start();
    } catch (...) {
      workers_.reset(abandoned);  // still abandoned: the next call tries again
      throw;
    }
  }
  Workers &w = *workers_;
  if (w.threads.empty() || n == 1) {
    for (uint64_t i = 0; i < n; ++i) job.call(job.fn, i, 0);
    return;
  }
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    gen = ++w.generation;
    w.next.store((uint64_t(gen) << 32) | 0xffffffffu, std::memory_order_relaxed);  // closes the old job
    w.job = job;
    w.error = nullptr;
    w.finished.store(0, std::memory_order_relaxed);
    w.job_size.store(static_cast<uint32_t>(n), std::memory_order_release);
    w.next.store(uint64_t(gen) << 32, std::memory_order_release);
  }
  w.wake.notify_all();
  w.run_items(gen, 0);
  std::exception_ptr error;
  spin_until([&] { return w.finished.load(std::memory_order_acquire) == n; });
  {
    std::unique_lock<std::mutex> lock(w.mutex);
    w.done.wait(lock, [&] { return w.finished.load(std::memory_order_acquire) == n; });
    w.job = Job{nullptr, nullptr};
    error = w.error;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace minikv::cpu

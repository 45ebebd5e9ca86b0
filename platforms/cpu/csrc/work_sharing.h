// Work sharing for the kernels: the calling thread and up to N - 1 helper threads each run one
// worker body, and a body claims work items from a counter of its own until none is left.
//
// Why not at::parallel_for: an OpenMP parallel region ends at a barrier that waits for every
// thread of the team to have run, including one that has not even started because something
// else holds its core (the server's event loop streaming tokens, a benchmark client). On a
// 2-core host a region then lasts as long as the other core stays busy, and a decode step runs
// a few dozen of them. Here the caller runs its body like any helper; when it finds no item left
// it closes the job and waits only for the helpers that joined, each finishing the item it
// holds; a helper that comes later finds the job closed. Which thread runs an item never
// changes its result (every kernel computes an item the same way on any thread).
//
// Helpers spin between jobs for a while (a step's kernels come tens of microseconds apart, and
// waking a sleeping thread costs about as much as a small kernel), then sleep until the next
// job. Where another thread pool computes between the jobs (oneDNN's GEMMs run on OpenMP's
// threads), a helper spinning on its core keeps that pool's thread off it: there the helpers
// yield their core at each turn of the spin instead (set_yield_between_jobs).
//
// A helper joins by first counting itself active and then taking a slot: the caller closes
// the job by taking the slots left and waits for the active count to drop, so a helper either
// holds a slot of a job whose caller waits for it, or touches nothing of it.
//
// One pool per library (each ISA build has its own namespace); its helpers are started on first
// use, up to at::get_num_threads() - 1 of the calling thread, and never stop. A child process
// (fork) starts a pool of its own: the parent's helpers do not exist there.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace OCTAVO_CPU_NAMESPACE {

class WorkPool {
 public:
  // Runs `body` on the calling thread and on up to `workers` - 1 helpers that join in time;
  // returns when the caller's body has returned and every helper that joined has too. The first
  // exception any body throws is rethrown here.
  void run(int64_t workers, const std::function<void()>& body) {
    // Nested in a body, or beside another thread's job: this thread does it all.
    std::unique_lock<std::mutex> caller(caller_mutex_, std::try_to_lock);
    if (workers <= 1 || in_worker() || !caller.owns_lock()) {
      body();
      return;
    }
    start_helpers(workers - 1);
    error_ = nullptr;
    job_.store(&body);
    slots_.store(workers - 1);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    std::exception_ptr error;
    in_worker() = true;
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    in_worker() = false;
    slots_.store(0);  // closed: no helper joins from here on
    // A joined helper finishing its last item; one the OS took off its core gets this one.
    for (int spins = 0; active_.load() > 0; ++spins) {
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
    if (!error) error = error_;
    if (error) std::rethrow_exception(error);
  }

  // Whether waiting helpers yield their core at each turn of the spin (sched_yield: another
  // runnable thread gets it at once) rather than pause on it; returns the previous setting. Off
  // by default: a yield takes a system call each turn, and where every kernel runs on this pool
  // (the tiny fp32 model at batch 1) a token took ~15% longer with helpers that yield.
  bool set_yield_between_jobs(bool on) { return yield_between_jobs_.exchange(on); }

 private:
  static bool& in_worker() {
    static thread_local bool worker = false;
    return worker;
  }

  // How long a helper spins after a job before it sleeps: longer than the gaps between one
  // step's kernels, shorter than the scheduling between steps (0.1, 1 and 5 ms measured alike).
  static constexpr std::chrono::microseconds kSpinWindow{200};

  void start_helpers(int64_t wanted) {
    while (num_helpers_ < wanted) {
      std::thread(&WorkPool::helper_loop, this, generation_.load()).detach();
      ++num_helpers_;
    }
  }

  // Waits for a job newer than `seen`: spinning within the window, then asleep.
  uint64_t next_generation(uint64_t seen) {
    auto since = std::chrono::steady_clock::now();
    for (int spins = 1;; ++spins) {
      const uint64_t now = generation_.load();
      if (now != seen) return now;
      if (yield_between_jobs_.load(std::memory_order_relaxed)) {
        std::this_thread::yield();
      } else {
        _mm_pause();
      }
      if (spins % 64 != 0) continue;
      if (std::chrono::steady_clock::now() - since < kSpinWindow) continue;
      sleepers_.fetch_add(1);
      {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      sleepers_.fetch_sub(1);
      since = std::chrono::steady_clock::now();
    }
  }

  void helper_loop(uint64_t seen) {
    in_worker() = true;
    for (;;) {
      seen = next_generation(seen);
      active_.fetch_add(1);
      int64_t slots = slots_.load();
      while (slots > 0 && !slots_.compare_exchange_weak(slots, slots - 1)) {
      }
      if (slots > 0) {
        try {
          (*job_.load())();
        } catch (...) {
          std::lock_guard<std::mutex> guard(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
      active_.fetch_sub(1);
    }
  }

  std::atomic<bool> yield_between_jobs_{false};
  std::mutex caller_mutex_;  // one job at a time
  std::atomic<const std::function<void()>*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> slots_{0};   // helpers that may still join the current job
  std::atomic<int64_t> active_{0};  // helpers joining or running the current job
  std::atomic<int64_t> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  int64_t num_helpers_ = 0;  // under caller_mutex_
};

// This process's pool (a forked child's own: the parent's helpers and lock are not there).
inline WorkPool& work_pool() {
  static WorkPool* pool = new WorkPool();  // never destroyed: helpers wait on it until exit
  static pid_t owner = getpid();
  if (getpid() != owner) {
    pool = new WorkPool();
    owner = getpid();
  }
  return *pool;
}

// `body` on up to min(workers, at::get_num_threads()) threads, the caller's among them; each
// body claims its items from a shared counter until none is left.
template <typename Body>
void parallel_workers(int64_t workers, const Body& body) {
  workers = std::min<int64_t>(workers, at::get_num_threads());
  if (workers <= 1) {
    body();
    return;
  }
  work_pool().run(workers, std::function<void()>(std::cref(body)));
}

// fn(begin, end) over [0, n) in chunks of at least `grain` (about eight per thread), claimed by
// the threads in turn.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t grain, const Fn& fn) {
  const int64_t threads = at::get_num_threads();
  if (n <= grain || threads <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  const int64_t chunk = std::max<int64_t>(grain, (n + threads * 8 - 1) / (threads * 8));
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  parallel_workers(chunks, [&] {
    for (int64_t c = next++; c < chunks; c = next++) {
      fn(c * chunk, std::min(n, (c + 1) * chunk));
    }
  });
}

}  // namespace OCTAVO_CPU_NAMESPACE

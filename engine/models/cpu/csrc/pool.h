// specserve::parallel_for: the CPU operators' own thread pool, a join that never waits for a thread that has not
// started.
//
// at::parallel_for (OpenMP) splits a range into one fixed chunk per thread and ends with a barrier that waits for
// every thread of the team. A decode step runs ~180 such regions; served, the compute threads share the cores with
// the router, HAProxy, Ray's daemons and the clients, and whenever one of them holds a core the region waits for the
// compute thread it displaced: on this project's 2-core machine a served step at batch 8 took as long on two threads
// as on one (bench/RESULTS.md). Here the calling thread publishes the range and claims chunks itself;
// helper threads claim chunks too when they are running, and the caller waits only for chunks a helper has
// claimed. A helper that is not scheduled in time does no work instead of delaying the step.
//
// Chunks: at least `grain` items, about four per thread (a thread that falls behind leaves the rest to the others).
// Which thread runs a chunk never changes its arithmetic: every caller's chunks are independent units (the
// operators' batch invariance and per-query exactness do not depend on the split).
//
// Helpers: torch's thread count minus one (at::get_num_threads(), so torch.set_num_threads governs both), started
// on first use by the thread that calls (so they inherit its scheduling niceness: deployments/workers/base.py), re-made
// after a fork. After a region they spin for up to spin(), then sleep on a futex; the caller wakes them only when one
// sleeps. A chunk must not throw (the operators check their arguments before they split the work). One region at a
// time per process: a second caller while one runs computes its range on its own thread. SPECSERVE_POOL=openmp runs
// at::parallel_for instead (A/B measurements).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace specserve {

class Pool {
 public:
  using Call = void (*)(const void* ctx, int64_t first, int64_t last);

  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may sleep in a futex at exit
    if (pool->pid_ != getpid()) pool = new Pool();  // a forked child has none of the parent's threads
    return *pool;
  }

  static bool openmp() {
    static const bool use = [] {
      const char* v = std::getenv("SPECSERVE_POOL");
      return v != nullptr && std::strcmp(v, "openmp") == 0;
    }();
    return use;
  }

  void run(int64_t begin, int64_t end, int64_t grain, Call call, const void* ctx) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    grain = std::max<int64_t>(1, grain);
    if (threads == 1 || n <= grain || inside || at::in_parallel_region()) {
      call(ctx, begin, end);
      return;
    }
    std::unique_lock<std::mutex> one(running_, std::try_to_lock);
    if (!one.owns_lock()) {  // another thread's region is running: this one computes alone
      call(ctx, begin, end);
      return;
    }
    ensure_helpers(threads - 1);
    chunk_ = std::max(grain, (n + 4 * threads - 1) / (4 * threads));
    call_ = call;
    ctx_ = ctx;
    begin_ = begin;
    end_ = end;
    pending_.store(n, std::memory_order_relaxed);
    const uint32_t epoch = epoch_.load(std::memory_order_relaxed) + 1;
    chunks_ = (n + chunk_ - 1) / chunk_;
    ticket_.store(static_cast<uint64_t>(epoch) << 32, std::memory_order_seq_cst);
    epoch_.store(epoch, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    work(epoch);
    for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();  // a helper holds a chunk and lost its core: let it have ours
    }
    // closed before the next region's fields are written: a helper still looking at this region fails its claim
    ticket_.store((static_cast<uint64_t>(epoch) << 32) | kClosed, std::memory_order_seq_cst);
  }

 private:
  Pool() : pid_(getpid()) {}

  // claim and run chunks of region `epoch` until none is left; a claim of a later region fails
  void work(uint32_t epoch) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      do {
        if (static_cast<uint32_t>(t >> 32) != epoch || (t & kClosed) >= static_cast<uint64_t>(chunks_)) return;
      } while (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_seq_cst, std::memory_order_acquire));
      // a successful claim means the region was still open, and the claimed chunk keeps pending_ above zero, so the
      // region's fields stay as they are until it is done
      const int64_t first = static_cast<int64_t>(t & kClosed) * chunk_;
      const int64_t last = std::min(first + chunk_, end_ - begin_);
      inside = true;
      call_(ctx_, begin_ + first, begin_ + last);
      inside = false;
      pending_.fetch_sub(last - first, std::memory_order_acq_rel);
    }
  }

  void ensure_helpers(int64_t count) {
    for (; helpers_ < count; ++helpers_) std::thread([this] { helper(); }).detach();
  }

  void helper() {
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t now = epoch_.load(std::memory_order_acquire);
      const auto spin_until = std::chrono::steady_clock::now() + spin();
      for (int spins = 1; now == seen; ++spins) {
        _mm_pause();
        now = epoch_.load(std::memory_order_acquire);
        if (spins % 256 == 0 && std::chrono::steady_clock::now() > spin_until) break;
      }
      while (now == seen) {
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        now = epoch_.load(std::memory_order_acquire);
      }
      seen = now;
      work(now);
    }
  }

  // how long a helper spins after a region before it sleeps (SPECSERVE_POOL_SPIN_US, default kSpinUs): longer than
  // the gaps between one step's regions (tens of microseconds of Python), short enough that an idle worker frees its
  // cores soon after a round (a draft model on the same cores computes while the target waits, and the other way
  // round) and that the router, the proxy and the clients, at a lower priority on the same cores, are not kept
  // waiting while a helper spins (50 us served more tokens/s than 200 at 16 streams and no fewer at 1 and 8:
  // bench/RESULTS.md, issue 50)
  static std::chrono::microseconds spin() {
    static const std::chrono::microseconds us{[] {
      const char* v = std::getenv("SPECSERVE_POOL_SPIN_US");
      return v != nullptr ? std::max(0L, std::strtol(v, nullptr, 10)) : kSpinUs;
    }()};
    return us;
  }
  static constexpr long kSpinUs = 50;
  static constexpr uint64_t kClosed = 0xffffffffu;  // a ticket's index once its region has ended

  static inline thread_local bool inside = false;  // in a chunk: work it splits again is computed on this thread
  const pid_t pid_;
  std::mutex running_;
  int64_t helpers_ = 0;  // helper threads started (detached: they live as long as the process)
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int32_t> sleeping_{0};
  std::atomic<uint64_t> ticket_{0};  // (epoch << 32) | next chunk index
  std::atomic<int64_t> pending_{0};  // items of the current region not yet computed
  Call call_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1, chunks_ = 0;
};

// parallel_for(begin, end, grain, f): f(first, last) over disjoint chunks covering [begin, end), as at::parallel_for
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (Pool::openmp()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  Pool::get().run(begin, end, grain,
                  [](const void* ctx, int64_t first, int64_t last) { (*static_cast<const F*>(ctx))(first, last); }, &f);
}

}  // namespace specserve

// Work spread over XLA's CPU thread pool (the FFI's ThreadPool context), shared by
// the native kernels (logsumexp.cc, topk.cc).

#ifndef ADV_JAX_MATH_KERNELS_CPU_PARALLEL_H_
#define ADV_JAX_MATH_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace adv_jax_math_native {

namespace ffi = xla::ffi;

// Runs body(0..total-1) on the caller and up to `helpers` pool tasks. Items are
// claimed from a shared counter; the caller waits only for items actually claimed,
// so tasks that the pool starts late (or never in parallel) cannot deadlock, and
// they touch only the shared counter, which they keep alive.
struct Shared {
  explicit Shared(int64_t total_) : total(total_) {}
  const int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
  std::function<void(int64_t)> body;  // valid until the caller returns
};

inline void Drain(Shared& sh) {
  int64_t ran = 0;
  for (int64_t i = sh.next.fetch_add(1); i < sh.total; i = sh.next.fetch_add(1)) {
    sh.body(i);
    ++ran;
  }
  if (ran > 0 && sh.done.fetch_add(ran) + ran == sh.total) {
    std::lock_guard<std::mutex> lock(sh.mu);
    sh.cv.notify_all();
  }
}

inline void ParallelFor(ffi::ThreadPool& pool, int64_t total, int64_t helpers,
                        std::function<void(int64_t)> body) {
  auto sh = std::make_shared<Shared>(total);
  sh->body = std::move(body);
  try {
    for (int64_t h = 0; h < helpers; ++h) pool.Schedule([sh] { Drain(*sh); });
  } catch (...) {
    // Could not schedule more helpers: the caller does the rest.
  }
  Drain(*sh);
  std::unique_lock<std::mutex> lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->done.load() == sh->total; });
}

// ADV_JAX_MATH_NATIVE_THREADS=k (k >= 1) caps the threads a call uses; results never
// depend on it.
inline int64_t ThreadCap() {
  const char* env = std::getenv("ADV_JAX_MATH_NATIVE_THREADS");
  if (env == nullptr || *env == '\0') return std::numeric_limits<int64_t>::max();
  char* end = nullptr;
  const long long k = std::strtoll(env, &end, 10);
  return (*end == '\0' && k >= 1) ? k : std::numeric_limits<int64_t>::max();
}

// body(0..total-1): on the caller alone when there is one item or one thread, or
// when not `parallel` (too little work); else spread over the pool's threads (at most
// ThreadCap()).
inline void ForEach(ffi::ThreadPool& pool, int64_t total, bool parallel,
                    const std::function<void(int64_t)>& body) {
  const int64_t threads = std::min(pool.num_threads(), ThreadCap());
  if (total <= 1 || threads <= 1 || !parallel) {
    for (int64_t i = 0; i < total; ++i) body(i);
  } else {
    ParallelFor(pool, total, std::min(threads, total) - 1, body);
  }
}

}  // namespace adv_jax_math_native

#endif  // ADV_JAX_MATH_KERNELS_CPU_PARALLEL_H_

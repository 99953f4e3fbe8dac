// mok: a small fixed thread pool for the CPU reference. Work is split into index ranges;
// every output element is computed by exactly one fixed-order computation, in the default
// floating-point environment (DefaultFloatEnvironment), so results do not depend on the
// thread count, the split or the caller's rounding mode and flush-to-zero settings.
// Fork-safe: a pool used in a forked child (Python's multiprocessing, say) finds that its
// workers stayed in the parent, leaves their state alone and starts its own there.
#pragma once
#include <cfenv>
#include <cstdint>
#include <functional>
#include <memory>

namespace mok::ref {

// The reference's arithmetic runs in one floating-point environment whatever its caller's:
// the default one (round to nearest, subnormals kept: on x86 FE_DFL_ENV clears MXCSR's FTZ
// and DAZ), set while this lives and the caller's put back after (on a throw too). A job's
// chunks go to the caller's thread and the workers as they come, so a caller that had set
// another rounding mode or flush-to-zero (torch.set_flush_denormal, a fast-math library)
// would otherwise make results depend on the thread count and stop following the documented
// rounding. parallel_for holds one on the caller's thread and on each worker for each job;
// the CPU backend holds one around a whole forward or backward (its serial parts too).
class DefaultFloatEnvironment {
 public:
  DefaultFloatEnvironment() {
    std::fegetenv(&saved_);
    std::fesetenv(FE_DFL_ENV);
  }
  ~DefaultFloatEnvironment() { std::fesetenv(&saved_); }
  DefaultFloatEnvironment(const DefaultFloatEnvironment&) = delete;
  DefaultFloatEnvironment& operator=(const DefaultFloatEnvironment&) = delete;

 private:
  std::fenv_t saved_;
};

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // 0: hardware concurrency
  ~ThreadPool();
  int size() const;
  // Calls fn(begin, end) over [0, n) in chunks of at least `grain`; blocks until done.
  // The first exception thrown by fn is rethrown here.
  void parallel_for(std::int64_t n, std::int64_t grain,
                    const std::function<void(std::int64_t, std::int64_t)>& fn);

 private:
  void start_workers(int threads);  // threads - 1 workers beside the caller
  void start_worker();
  void shutdown();  // stops and joins every worker started
  // In a forked child: the workers, and the lock they may have held at the fork, are the
  // parent's; the state is left (leaked) untouched and the same number started here.
  void restart_if_forked();
  int threads_ = 1;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mok::ref

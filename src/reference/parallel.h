// mok: a small fixed thread pool for the CPU reference. Work is split into index ranges;
// every output element is computed by exactly one fixed-order computation, so results do
// not depend on the thread count or the split.
// Fork-safe: a pool used in a forked child (Python's multiprocessing, say) finds that its
// workers stayed in the parent, leaves their state alone and starts its own there.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

namespace mok::ref {

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

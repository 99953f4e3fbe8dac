// mok: a small fixed thread pool for the CPU reference. Work is split into index ranges;
// every output element is computed by exactly one fixed-order computation, so results do
// not depend on the thread count or the split.
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
  void start_worker();
  void shutdown();  // stops and joins every worker started
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mok::ref

#include "reference/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <unistd.h>

#include "mok/error.h"

namespace mok::ref {

struct ThreadPool::State {
  const pid_t owner = getpid();  // the process whose threads the workers are
  std::vector<std::thread> workers;
  std::mutex mutex;
  std::condition_variable wake, done;
  std::uint64_t generation = 0;
  bool stop = false;
  // The current job.
  const std::function<void(std::int64_t, std::int64_t)>* fn = nullptr;
  std::int64_t n = 0, chunk = 1;
  std::atomic<std::int64_t> next{0};
  int active = 0;
  std::exception_ptr error;

  void run_chunks() {
    for (;;) {
      const std::int64_t begin = next.fetch_add(chunk);
      if (begin >= n) return;
      try {
        (*fn)(begin, std::min(n, begin + chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
      }
    }
  }
};

ThreadPool::ThreadPool(int threads) : state_(std::make_unique<State>()) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads_ = threads;
  start_workers(threads);
}

void ThreadPool::start_workers(int threads) {
  try {
    for (int i = 1; i < threads; ++i) start_worker();
  } catch (const std::system_error& e) {
    // The workers already started wait on the state's condition variable: stop and join them
    // before the state goes away (destroying it under them would hang), then report.
    const std::size_t started = state_->workers.size();
    shutdown();
    throw Error("CPU threads: could not start thread " + std::to_string(started + 2) + " of " +
                std::to_string(threads) + " (" + e.what() + "); ask for fewer (LayerOptions.cpu_threads, --threads)");
  }
}

void ThreadPool::start_worker() {
  State* st = state_.get();
  st->workers.emplace_back([st] {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(st->mutex);
        st->wake.wait(lock, [&] { return st->stop || st->generation != seen; });
        if (st->stop) return;
        seen = st->generation;
      }
      const DefaultFloatEnvironment float_environment;  // (each job: a job's code may change it)
      st->run_chunks();
      std::lock_guard<std::mutex> lock(st->mutex);
      if (--st->active == 0) st->done.notify_all();
    }
  });
}

void ThreadPool::shutdown() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->wake.notify_all();
  for (auto& t : state_->workers) t.join();
  state_->workers.clear();
}

void ThreadPool::restart_if_forked() {
  if (state_->owner == getpid()) return;
  // Joining or destroying the parent's std::thread objects here would hang or terminate,
  // and its mutex may be locked for good: leak the old state, start afresh.
  static_cast<void>(state_.release());
  state_ = std::make_unique<State>();
  start_workers(threads_);
}

ThreadPool::~ThreadPool() {
  if (state_->owner != getpid()) {  // a forked child that never used the pool: see above
    static_cast<void>(state_.release());
    return;
  }
  shutdown();
}

int ThreadPool::size() const { return static_cast<int>(state_->workers.size()) + 1; }

void ThreadPool::parallel_for(std::int64_t n, std::int64_t grain,
                              const std::function<void(std::int64_t, std::int64_t)>& fn) {
  if (n <= 0) return;
  const DefaultFloatEnvironment float_environment;
  restart_if_forked();
  State* st = state_.get();
  const std::int64_t threads = size();
  std::int64_t chunk = std::max<std::int64_t>(grain, (n + threads * 4 - 1) / (threads * 4));
  if (threads == 1 || n <= chunk) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(st->mutex);
    st->fn = &fn;
    st->n = n;
    st->chunk = chunk;
    st->next = 0;
    st->error = nullptr;
    st->active = static_cast<int>(st->workers.size());
    ++st->generation;
  }
  st->wake.notify_all();
  st->run_chunks();
  std::unique_lock<std::mutex> lock(st->mutex);
  st->done.wait(lock, [&] { return st->active == 0; });
  if (st->error) std::rethrow_exception(st->error);
}

}  // namespace mok::ref

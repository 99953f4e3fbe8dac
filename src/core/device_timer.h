// mok: device time of repeated calls, for the CLI and benchmarks (not public API).
// Every timed call sits between its own pair of CUDA events on `cuda_stream`, the calls are
// enqueued back to back after the warm-up and the events read after a synchronisation, so
// the host's launch latency and the synchronisation are not counted (the GPU stays busy, at
// the clocks it sustains under load, as in MoK's harness and bench/peer_torch.py).
#pragma once
#include <functional>
#include <vector>

namespace mok {

struct DeviceTimerCalls {
  std::function<void()> call;         // one call to time (enqueues work on the stream)
  std::function<void()> synchronize;  // waits for the stream's work (and raises its errors)
  int sync_every = 0;                 // > 0: also synchronise after every this many calls
                                      // (each synchronisation, and the one after the warm-up,
                                      // is followed by one untimed call: device_timer.cu)
};

// Per-iteration milliseconds of `iters` timed calls after `warmup` untimed ones, in order.
// Throws mok::Error when CUDA is unavailable or an event call fails.
std::vector<double> device_times_ms(void* cuda_stream, int warmup, int iters, const DeviceTimerCalls& calls);

}  // namespace mok

// mok_pull_rate: how fast one SM moves token rows from scattered source rows into a
// contiguous buffer, the dispatch mover's job (src/cuda/dispatch.cuh), in isolation.
//
// The communication CTAs move ~30 GB/s each during a forward (docs/PERFORMANCE.md, the
// megakernel's timeline), and deeper pipelines did not raise it. This benchmark asks what bounds that:
// the same copy with nothing else on the GPU, by 1, 16 and every SM, in the ways a CTA can
// move rows:
//   bulk   : warps with one issuing lane, global -> shared (mbarrier) -> global bulk copies,
//            `ahead` loads kept in flight per pipeline (dispatch.cuh's pull_rows);
//   load   : the same loads into shared memory, no stores (the load side alone);
//   store  : bulk stores from shared memory, no loads (the store side alone);
//   tstore : the bulk loads, and the pipeline's whole warp stores each landed row from
//            shared memory with 16-byte stores (a slot is free once its warp has read it);
//   ldst   : every thread copies 16 bytes at a time with ordinary loads and stores.
// (The issuing lane's warp-mates wait for it at the end rather than exit: with lanes 1-31
// exited while lane 0 kept 5 or more bulk loads in flight, the launches ended in
// "unspecified launch failure" on the H200, 2026-12-04; kept alive, every case runs.)
// Each CTA copies `rows` rows; row r of CTA c comes from a pseudo-random source row, as
// a dispatch's tokens do. Prints GB/s per CTA (bytes read, the median of `iters` launches,
// CUDA events) and writes the table, the GPU and the commit to --out as JSON when given.
//
// usage: mok_pull_rate [--row-bytes N] [--rows N] [--iters N] [--case I] [--out FILE]
// (--case I runs only the I-th row of the table, for a sanitizer or a profiler.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/sm90.cuh"
#include "micro_tool.h"

namespace {

using namespace mok::cuda;

constexpr mok::micro::Tool kTool{"mok_pull_rate"};

constexpr int kThreads = 384;         // the megakernel's CTA size
constexpr int kMaxPipes = 12;         // one per warp
constexpr int kMaxSlots = 32;         // row slots per pipeline (mbarriers)
constexpr std::size_t kSmem = 200 * 1024;  // about what a communication CTA has for its slots
constexpr long long kSpinLimit = 1ll << 32;  // a lost arrival ends the run with an error, not a hang

enum Mode : int { kBulk = 0, kLoadOnly = 1, kStoreOnly = 2, kLdSt = 3, kThreadStores = 4 };

struct Args {
  const std::uint8_t* src;  // [src_rows, row_bytes]
  std::uint8_t* dst;        // [grid * rows, row_bytes]
  int src_rows, rows, row_bytes;
  int pipes, slots, ahead;
  int mode;
  int* error;               // set when a wait spun past kSpinLimit
};

__device__ __forceinline__ int source_row(const Args& a, int cta, int r) {
  // A fixed pseudo-random permutation-ish map (odd multiplier mod 2^k; src_rows a power of 2).
  return static_cast<int>((static_cast<unsigned>(cta * a.rows + r) * 2654435761u) & (a.src_rows - 1));
}

__device__ bool wait_full(std::uint64_t* bar, unsigned phase, int* error) {
  long long spins = 0;
  while (!sm90::mbar_try_wait(bar, phase))
    if (++spins > kSpinLimit) {
      atomicExch(error, 1);
      return false;
    }
  return true;
}

__global__ void __launch_bounds__(kThreads, 1) pull_kernel(const Args a) {
  extern __shared__ std::uint8_t smem_raw[];
  const int cta = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  std::uint8_t* dst = a.dst + static_cast<std::size_t>(cta) * a.rows * a.row_bytes;
  if (a.mode == kLdSt) {
    const int v_per_row = a.row_bytes / 16;
    const long long total = static_cast<long long>(a.rows) * v_per_row;
    for (long long i = threadIdx.x; i < total; i += kThreads) {
      const int r = static_cast<int>(i / v_per_row), v = static_cast<int>(i % v_per_row);
      const int4* s = reinterpret_cast<const int4*>(a.src + static_cast<std::size_t>(source_row(a, cta, r)) * a.row_bytes);
      reinterpret_cast<int4*>(dst + static_cast<std::size_t>(r) * a.row_bytes)[v] = s[v];
    }
    return;
  }
  std::uint8_t* base = align_shared(smem_raw, 128);
  auto* bars = reinterpret_cast<std::uint64_t*>(base);
  std::uint8_t* buffers = base + kMaxPipes * kMaxSlots * sizeof(std::uint64_t);
  const std::size_t per_pipe = static_cast<std::size_t>(a.slots) * a.row_bytes;
  std::uint8_t* slots = buffers + warp * per_pipe;
  std::uint64_t* full = bars + warp * kMaxSlots;
  if (warp < a.pipes && lane == 0) {
    for (int s = 0; s < a.slots; ++s) sm90::mbar_init(&full[s], 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (warp >= a.pipes) return;
  // Pipeline `warp` takes rows warp, warp + pipes, ... (dispatch.cuh splits a tile so); row i
  // of it lands in slot i % S.
  const int n = (a.rows - warp + a.pipes - 1) / a.pipes;
  const int S = a.slots, ahead = min(a.ahead, S - 1);
  auto row = [&](int i) { return warp + i * a.pipes; };
  auto slot_of = [&](int i) { return slots + static_cast<std::size_t>(i % S) * a.row_bytes; };
  auto dst_of = [&](int i) { return dst + static_cast<std::size_t>(row(i)) * a.row_bytes; };
  auto load = [&](int i) {
    sm90::mbar_arrive_expect_tx(&full[i % S], a.row_bytes);
    sm90::bulk_load_g2s(slot_of(i), a.src + static_cast<std::size_t>(source_row(a, cta, row(i))) * a.row_bytes,
                        a.row_bytes, &full[i % S]);
  };
  if (a.mode == kThreadStores) {
    const int vectors = a.row_bytes / 16;
    if (lane == 0)
      for (int i = 0; i < min(ahead, n); ++i) load(i);
    for (int i = 0; i < n; ++i) {
      if (!wait_full(&full[i % S], (i / S) & 1, a.error)) return;
      const int4* from = reinterpret_cast<const int4*>(slot_of(i));
      int4* to = reinterpret_cast<int4*>(dst_of(i));
#pragma unroll 4
      for (int v = lane; v < vectors; v += 32) to[v] = from[v];
      __syncwarp();  // every lane has read the slot: row i + ahead may land in it
      if (lane == 0 && i + ahead < n) load(i + ahead);
    }
    return;
  }
  // Lane 0 issues; the other lanes wait for it at the end rather than exit (the header says why).
  const int pending = min(8, S - ahead);  // bulk stores still reading their slots
  auto issue = [&] {
    if (a.mode == kStoreOnly) {
      for (int i = 0; i < n; ++i) {
        sm90::bulk_store_s2g(dst_of(i), slot_of(i), a.row_bytes);
        sm90::bulk_commit();
        sm90::bulk_wait_read_but(pending);
      }
      sm90::bulk_wait_all();
      return;
    }
    if (a.mode == kLoadOnly) {
      // Keep S loads in flight: row i reuses slot i % S once row i - S has landed.
      for (int i = 0; i < n; ++i) {
        if (i >= S && !wait_full(&full[i % S], ((i - S) / S) & 1, a.error)) return;
        load(i);
      }
      for (int i = max(0, n - S); i < n; ++i)
        if (!wait_full(&full[i % S], (i / S) & 1, a.error)) return;
      return;
    }
    for (int i = 0; i < min(ahead, n); ++i) load(i);
    for (int i = 0; i < n; ++i) {
      if (!wait_full(&full[i % S], (i / S) & 1, a.error)) return;
      sm90::bulk_store_s2g(dst_of(i), slot_of(i), a.row_bytes);
      sm90::bulk_commit();
      if (i + ahead < n) {
        sm90::bulk_wait_read_but(pending);
        load(i + ahead);
      }
    }
    sm90::bulk_wait_all();
  };
  if (lane == 0) issue();
  __syncwarp();
}

struct Case {
  const char* name;
  int mode, grid, pipes, slots, ahead;
};

}  // namespace

int main(int argc, char** argv) {
  int row_bytes = 8192, rows = 1024, iters = 20, only = -1;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "mok_pull_rate: %s needs a value\nusage: mok_pull_rate [--row-bytes N] [--rows N] [--iters N] [--case I] [--out FILE]\n", a.c_str());
      return 2;
    }
    if (a == "--row-bytes") row_bytes = kTool.parse("--row-bytes", argv[++i], 16, 32768);
    else if (a == "--rows") rows = kTool.parse("--rows", argv[++i], 1, 1 << 16);
    else if (a == "--iters") iters = kTool.parse("--iters", argv[++i], 1, 10000);
    else if (a == "--case") only = kTool.parse("--case", argv[++i], 0, 1000);
    else if (a == "--out") out = argv[++i];
    else {
      std::fprintf(stderr, "mok_pull_rate: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (row_bytes % 16 != 0) {
    std::fprintf(stderr, "mok_pull_rate: --row-bytes = %d: must be a multiple of 16 (bulk copies)\n", row_bytes);
    return 2;
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "mok_pull_rate: no CUDA device: nothing measured\n");
    return 1;
  }
  cudaDeviceProp prop{};
  kTool.check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const int sms = prop.multiProcessorCount;
  const int src_rows = 1 << 16;  // 512 MB of 8 KB rows: far past L2
  std::uint8_t *src = nullptr, *dst = nullptr;
  int* error = nullptr;
  kTool.check(cudaMalloc(&src, static_cast<std::size_t>(src_rows) * row_bytes), "cudaMalloc src");
  kTool.check(cudaMalloc(&dst, static_cast<std::size_t>(sms) * rows * row_bytes), "cudaMalloc dst");
  kTool.check(cudaMalloc(&error, sizeof(int)), "cudaMalloc error");
  kTool.check(cudaMemset(src, 1, static_cast<std::size_t>(src_rows) * row_bytes), "cudaMemset src");
  kTool.check(cudaMemset(error, 0, sizeof(int)), "cudaMemset error");
  kTool.check(cudaFuncSetAttribute(pull_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)),
        "cudaFuncSetAttribute");
  const std::size_t slot_room = kSmem - 128 - kMaxPipes * kMaxSlots * sizeof(std::uint64_t);
  auto slots_for = [&](int pipes) {
    return std::min<int>(kMaxSlots, static_cast<int>(slot_room / pipes / row_bytes));
  };
  std::vector<Case> cases;
  for (int grid : {1, 16, sms}) {
    for (int pipes : {4, 8, 12}) {
      const int s = slots_for(pipes);
      if (s < 2) continue;
      cases.push_back({"bulk", kBulk, grid, pipes, s, std::max(1, s / 2)});
      if (s > 2) cases.push_back({"bulk", kBulk, grid, pipes, s, s - 1});
      cases.push_back({"tstore", kThreadStores, grid, pipes, s, std::max(1, s / 2)});
      if (s > 2) cases.push_back({"tstore", kThreadStores, grid, pipes, s, s - 1});
      cases.push_back({"load", kLoadOnly, grid, pipes, s, s});
      cases.push_back({"store", kStoreOnly, grid, pipes, s, 0});
    }
    cases.push_back({"ldst", kLdSt, grid, 0, 0, 0});
  }
  cudaEvent_t e0, e1;
  kTool.check(cudaEventCreate(&e0), "cudaEventCreate");
  kTool.check(cudaEventCreate(&e1), "cudaEventCreate");
  std::printf("%s, %d SMs; %d rows of %d bytes per CTA; median of %d launches\n", prop.name, sms, rows, row_bytes, iters);
  std::printf("%-6s %5s %5s %5s %5s %12s %12s\n", "mode", "ctas", "pipes", "slots", "ahead", "GB/s per CTA", "GB/s total");
  std::string json = "{" + mok::micro::json_run_fields(prop) + ", \"row_bytes\": " + std::to_string(row_bytes) +
                     ", \"rows_per_cta\": " + std::to_string(rows) + ", \"cases\": [";
  bool first = true;
  for (std::size_t ci = 0; ci < cases.size(); ++ci) {
    if (only >= 0 && static_cast<int>(ci) != only) continue;
    const Case& c = cases[ci];
    std::fflush(stdout);
    const Args a{src, dst, src_rows, rows, row_bytes, c.pipes, c.slots, c.ahead, c.mode, error};
    std::vector<float> ms;
    for (int it = 0; it < iters + 2; ++it) {
      kTool.check(cudaEventRecord(e0), "cudaEventRecord");
      pull_kernel<<<c.grid, kThreads, kSmem>>>(a);
      kTool.check(cudaGetLastError(), "launch");
      kTool.check(cudaEventRecord(e1), "cudaEventRecord");
      kTool.check(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float t = 0;
      kTool.check(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
      if (it >= 2) ms.push_back(t);  // the first two warm up
    }
    int failed = 0;
    kTool.check(cudaMemcpy(&failed, error, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy error");
    if (failed) {
      std::fprintf(stderr, "mok_pull_rate: a wait spun past its limit in mode %s: the results are not valid\n", c.name);
      return 1;
    }
    std::sort(ms.begin(), ms.end());
    const double median_ms = ms[ms.size() / 2];
    const double bytes_per_cta = static_cast<double>(rows) * row_bytes;
    const double per_cta = bytes_per_cta / (median_ms * 1e-3) / 1e9;
    std::printf("%-6s %5d %5d %5d %5d %12.1f %12.1f\n", c.name, c.grid, c.pipes, c.slots, c.ahead, per_cta, per_cta * c.grid);
    json += std::string(first ? "" : ", ") + "{\"mode\": \"" + c.name + "\", \"ctas\": " + std::to_string(c.grid) +
            ", \"pipes\": " + std::to_string(c.pipes) + ", \"slots\": " + std::to_string(c.slots) +
            ", \"ahead\": " + std::to_string(c.ahead) + ", \"median_ms\": " + std::to_string(median_ms) +
            ", \"gbps_per_cta\": " + std::to_string(per_cta) + "}";
    first = false;
  }
  json += "]}\n";
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "mok_pull_rate: --out %s: cannot write\n", out.c_str());
      return 1;
    }
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  return 0;
}

// mok_feed_rate: the compute CTAs' mainloop alone (src/cuda/megakernel.cuh), as a grouped
// GEMM with nothing else on the GPU: no pulls, no epilogue, no schedule.
//
// docs/PERFORMANCE.md's leave-one-out table says the megakernel with no tensor work still needs
// 90-94% of its cycles, and that sharing B between two SMs (task pairs, TMA multicast) is the
// only lever left, yet pairs only broke even. This benchmark asks the two questions that
// decide whether that lever can ever pay:
//   - how many bytes per cycle one SM takes in through TMA with the megakernel's stage shape
//     (A 128x64 + B 256x64, 128B swizzle, 48 KB per stage) at 2, 3 and 4 stages, with and
//     without the wgmmas that consume them;
//   - whether a 2-CTA cluster that loads each B half once and multicasts it to both CTAs
//     (a third fewer bytes read from L2 per SM) raises that rate, or only moves the limit;
//   - and, on the way, whether B as one 256-row box (two loads per stage, not three) matters;
//   - whether A can be gathered row by row straight from its source (one TMA load of a
//     64-column, 1-row box per row and k-block, issued by 1, 2 or 4 producer warps, the rows
//     a fixed random permutation of A's) at the rate of one 128-row box: if so, a compute CTA
//     could read a local token's x row where it lies, and the dispatch's copy of it into the
//     ring (a write and a read of every routed row through HBM, and the pulling SMs) could go;
//   - and the same rows gathered instead by the producer warpgroup's 128 threads with 16-byte
//     cp.async copies (8 threads per row, swizzled by hand), each thread's copies arriving on
//     the stage's barrier when they land (cp.async.mbarrier.arrive.noinc), B still by TMA.
// The work is the Qwen3.5 slice's gate/up GEMM shape: `experts` experts of `rows` rows, each
// [rows, K] x [N, K]^T, K = 4096, N = 2048 (gate and up), tasks of one 128x256 tile in the
// megakernel's band order (per expert, per band of row tiles: column by column), CTAs
// taking tasks round robin (a pair: consecutive tasks, the same weight tile).
// Prints, per case, the median of `iters` launches (CUDA events): the GEMM's TFLOP/s (of
// the FLOPs the mma cases do), the bytes landed in each SM's shared memory per SM clock
// (clock64 inside the CTAs) and per microsecond, and the SM clock the CTAs ran at. Every
// case with wgmmas is checked once against the host (inputs are multiples of 1/8 in [-1, 1],
// so every sum is exact in fp32 and any difference is a failure, exit 1).
//
// usage: mok_feed_rate [--experts N] [--rows N] [--band N] [--grid N] [--repeat N] [--iters N] [--case I]
//                      [--out FILE]
// (In the gathered cases, C's row r is A's row perm[r] times its expert's B.)
// (--experts 1 --repeat 8: the same work with A and B resident in L2.)
// (--case I runs only the I-th row of the table, for a sanitizer or a profiler.)
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/sm90.cuh"
#include "cuda/tensor_map.h"
#include "micro_tool.h"

namespace {

using namespace mok::cuda;

constexpr mok::micro::Tool kTool{"mok_feed_rate"};

constexpr int kThreads = 384;  // warpgroup 0: producer; 1-2: consumers (a 64-row half each)
constexpr int kTileN = kDownCols;  // B rows per tile: gate 128 + up 128, as the megakernel's gate/up tiles
constexpr int kK = 4096, kN = 2048;
constexpr int kMaxStages = 4;
constexpr int kStageA = kTileM * kTileK * 2, kStageB = kTileN * kTileK * 2, kStage = kStageA + kStageB;
constexpr int kSmem = 1024 + kMaxStages * kStage + 2 * kMaxStages * 8 + kTileM * 4;
constexpr long long kSpinLimit = 1ll << 31;  // a lost arrival ends the run with an error, not a hang

struct Args {
  CUtensorMap a_map;  // [experts * rows, K], boxes of 64 x 128
  CUtensorMap b_map;  // [experts * N, K], boxes of 64 x 128
  CUtensorMap b_map_whole;  // the same, boxes of 64 x 256 (one load per B tile)
  CUtensorMap a_map_row;    // A, boxes of 64 x 1 (one row per load: the gathered cases)
  const int* perm;          // [experts * rows]: gathered row r is A's row perm[r]
  int row_tiles, band, tasks;  // row tiles per expert; tasks in all (every tile `repeat` times)
  int tiles;                   // distinct tiles: task i computes tile i % tiles
  int stages, mma, pairs;
  int b_whole;                 // 1: B as one 256-row box (3 loads per stage become 2)
  int gather_warps;            // 0: A as one 128-row box; 1, 2, 4: gathered by this many warps
  int cp_async;                // 1: A gathered by the producer warpgroup's cp.async copies
  const __nv_bfloat16* a_ptr;  // A itself, for the cp.async copies
  float* out;                  // [experts * rows, N] or nullptr: accumulators discarded
  long long* cycles;           // [grid] clock64 from the first load to the last release
  int* error;
};

struct TaskTile {
  int a_row, b_row;  // first row of the A tile and of the B tile (in the stacked tensors)
};

// Task i in band order: expert e, band b, column n, row tile t of the band.
__device__ __forceinline__ TaskTile task_tile(const Args& a, int task) {
  const int i = task % a.tiles;
  const int per_expert = a.row_tiles * (kN / kTileN);
  const int e = i / per_expert, j = i % per_expert;
  const int per_band = a.band * (kN / kTileN);
  const int b = j / per_band, k = j % per_band;
  const int n = k / a.band, t = b * a.band + k % a.band;
  return {(e * a.row_tiles + t) * kTileM, e * kN + n * kTileN};
}

// False once any wait of the launch has spun past kSpinLimit: every role then runs out its
// loops without waiting, so that all threads reach the final barriers and the host reports it.
__device__ bool wait(std::uint64_t* bar, std::uint32_t phase, int* error) {
  long long spins = 0;
  while (!sm90::mbar_try_wait(bar, phase)) {
    if (++spins > kSpinLimit) atomicExch(error, 1);
    if ((spins & 1023) == 0 && *static_cast<volatile int*>(error) != 0) return false;
  }
  return true;
}

struct Ring {
  int slot = 0, n;
  std::uint32_t phase = 0;
  __device__ explicit Ring(int size) : n(size) {}
  __device__ void advance() {
    if (++slot == n) {
      slot = 0;
      phase ^= 1;
    }
  }
};

__global__ void __launch_bounds__(kThreads, 1) feed_kernel(const __grid_constant__ Args a) {
  extern __shared__ std::uint8_t smem_raw[];
  std::uint8_t* base = align_shared(smem_raw, 1024);
  auto stage_a = [&](int s) { return base + s * kStage; };
  auto stage_b = [&](int s) { return base + s * kStage + kStageA; };
  auto* full = reinterpret_cast<std::uint64_t*>(base + kMaxStages * kStage);
  std::uint64_t* empty = full + kMaxStages;
  int* tile_rows = reinterpret_cast<int*>(empty + kMaxStages);  // the current task's gathered rows
  const std::uint32_t me = a.pairs ? sm90::cluster_ctarank() : 0, peer = me ^ 1u;
  // B of a stage as two 128-row boxes (gate rows, then up rows), as the megakernel loads it.
  auto load_b_halves = [&](int slot, std::uint64_t* bar, int kb, int b_row) {
    sm90::tma_load_2d(stage_b(slot), &a.b_map, bar, kb * kTileK, b_row);
    sm90::tma_load_2d(stage_b(slot) + kStageB / 2, &a.b_map, bar, kb * kTileK, b_row + 128);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.stages; ++s) {
      // Each issuing warp arrives (TMA gather); with cp.async every producer thread's copies
      // arrive, and thread 0 once more with B's bytes.
      sm90::mbar_init(&full[s], a.cp_async ? 129 : a.gather_warps > 0 ? a.gather_warps : 1);
      sm90::mbar_init(&empty[s], a.pairs ? 4 : 2);  // both warpgroups (of both CTAs of a pair)
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (a.pairs) sm90::cluster_sync();  // the peer's barriers exist before anyone arrives on them
  // Round robin: CTA c takes tasks c, c + grid, ...; a pair takes pairs of consecutive tasks.
  const int units = a.pairs ? a.tasks / 2 : a.tasks;
  const int first = a.pairs ? static_cast<int>(blockIdx.x) / 2 : static_cast<int>(blockIdx.x);
  const int step = a.pairs ? static_cast<int>(gridDim.x) / 2 : static_cast<int>(gridDim.x);
  auto my_task = [&](int unit) { return a.pairs ? 2 * unit + static_cast<int>(me) : unit; };
  const long long start = clock64();
  Ring stage(a.stages);
  if (threadIdx.x < 128 && a.cp_async) {
    // Thread t copies 16-byte chunk t % 8 of rows t / 8, t / 8 + 16, ..., into the place the
    // 128-byte swizzle gives it (chunk c of row r at r * 128 + ((c ^ r % 8) * 16)).
    const int chunk = threadIdx.x % 8, row0 = threadIdx.x / 8;
    for (int u = first; u < units; u += step) {
      const TaskTile tt = task_tile(a, my_task(u));
      const __nv_bfloat16* src[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        src[i] = a.a_ptr + static_cast<long long>(a.perm[tt.a_row + row0 + 16 * i]) * kK + chunk * 8;
      for (int kb = 0; kb < kK / kTileK; ++kb) {
        if (!wait(&empty[stage.slot], stage.phase ^ 1, a.error)) break;
        std::uint64_t* bar = &full[stage.slot];
        if (threadIdx.x == 0) {
          sm90::mbar_arrive_expect_tx(bar, kStageB);
          load_b_halves(stage.slot, bar, kb, tt.b_row);
        }
        const std::uint32_t dst = sm90::smem_addr(stage_a(stage.slot));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = row0 + 16 * i;
          sm90::cp_async_16(dst + r * 128 + ((chunk ^ (r % 8)) * 16), src[i] + kb * kTileK, 16u);
        }
        sm90::cp_async_mbar_arrive_noinc(bar);
        stage.advance();
      }
    }
  } else if (threadIdx.x == 0 && a.gather_warps == 0) {
    for (int u = first; u < units; u += step) {
      const TaskTile tt = task_tile(a, my_task(u));
      for (int kb = 0; kb < kK / kTileK; ++kb) {
        if (!wait(&empty[stage.slot], stage.phase ^ 1, a.error)) break;
        std::uint64_t* bar = &full[stage.slot];
        sm90::mbar_arrive_expect_tx(bar, kStage);
        sm90::tma_load_2d(stage_a(stage.slot), &a.a_map, bar, kb * kTileK, tt.a_row);
        if (a.pairs) {  // this CTA's 128-row half of B, into both CTAs
          sm90::tma_load_2d_multicast(stage_b(stage.slot) + me * (kStageB / 2), &a.b_map, bar, kb * kTileK,
                                      tt.b_row + static_cast<int>(me) * 128, 0x3);
        } else if (a.b_whole) {
          sm90::tma_load_2d(stage_b(stage.slot), &a.b_map_whole, bar, kb * kTileK, tt.b_row);
        } else {
          load_b_halves(stage.slot, bar, kb, tt.b_row);
        }
        stage.advance();
      }
    }
  } else if (threadIdx.x < 128 && static_cast<int>(threadIdx.x) / 32 < a.gather_warps) {
    // Gathered A: warp w loads rows [w * share, (w + 1) * share) of each stage, one 1-row box
    // each, into the row's place in the stage (the 128-byte swizzle follows the shared-memory
    // address, so the rows land as one 128-row box would put them); warp 0 loads B too. Each
    // warp arrives on the stage's full barrier for the bytes it issued.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, share = kTileM / a.gather_warps;
    for (int u = first; u < units; u += step) {
      const TaskTile tt = task_tile(a, my_task(u));
      for (int r = lane; r < share; r += 32) tile_rows[warp * share + r] = a.perm[tt.a_row + warp * share + r];
      __syncwarp();
      if (lane == 0) {
        for (int kb = 0; kb < kK / kTileK; ++kb) {
          if (!wait(&empty[stage.slot], stage.phase ^ 1, a.error)) break;
          std::uint64_t* bar = &full[stage.slot];
          sm90::mbar_arrive_expect_tx(bar, share * kTileK * 2 + (warp == 0 ? kStageB : 0));
          std::uint8_t* a_dst = stage_a(stage.slot) + warp * share * kTileK * 2;
#pragma unroll 8
          for (int r = 0; r < share; ++r)
            sm90::tma_load_2d(a_dst + r * kTileK * 2, &a.a_map_row, bar, kb * kTileK, tile_rows[warp * share + r]);
          if (warp == 0) {
            load_b_halves(stage.slot, bar, kb, tt.b_row);
          }
          stage.advance();
        }
      }
      __syncwarp();  // lane 0 has issued every load that reads tile_rows before it is rewritten
    }
  } else if (threadIdx.x >= 128) {
    const int wg = threadIdx.x / 128 - 1;
    const bool leader = threadIdx.x % 128 == 0;
    auto release = [&](int s) {
      if (!leader) return;
      sm90::mbar_arrive(&empty[s]);
      if (a.pairs) sm90::mbar_arrive_remote(&empty[s], peer);
    };
    float acc[128];
    for (int u = first; u < units; u += step) {
#pragma unroll
      for (int r = 0; r < 128; ++r) acc[r] = 0.0f;
      int prev = -1;
      for (int kb = 0; kb < kK / kTileK; ++kb) {
        if (!wait(&full[stage.slot], stage.phase, a.error)) break;
        if (a.cp_async) sm90::fence_proxy_async_shared();  // cp.async's writes are the generic proxy's; wgmma reads async
        if (a.mma) {
          sm90::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kTileK / 16; ++kk) {
            const std::uint64_t da = sm90::make_smem_desc(stage_a(stage.slot) + wg * 64 * kTileK * 2 + kk * 32);
            const std::uint64_t db = sm90::make_smem_desc(stage_b(stage.slot) + kk * 32);
            sm90::wgmma_m64n256k16(acc, da, db, 1);
          }
          sm90::wgmma_commit();
          if (prev >= 0) {
            sm90::wgmma_wait<1>();
            release(prev);
          }
          prev = stage.slot;
        } else {
          release(stage.slot);
        }
        stage.advance();
      }
      if (prev >= 0) {
        sm90::wgmma_wait<0>();
        release(prev);
      }
      sm90::fence_accumulators(acc);
      if (a.out != nullptr) {  // (a run-time test: the wgmmas must not be dead code)
        const TaskTile tt = task_tile(a, my_task(u));
        const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
        const int row = tt.a_row + wg * 64 + 16 * warp + lane / 4;
        const int col = tt.b_row % kN;
#pragma unroll
        for (int j = 0; j < 32; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            a.out[static_cast<long long>(row + 8 * (c / 2)) * kN + col + 8 * j + 2 * (lane % 4) + c % 2] =
                acc[4 * j + c];
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) a.cycles[blockIdx.x] = clock64() - start;
  if (a.pairs) sm90::cluster_sync();  // no CTA leaves while its peer may multicast into it
}

// Input element i: a multiple of 1/8 in [-1, 1] (exact in bf16; sums of 4096 products of
// them are multiples of 1/64 below 2^12, exact in fp32).
__host__ __device__ inline float input_value(unsigned long long i, unsigned salt) {
  unsigned long long h = (i + salt) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<float>(static_cast<int>(h % 17) - 8) / 8.0f;
}

__global__ void fill_kernel(__nv_bfloat16* p, unsigned long long n, unsigned salt) {
  for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < n; i += gridDim.x * 256ull)
    p[i] = __float2bfloat16(input_value(i, salt));
}

// The megakernel's own descriptor (cuda/tensor_map.h): [outer, kK] bf16, boxes of 64 x box_rows.
CUtensorMap encode(const void* base, unsigned long long outer, unsigned box_rows) {
  CUtensorMap map;
  const TensorMapStatus status = encode_bf16_tiles(&map, base, kK, outer, box_rows);
  if (!status.ok()) {
    std::fprintf(stderr, "mok_feed_rate: %s\n", status.describe().c_str());
    std::exit(1);
  }
  return map;
}

struct Case {
  int stages, mma, pairs, b_whole, gather_warps, cp_async;
};

}  // namespace

int main(int argc, char** argv) {
  int experts = 8, rows = 2560, band = 10, grid = 128, iters = 50, repeat = 1, only = -1;
  std::string out;
  const char* usage =
      "usage: mok_feed_rate [--experts N] [--rows N] [--band N] [--grid N] [--repeat N] [--iters N] [--case I] "
      "[--out FILE]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "mok_feed_rate: %s needs a value\n%s", opt.c_str(), usage);
      return 2;
    }
    const char* v = argv[++i];
    if (opt == "--experts") experts = kTool.parse("--experts", v, 1, 64);
    else if (opt == "--rows") rows = kTool.parse("--rows", v, 256, 1 << 16);
    else if (opt == "--band") band = kTool.parse("--band", v, 2, 512);
    else if (opt == "--grid") grid = kTool.parse("--grid", v, 2, 1024);
    else if (opt == "--repeat") repeat = kTool.parse("--repeat", v, 1, 64);
    else if (opt == "--iters") iters = kTool.parse("--iters", v, 1, 10000);
    else if (opt == "--case") only = kTool.parse("--case", v, 0, 1000);
    else if (opt == "--out") out = v;
    else {
      std::fprintf(stderr, "mok_feed_rate: unknown argument '%s'\n%s", opt.c_str(), usage);
      return 2;
    }
  }
  // A pair's two tasks must be two row tiles of one band and column (the same weight tile).
  if (rows % kTileM != 0 || (rows / kTileM) % band != 0 || band % 2 != 0 || grid % 2 != 0) {
    std::fprintf(stderr,
                 "mok_feed_rate: --rows = %d, --band = %d, --grid = %d: rows must be a multiple of 128 whose row "
                 "tiles split into whole bands, and band and grid must be even (pairs)\n",
                 rows, band, grid);
    return 2;
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "mok_feed_rate: no CUDA device: nothing measured\n");
    return 1;
  }
  cudaDeviceProp prop{};
  kTool.check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const unsigned long long a_elems = 1ull * experts * rows * kK, b_elems = 1ull * experts * kN * kK;
  // The gathered cases' rows: a fixed permutation of A's (Fisher-Yates on a fixed LCG), so a
  // tile's 128 rows lie anywhere in A, as a local token's rows do for its experts.
  std::vector<int> perm(static_cast<std::size_t>(experts) * rows);
  for (std::size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int>(i);
  unsigned long long lcg = 0x2545F4914F6CDD1Dull;
  for (std::size_t i = perm.size() - 1; i > 0; --i) {
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(perm[i], perm[(lcg >> 33) % (i + 1)]);
  }
  int* perm_dev = nullptr;
  __nv_bfloat16 *a_dev = nullptr, *b_dev = nullptr;
  float* out_dev = nullptr;
  long long* cycles_dev = nullptr;
  int* error_dev = nullptr;
  kTool.check(cudaMalloc(&a_dev, a_elems * 2), "cudaMalloc A");
  kTool.check(cudaMalloc(&b_dev, b_elems * 2), "cudaMalloc B");
  kTool.check(cudaMalloc(&out_dev, 1ull * experts * rows * kN * sizeof(float)), "cudaMalloc out");
  kTool.check(cudaMalloc(&cycles_dev, grid * sizeof(long long)), "cudaMalloc cycles");
  kTool.check(cudaMalloc(&error_dev, sizeof(int)), "cudaMalloc error");
  kTool.check(cudaMalloc(&perm_dev, perm.size() * sizeof(int)), "cudaMalloc perm");
  kTool.check(cudaMemcpy(perm_dev, perm.data(), perm.size() * sizeof(int), cudaMemcpyHostToDevice), "cudaMemcpy perm");
  kTool.check(cudaMemset(error_dev, 0, sizeof(int)), "cudaMemset error");
  fill_kernel<<<1024, 256>>>(a_dev, a_elems, 1);
  fill_kernel<<<1024, 256>>>(b_dev, b_elems, 2);
  kTool.check(cudaGetLastError(), "fill");
  kTool.check(cudaFuncSetAttribute(feed_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
              "cudaFuncSetAttribute");

  Args args{};
  args.a_map = encode(a_dev, 1ull * experts * rows, 128);
  args.b_map = encode(b_dev, 1ull * experts * kN, 128);
  args.b_map_whole = encode(b_dev, 1ull * experts * kN, 256);
  args.a_map_row = encode(a_dev, 1ull * experts * rows, 1);
  args.perm = perm_dev;
  args.a_ptr = a_dev;
  args.row_tiles = rows / kTileM;
  args.band = band;
  args.tiles = experts * args.row_tiles * (kN / kTileN);
  args.tasks = args.tiles * repeat;
  args.cycles = cycles_dev;
  args.error = error_dev;
  const double flops = 2.0 * experts * rows * kN * kK * repeat;
  const double bytes_per_task = (kK / kTileK) * static_cast<double>(kStage);  // landed in one CTA's shared memory

  std::vector<Case> cases;
  for (int mma : {0, 1})
    for (int pairs : {0, 1})
      for (int stages : {2, 3, 4}) cases.push_back({stages, mma, pairs, 0, 0, 0});
  for (int mma : {0, 1})
    for (int stages : {3, 4}) cases.push_back({stages, mma, 0, 1, 0, 0});
  for (int mma : {0, 1})
    for (int stages : {3, 4})
      for (int warps : {1, 2, 4}) cases.push_back({stages, mma, 0, 0, warps, 0});
  for (int mma : {0, 1})
    for (int stages : {3, 4}) cases.push_back({stages, mma, 0, 0, 0, 1});
  cudaEvent_t e0, e1;
  kTool.check(cudaEventCreate(&e0), "cudaEventCreate");
  kTool.check(cudaEventCreate(&e1), "cudaEventCreate");
  std::printf("%s, %d SMs; %d experts x %d rows, K = %d, N = %d; %d tasks of 128x256 (each tile %d times) on %d CTAs, "
              "band %d; median of %d\n",
              prop.name, prop.multiProcessorCount, experts, rows, kK, kN, args.tasks, repeat, grid, band, iters);
  std::printf("%-4s %6s %5s %7s %7s %9s %9s %12s %12s %12s %9s %s\n", "mma", "stages", "pairs", "B box", "A rows", "ms", "TFLOP/s",
              "B/clk/SM in", "from L2", "GB/s per SM", "SM MHz", "check");
  std::string json = "{" + mok::micro::json_run_fields(prop) + ", \"experts\": " + std::to_string(experts) +
                     ", \"rows\": " + std::to_string(rows) + ", \"k\": " + std::to_string(kK) +
                     ", \"n\": " + std::to_string(kN) + ", \"grid\": " + std::to_string(grid) +
                     ", \"band\": " + std::to_string(band) + ", \"repeat\": " + std::to_string(repeat) + ", \"cases\": [";
  bool first = true, all_ok = true;
  for (std::size_t ci = 0; ci < cases.size(); ++ci) {
    if (only >= 0 && static_cast<int>(ci) != only) continue;
    const Case& c = cases[ci];
    args.stages = c.stages;
    args.mma = c.mma;
    args.pairs = c.pairs;
    args.b_whole = c.b_whole;
    args.gather_warps = c.gather_warps;
    args.cp_async = c.cp_async;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = kSmem;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 2;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = c.pairs ? 1 : 0;
    auto launch = [&](float* to) {
      args.out = to;
      kTool.check(cudaLaunchKernelEx(&cfg, feed_kernel, args), "launch");
    };
    std::vector<float> ms;
    std::vector<double> mhz;
    std::vector<long long> cycles(grid);
    for (int it = 0; it < iters + 2; ++it) {
      kTool.check(cudaEventRecord(e0), "cudaEventRecord");
      launch(nullptr);
      kTool.check(cudaEventRecord(e1), "cudaEventRecord");
      kTool.check(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float t = 0;
      kTool.check(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
      if (it < 2) continue;  // the first two warm up
      ms.push_back(t);
      kTool.check(cudaMemcpy(cycles.data(), cycles_dev, grid * sizeof(long long), cudaMemcpyDeviceToHost), "cycles");
      mhz.push_back(static_cast<double>(*std::max_element(cycles.begin(), cycles.end())) / (t * 1e3));
    }
    int failed = 0;
    kTool.check(cudaMemcpy(&failed, error_dev, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy error");
    if (failed) {
      std::fprintf(stderr, "mok_feed_rate: a wait spun past its limit (case %zu): the results are not valid\n", ci);
      return 1;
    }
    std::string verdict = "-";
    if (c.mma) {  // one more launch writing C, sampled against the host
      kTool.check(cudaMemset(out_dev, 0xff, 1ull * experts * rows * kN * sizeof(float)), "cudaMemset out");
      launch(out_dev);
      kTool.check(cudaDeviceSynchronize(), "check launch");
      int bad = 0;
      for (int s = 0; s < 512; ++s) {
        const long long r = (1237ll * s + 11) % (1ll * experts * rows), n = (977ll * s + 5) % kN;
        const long long e = r / rows, a_row = c.gather_warps > 0 || c.cp_async ? perm[static_cast<std::size_t>(r)] : r;
        double want = 0;
        for (int k = 0; k < kK; ++k)
          want += static_cast<double>(input_value(static_cast<unsigned long long>(a_row) * kK + k, 1)) *
                  input_value(static_cast<unsigned long long>(e * kN + n) * kK + k, 2);
        float got = 0;
        kTool.check(cudaMemcpy(&got, out_dev + r * kN + n, sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy out");
        if (!(static_cast<double>(got) == want)) {
          if (bad++ < 3) std::fprintf(stderr, "mok_feed_rate: case %zu: C[%lld][%lld] = %g, want %g\n", ci, r, n, got, want);
        }
      }
      verdict = bad == 0 ? "ok" : "FAILED";
      all_ok = all_ok && bad == 0;
    }
    std::vector<float> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    std::sort(mhz.begin(), mhz.end());
    const double median_ms = sorted[sorted.size() / 2], clock_mhz = mhz[mhz.size() / 2];
    const double tasks_per_cta = static_cast<double>(args.tasks) / grid;
    const double bytes_per_cta = tasks_per_cta * bytes_per_task;
    const double per_clk = bytes_per_cta / (median_ms * 1e-3 * clock_mhz * 1e6);
    const double gbps = bytes_per_cta / (median_ms * 1e-3) / 1e9;
    const double tflops = c.mma ? flops / (median_ms * 1e-3) / 1e12 : 0.0;
    // A pair reads each B half from L2 once for both CTAs: two thirds of the landed bytes.
    const double from_l2 = c.pairs ? per_clk * (kStageA + kStageB / 2) / kStage : per_clk;
    const std::string a_rows = c.cp_async ? "cpasync" : c.gather_warps > 0 ? "gw" + std::to_string(c.gather_warps) : "box";
    std::printf("%-4d %6d %5d %7d %7s %9.3f %9.1f %12.1f %12.1f %12.1f %9.0f %s\n", c.mma, c.stages, c.pairs,
                c.b_whole ? 256 : 128, a_rows.c_str(), median_ms, tflops,
                per_clk, from_l2, gbps, clock_mhz, verdict.c_str());
    json += std::string(first ? "" : ", ") + "{\"mma\": " + std::to_string(c.mma) +
            ", \"stages\": " + std::to_string(c.stages) + ", \"pairs\": " + std::to_string(c.pairs) +
            ", \"b_box_rows\": " + std::to_string(c.b_whole ? 256 : 128) +
            ", \"a_gather_warps\": " + std::to_string(c.gather_warps) + ", \"a_cp_async\": " + std::to_string(c.cp_async) +
            ", \"median_ms\": " + std::to_string(median_ms) + ", \"tflops\": " + std::to_string(tflops) +
            ", \"bytes_per_clock_per_sm\": " + std::to_string(per_clk) +
            ", \"l2_bytes_per_clock_per_sm\": " + std::to_string(from_l2) + ", \"sm_mhz\": " + std::to_string(clock_mhz) +
            ", \"check\": \"" + verdict + "\"}";
    first = false;
  }
  json += "]}\n";
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "mok_feed_rate: --out %s: cannot write\n", out.c_str());
      return 1;
    }
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  return all_ok ? 0 : 1;
}

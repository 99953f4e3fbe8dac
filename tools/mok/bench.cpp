// mok bench: times the CUDA forward the way MoK does (warm-up, then timed iterations each
// between two device events; median, min and max), checks it against the CPU reference,
// and writes the same work for the peers (bench/peer_torch.py) into a work directory:
// mok.json plus the .npy files described in bench/README.md.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "mok/cli_args.h"

#if defined(MOK_HAS_CUDA)
#include <cuda_runtime.h>

#include "core/compare.h"
#include "core/device_mirror.h"
#include "core/rng.h"
#include "comm/group_env.h"
#include "io/layer_io.h"
#include "io/npy.h"
#include "numerics/numerics.h"
#include "reference/reference.h"
#endif

#ifndef MOK_GIT_COMMIT
#define MOK_GIT_COMMIT "unknown"
#define MOK_GIT_DIRTY 1
#endif

namespace mok::cli {

#if defined(MOK_HAS_CUDA)
namespace {

#define BENCH_CUDA(expr)                                                                 \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) throw Error(std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

struct Timing {
  double median = 0, min = 0, max = 0;
};

Timing summarize(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

std::string json_timing(const Timing& t) {
  std::ostringstream s;
  s.precision(6);
  s << "{\"median_ms\": " << t.median << ", \"min_ms\": " << t.min << ", \"max_ms\": " << t.max << "}";
  return s.str();
}

std::string json_list(const std::vector<double>& v) {
  std::ostringstream s;
  s.precision(6);
  s << "[";
  for (std::size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

HostTensor tensor_from(DType dtype, std::vector<std::int64_t> shape, const void* data) {
  HostTensor t(dtype, std::move(shape));
  std::memcpy(t.data<void>(), data, t.bytes());
  return t;
}

}  // namespace

int bench_command(const std::vector<std::string>& argv) {
  Args args(argv, {});
  const std::string work_dir = args.take_or("work-dir", "");
  if (work_dir.empty()) throw Error("option --work-dir: needed (where mok.json and the peer inputs go)");
  const int warmup = static_cast<int>(args.take_int("warmup").value_or(500));
  const int iters = static_cast<int>(args.take_int("iters").value_or(100));
  if (warmup < 0 || iters < 1) throw Error("options --warmup >= 0 and --iters >= 1");
  const std::uint64_t seed = static_cast<std::uint64_t>(args.take_int("seed").value_or(1));
  const RoutingSpec routing_spec = RoutingSpec::parse(args.take_or("routing", "gaussian"));
  const std::string ep_mode = args.take_or("ep-mode", "auto");
  if (ep_mode != "all" && ep_mode != "slice" && ep_mode != "distributed" && ep_mode != "auto")
    throw Error("option --ep-mode: must be all, slice or distributed, got '" + ep_mode + "'");
  const int active = static_cast<int>(args.take_int("active-rank").value_or(0));
  Config config;
  if (auto v = args.take_int("comm-sms")) config.forward_comm_sms = static_cast<int>(*v);
  if (auto v = args.take_int("band")) config.task_band_tiles = static_cast<int>(*v);
  if (auto v = args.take_double("capacity")) config.schedule_capacity_factor = *v;
  ProblemArgs pa = parse_problem(args, "qwen3.5-397b-a17b", true);
  args.finish();
  const Problem& p = pa.problem;
  require(cuda_available(), "mok bench: no CUDA GPU is available (the benchmark runs on the GPU only)");
  // distributed: this process is one rank of a real group (start it with mok launch); it
  // times its own forward and writes its own work directory, WORK_DIR/rank<r>.
  const bool distributed = ep_mode == "distributed";
  const bool slice = ep_mode == "slice" || (ep_mode == "auto" && p.ep_size > 1);
  require(slice || distributed || p.ep_size == 1,
          "mok bench: --ep-mode all measures EP = 1 only; use --ep-mode slice or distributed for EP > 1");
  const int R = p.ep_size, T = p.tokens_per_rank, H = p.hidden, k = p.top_k;
  int me = slice ? active : 0, device = 0;
  if (distributed) {
    const auto env = comm::GroupEnvironment::from_environment();
    require(env.world_size == R, "mok bench --ep-mode distributed: --ep " + std::to_string(R) +
                                     " must equal the group's size " + std::to_string(env.world_size) +
                                     " (from " + env.source + ")");
    me = env.rank;
    device = env.local_rank;
  }
  const bool one_rank = slice || distributed;  // weights of rank `me` only

  // ---- data and routing ----
  const Routing routing = generate_routing(p, routing_spec, seed);
  const RoutingBalance balance = routing_balance(p, routing);
  LayerData host = make_layer_data(p, routing, seed, false, one_rank ? me : -1);
  ref::ThreadPool pool(0);
  std::vector<const std::int32_t*> tops;
  for (const auto& r : host.ranks) tops.push_back(r.top_experts.data<std::int32_t>());
  const RankSchedule sched = build_schedule(p, config, tops, me);
  const auto fwd = host.forward_args();

  // ---- reference: this rank's rows, its shared experts, and y over the filled slots ----
  const ref::SlotBuffer rows_ref = ref::routed_rows_rank(p, pool, sched, me, fwd);
  const std::size_t slot_elems = static_cast<std::size_t>(T) * k * H;
  ref::SlotBuffer combine_local(slot_elems);
  // Slots other ranks' experts fill: in a slice a seeded pattern (their weights are not
  // here); in a real group the other ranks write them, and they are read back after the run.
  for (std::size_t i = 0; i < slot_elems; ++i) combine_local[i] = num::bf16_from_float(rng::normal(seed, 77, i));
  std::vector<std::int64_t> row_source, row_slot;
  std::vector<std::int32_t> row_expert;
  std::vector<float> row_weight;
  std::int64_t remote = 0;
  {
    std::int64_t r = 0;
    for (int e = 0; e < p.local_experts(); ++e)
      for (std::int64_t i = 0; i < sched.expert_rows[e]; ++i, ++r) {
        const ScheduleRow row = sched.rows[sched.expert_begin[e] + i];
        row_source.push_back(std::int64_t(row.src_rank) * T + row.slot / k);
        row_slot.push_back(std::int64_t(row.src_rank) * T * k + row.slot);
        row_expert.push_back(e);
        row_weight.push_back(host.ranks[row.src_rank].router_weights.data<float>()[row.slot]);
        if (row.src_rank != me) ++remote;
        if (row.src_rank == me)
          std::copy_n(&rows_ref[r * H], H, &combine_local[std::size_t(row.slot) * H]);
      }
  }
  const std::int64_t N = static_cast<std::int64_t>(row_source.size());
  HostTensor y_ref(DType::bf16, {T, H});
  const auto shared_ref = ref::shared_forward_rank(p, pool, fwd[me]);
  if (!distributed)  // distributed: after the run, over the slots the group really wrote
    ref::combine_epilogue_rank(p, pool, shared_ref, combine_local, host.ranks[me].router_weights.data<float>(),
                               y_ref.data<std::uint16_t>());

  // ---- mok on the GPU ----
  BENCH_CUDA(cudaSetDevice(device));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  LayerOptions o;
  o.backend = Backend::cuda;
  o.ep_mode = distributed ? EpMode::distributed : slice ? EpMode::rank_slice : EpMode::all_ranks;
  o.active_rank = me;
  o.cuda_device = device;
  o.cuda_stream = stream;
  Layer layer(p, config, o);
  DeviceMirror mirror(host, device);
  BENCH_CUDA(cudaMemcpy(layer.combine_slots(me).data, combine_local.data(), slot_elems * 2, cudaMemcpyHostToDevice));
  const auto all_args = mirror.forward_args();
  const std::vector<RankForward> args_dev =
      distributed ? std::vector<RankForward>{all_args[me]} : all_args;
  // Timed like the peers (bench/peer_torch.py): warm-up calls, then every timed call between
  // its own pair of events, all enqueued back to back and read after one synchronisation, so
  // the host's launch latency is not counted as device time.
  for (int i = 0; i < warmup; ++i) layer.forward(args_dev);
  layer.synchronize();
  std::vector<cudaEvent_t> start(iters), stop(iters);
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventCreate(&start[i]));
    BENCH_CUDA(cudaEventCreate(&stop[i]));
  }
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(start[i], stream));
    layer.forward(args_dev);
    BENCH_CUDA(cudaEventRecord(stop[i], stream));
  }
  layer.synchronize();
  std::vector<double> ms;  // in iteration order (a group's record takes the slowest rank per iteration)
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, start[i], stop[i]));
    ms.push_back(t);
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  const std::vector<double> ms_all = ms;
  const Timing fwd_time = summarize(ms);

  // ---- check: rows pushed into the owners' slots, and y ----
  // In a real group only this rank's slots are readable here: the rows it computed for its
  // own tokens are checked against the reference, and y against the reference epilogue over
  // the slots every rank wrote (bitwise equality with virtual ranks: mok run --expect).
  LayerData out = host;
  mirror.copy_outputs_to(out);
  if (distributed) {
    BENCH_CUDA(cudaMemcpy(combine_local.data(), layer.combine_slots(me).data, slot_elems * 2, cudaMemcpyDeviceToHost));
    ref::combine_epilogue_rank(p, pool, shared_ref, combine_local, host.ranks[me].router_weights.data<float>(),
                               y_ref.data<std::uint16_t>());
  }
  std::vector<float> a, b;
  for (std::int64_t r = 0; r < N; ++r) {
    const int src = static_cast<int>(row_slot[r] / (std::int64_t(T) * k));
    const std::int64_t slot = row_slot[r] % (std::int64_t(T) * k);
    if (distributed && src != me) continue;
    std::vector<std::uint16_t> row(H);
    if (distributed)
      std::copy_n(&combine_local[slot * H], H, row.data());
    else
      BENCH_CUDA(cudaMemcpy(row.data(), layer.combine_slots(src).as<std::uint16_t>() + slot * H, H * 2,
                            cudaMemcpyDeviceToHost));
    for (int c = 0; c < H; ++c) {
      a.push_back(num::bf16_to_float(row[c]));
      b.push_back(num::bf16_to_float(rows_ref[r * H + c]));
    }
  }
  const Comparison rows_cmp = compare(a.data(), b.data(), static_cast<std::int64_t>(a.size()));
  const Comparison y_cmp = compare(out.ranks[me].y, y_ref);
  const Tolerance tol = mok_tolerance(p.precision);
  const bool passes = rows_cmp.passes(tol.max_abs, tol.rel) && y_cmp.passes(tol.max_abs, tol.rel);

  // ---- the peers' inputs ----
  // Single GPU: the work of this rank for bench/peer_torch.py. Distributed: each rank's own
  // inputs and weights in WORK_DIR/rank<r> for bench/peer_dist.py (tokens travel there by
  // torch.distributed all-to-all, as users run it).
  namespace fs = std::filesystem;
  const fs::path dir = distributed ? fs::path(work_dir) / ("rank" + std::to_string(me)) : fs::path(work_dir);
  fs::create_directories(dir);
  auto path = [&](const std::string& name) { return (dir / name).string(); };
  const RankData& mine = host.ranks[me];
  if (!distributed) {
    HostTensor x_all(DType::bf16, {std::int64_t(R) * T, H});
    for (int r = 0; r < R; ++r)
      std::memcpy(x_all.data<std::uint16_t>() + std::size_t(r) * T * H, host.ranks[r].x.data<void>(),
                  std::size_t(T) * H * 2);
    npy::save(path("x_all.npy"), x_all);
    npy::save(path("row_source.npy"), tensor_from(DType::i64, {N}, row_source.data()));
    npy::save(path("row_expert.npy"), tensor_from(DType::i32, {N}, row_expert.data()));
    npy::save(path("row_weight.npy"), tensor_from(DType::f32, {N}, row_weight.data()));
    npy::save(path("combine_local.npy"), tensor_from(DType::bf16, {std::int64_t(T) * k, H}, combine_local.data()));
    npy::save(path("rows_ref.npy"), tensor_from(DType::bf16, {N, H}, rows_ref.data()));
    HostTensor dy(DType::bf16, {T, H});
    for (std::int64_t i = 0; i < dy.numel(); ++i)
      dy.data<std::uint16_t>()[i] = num::bf16_from_float(rng::normal(seed, rng::kDy, std::uint64_t(me) * T * H + i));
    npy::save(path("dy_local.npy"), dy);
  } else {
    npy::save(path("top_experts.npy"), mine.top_experts);
  }
  npy::save(path("w_gate.npy"), mine.w_gate);
  npy::save(path("w_up.npy"), mine.w_up);
  npy::save(path("w_down.npy"), mine.w_down);
  for (int s = 0; s < p.num_shared(); ++s) {
    const std::string pre = "shared" + std::to_string(s) + "_";
    npy::save(path(pre + "w_gate.npy"), mine.shared[s].w_gate);
    npy::save(path(pre + "w_up.npy"), mine.shared[s].w_up);
    npy::save(path(pre + "w_down.npy"), mine.shared[s].w_down);
  }
  npy::save(path("x_local.npy"), mine.x);
  npy::save(path("router_weights.npy"), mine.router_weights);
  npy::save(path("y_ref.npy"), y_ref);

  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  const auto stats = layer.last_schedule_stats();
  std::ofstream js(path("mok.json"));
  js.precision(8);
  js << "{\n  \"tool\": \"mok bench\",\n  \"shape\": \"" << (pa.shape_name.empty() ? "custom" : pa.shape_name)
     << "\",\n  \"problem\": " << io::problem_to_json(p) << "  ,\"ep_mode\": \""
     << (distributed ? "distributed" : slice ? "slice" : "all") << "\",\n  \"active_rank\": " << me << ",\n  \"routing\": {\"spec\": \"" << routing_spec.describe()
     << "\", \"max_over_mean_expert\": " << balance.max_over_mean_expert
     << ", \"max_over_mean_rank\": " << balance.max_over_mean_rank << "},\n  \"rows\": {\"real\": " << N
     << ", \"remote\": " << remote << ", \"padded\": " << stats[0].padded_rows << "},\n  \"config\": {\"minibatch_rows\": "
     << layer.config().minibatch_rows << ", \"macrobatch_rows\": " << layer.config().macrobatch_rows
     << ", \"schedule_capacity_factor\": " << layer.config().schedule_capacity_factor
     << ", \"forward_comm_sms\": " << layer.config().forward_comm_sms
     << ", \"task_band_tiles\": " << layer.config().task_band_tiles << ", \"tile_rows\": " << layer.config().tile_rows
     << "},\n  \"gpu\": {\"name\": \"" << prop.name << "\", \"sms\": " << prop.multiProcessorCount
     << ", \"driver\": \"" << driver / 1000 << "." << (driver % 1000) / 10 << "\", \"cuda_runtime\": \""
     << runtime / 1000 << "." << (runtime % 1000) / 10 << "\"},\n  \"timing\": {\"warmup\": " << warmup
     << ", \"iters\": " << iters
     << ", \"method\": \"cuda events around each forward call on one stream, enqueued back to back, read after "
        "one synchronisation\"},\n"
     << "  \"forward\": " << json_timing(fwd_time) << ",\n  \"forward_iters_ms\": " << json_list(ms_all)
     << ",\n  \"backward\": null,\n"
     << "  \"check\": {\"forward\": {\"max_abs\": " << std::max(rows_cmp.max_abs, y_cmp.max_abs)
     << ", \"rel\": " << std::max(rows_cmp.rel, y_cmp.rel) << ", \"rows\": \"" << rows_cmp.describe()
     << "\", \"y\": \"" << y_cmp.describe() << "\", \"passes\": " << (passes ? "true" : "false") << "}},\n"
     << "  \"build\": {\"commit\": \"" << MOK_GIT_COMMIT << "\", \"dirty\": " << (MOK_GIT_DIRTY ? "true" : "false")
     << "}\n}\n";
  js.close();
  std::printf("mok bench: %s %s rows=%lld remote=%lld forward median %.4f ms (min %.4f max %.4f) %.1f TFLOP/s; "
              "check %s rows[%s] y[%s]\n",
              pa.shape_name.c_str(), p.describe().c_str(), static_cast<long long>(N), static_cast<long long>(remote),
              fwd_time.median, fwd_time.min, fwd_time.max, p.mok_forward_flops() / (fwd_time.median * 1e-3) / 1e12,
              passes ? "PASS" : "FAIL", rows_cmp.describe().c_str(), y_cmp.describe().c_str());
  cudaStreamDestroy(stream);
  return passes ? 0 : 3;
}

#else

int bench_command(const std::vector<std::string>&) {
  std::fprintf(stderr, "mok bench: this build has no CUDA backend; the benchmark runs on a CUDA GPU only\n");
  return 2;
}

#endif

}  // namespace mok::cli

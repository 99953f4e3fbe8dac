// mok bench: times the CUDA forward the way MoK does (warm-up, then timed iterations each
// between two device events; median, min and max), checks it against the CPU reference,
// and writes the same work for the peers (bench/peer_torch.py) into a work directory:
// mok.json plus the .npy files described in bench/README.md (mok.json alone with
// --no-peer-inputs).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "mok/cli_args.h"
#include "mok/work_dir.h"

#if defined(MOK_HAS_CUDA)
#include <cuda_runtime.h>

#include "core/backend.h"
#include "core/compare.h"
#include "core/numbers.h"
#include "core/device_mirror.h"
#include "core/device_timer.h"
#include "core/rng.h"
#include "core/tuning_env.h"
#include "comm/group_env.h"
#include "io/layer_io.h"
#include "io/npy.h"
#include "numerics/numerics.h"
#include "reference/reference.h"
#endif

#include "mok_commit.h"  // MOK_GIT_COMMIT, MOK_GIT_DIRTY (generated at build time)

namespace mok::cli {

#if defined(MOK_HAS_CUDA)
namespace {

#define BENCH_CUDA(expr)                                                                 \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) throw Error(std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

// A non-blocking stream, destroyed with its owner (after any Layer declared later).
struct OwnedStream {
  cudaStream_t stream = nullptr;
  OwnedStream() { BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~OwnedStream() { cudaStreamDestroy(stream); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

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

// `text` inside a JSON string: quotes, backslashes and control characters escaped (a
// routing file's path may hold any of them).
std::string json_text(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned char>(c));
      out += esc;
    } else {
      out += c;
    }
  }
  return out;
}

// The megakernel's environment knobs that were set for this run (A/B switches and tuning;
// src/core/tuning_env.h lists them, backend.cu reads them), so a record says how it was made.
std::string tuning_env_json() {
  std::string out;
  for (int knob = 0; knob < static_cast<int>(TuningEnv::kCount); ++knob) {
    const char* name = tuning_env_name(static_cast<TuningEnv>(knob));
    const char* v = std::getenv(name);
    if (v == nullptr) continue;
    std::string value;
    for (const char* c = v; *c; ++c)
      if (*c != '"' && *c != '\\' && static_cast<unsigned char>(*c) >= 0x20) value += *c;
    out += (out.empty() ? "\"" : ", \"") + std::string(name) + "\": \"" + value + "\"";
  }
  return out;
}

// Now on the host's wall clock, in Unix seconds (the clock nvidia-smi stamps its samples with).
double unix_seconds_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// [start, end] of a timed loop read back at `end` (after its closing synchronisation): the
// iterations ran back to back, so it began their summed time earlier (bench/checks.py:
// timed_window, which the peers use). Microsecond digits: the default precision would round
// a Unix time to the hundred seconds.
std::string json_window(const std::vector<double>& ms, double end) {
  double total_ms = 0;
  for (double v : ms) total_ms += v;
  char buf[96];
  std::snprintf(buf, sizeof buf, "[%.6f, %.6f]", end - total_ms / 1e3, end);
  return buf;
}

std::string json_list(const std::vector<double>& v) {
  std::ostringstream s;
  s.precision(6);
  s << "[";
  for (std::size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

// A GPU's UUID as nvidia-smi spells it ("GPU-" and its 16 bytes as 8-4-4-4-12 hex digits): it
// tells two cards of one model apart, where the name cannot.
std::string uuid_text(const cudaUUID_t& id) {
  static constexpr int kGroupBytes[] = {4, 2, 2, 2, 6};
  std::string out = "GPU-";
  int byte = 0;
  for (int group = 0; group < 5; ++group) {
    if (group) out += '-';
    for (int i = 0; i < kGroupBytes[group]; ++i, ++byte) {
      char hex[3];
      std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned>(static_cast<unsigned char>(id.bytes[byte])));
      out += hex;
    }
  }
  return out;
}

HostTensor tensor_from(DType dtype, std::vector<std::int64_t> shape, const void* data) {
  HostTensor t(dtype, std::move(shape));
  std::memcpy(t.data<void>(), data, t.bytes());
  return t;
}

}  // namespace

namespace {

// A file written whole or not at all (readers in other processes never see half of it; a
// failed write leaves no .tmp behind).
void save_atomic(const std::filesystem::path& path, const HostTensor& t) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  std::error_code ec;
  try {
    npy::save(tmp.string(), t);
  } catch (const Error&) {
    std::filesystem::remove(tmp, ec);
    throw;
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw Error("mok bench: cannot move " + tmp.string() + " to " + path.string() + ": " + ec.message());
  }
}

// Waits until every path exists, or throws naming the first one missing after `timeout_s`.
void wait_for_files(const std::vector<std::filesystem::path>& paths, double timeout_s, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (const auto& f : paths)
    for (std::error_code ec; !std::filesystem::exists(f, ec);) {
      if (ec) throw Error("mok bench: cannot look for " + f.string() + " (" + what + "): " + ec.message());
      if (std::chrono::steady_clock::now() > deadline)
        throw PeerWaitError("mok bench: waited " + exact_number(timeout_s) + " s for " + f.string() +
                    " (" + what + "): that rank failed or is stuck");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

}  // namespace

const char* kBenchHelp = R"(usage: mok bench --work-dir DIR [options]
Times the CUDA forward MoK's way (warm-up, then timed calls back to back; the median), checks
it, and writes mok.json plus the PyTorch peer's inputs into DIR (bench/run.py drives it).
  --shape NAME | --experts E --hidden H --intermediate I --topk K [--shared LIST|none]
  --dtype bf16 (mxfp8 is refused: the cuda backend runs bf16 only so far) --swiglu-limit L
  --ep R --tokens T --ep-mode auto|all|slice|distributed (auto: slice when R > 1)
  --active-rank R|busiest --routing SPEC --seed N --warmup N (500) --iters N (100)
  --capacity F --minibatch N --macrobatch N --comm-sms N --band N --pairs
  --exchange-timeout S (distributed: how long a rank waits for the others' files, 900)
  --no-peer-inputs (write mok.json only: a check, or mok's timing alone; no peer can run on
    DIR, and a distributed run skips writing each rank's expert weights, GBs on wide shapes)
)";

int bench_command(const std::vector<std::string>& argv) {
  if (std::find(argv.begin(), argv.end(), "--help") != argv.end()) {
    std::fputs(kBenchHelp, stdout);
    return 0;
  }
#ifdef MOK_MEASUREMENT_BUILD
  throw Error(std::string("mok bench: this is a measurement build (") + MOK_MEASUREMENT_BUILD +
              "); it writes no records (use mok run to time it)");
#endif
  Args args(argv, {"pairs", "no-peer-inputs"});
  const std::string work_dir = args.take_or("work-dir", "");
  if (work_dir.empty()) throw Error("option --work-dir: needed (where mok.json and the peer inputs go)");
  const auto [warmup, iters] = take_repetitions(args, Backend::cuda, 500, 100);
  const std::uint64_t seed = args.take_seed("seed").value_or(1);
  const std::string routing_given = args.take_or("routing", "gaussian");
  const RoutingSpec routing_spec =
      naming_option("routing", routing_given, [&] { return RoutingSpec::parse(routing_given); });
  const std::string ep_mode = args.take_or("ep-mode", "auto");
  if (ep_mode != "all" && ep_mode != "slice" && ep_mode != "distributed" && ep_mode != "auto")
    throw Error("option --ep-mode: must be auto, all, slice or distributed, got '" + ep_mode + "'");
  const auto active_text = args.take("active-rank");
  const auto exchange_timeout = args.take_double("exchange-timeout", {0, 1e7, true, false, "seconds"});
  const bool exchange_timeout_given = exchange_timeout.has_value();
  const double exchange_timeout_s = exchange_timeout.value_or(900);
  Config config;
  if (auto v = args.take_int("comm-sms", 0)) config.forward_comm_sms = static_cast<int>(*v);
  if (auto v = args.take_int("band", 0)) config.task_band_tiles = static_cast<int>(*v);
  if (args.take_flag("pairs")) config.task_pairs = true;
  const bool peer_inputs = !args.take_flag("no-peer-inputs");
  if (auto v = args.take_double("capacity", kCapacityRange)) config.schedule_capacity_factor = *v;
  if (auto v = args.take_int("minibatch", 1)) config.minibatch_rows = static_cast<int>(*v);
  if (auto v = args.take_int("macrobatch", 1)) config.macrobatch_rows = static_cast<int>(*v);
  ProblemArgs pa = parse_problem(args, "qwen3.5-397b-a17b", true);
  args.finish();
  const Problem& p = pa.problem;
  // Options of mok run that mok bench does not have: the config's errors must not point at them.
  static constexpr std::string_view kNotTaken[] = {"--tile-rows", "--threads", "--backend"};
  naming_options([&] { config.validate(); }, kNotTaken);  // (before any work or file: the Layer checks it again)
  require(p.precision == Precision::bf16,
          "option --dtype " + std::string(to_string(p.precision)) +
              ": mok bench times the cuda backend, which runs bf16 only so far (mok run --backend cpu runs mxfp8)");
  require(ep_mode == "distributed" || !exchange_timeout_given,
          "option --exchange-timeout: applies only with --ep-mode distributed (the ranks' exchange of reference "
          "rows)");
  require(cuda_available(), "mok bench: no Hopper (sm_90) CUDA GPU is available (the benchmark runs on the GPU only)");
  // distributed: this process is one rank of a real group (start it with mok launch); it
  // times its own forward and writes its own work directory, WORK_DIR/rank<r>.
  const bool distributed = ep_mode == "distributed";
  const bool slice = ep_mode == "slice" || (ep_mode == "auto" && p.ep_size > 1);
  require(slice || distributed || p.ep_size == 1,
          "mok bench: --ep-mode all measures EP = 1 only; use --ep-mode slice or distributed for EP > 1");
  const int R = p.ep_size, T = p.tokens_per_rank, H = p.hidden, k = p.top_k;
  // (The routing is a pure function of the problem and seed, so it is made here to pick the
  // slice's rank, and every rank of a group makes the same one below.)
  const Routing routing =
      naming_option("routing", routing_given, [&] { return generate_routing(p, routing_spec, seed); });
  int me = resolve_active_rank(active_text, slice, p, routing), device = 0, world = 1;
  if (distributed) {
    const auto env = comm::GroupEnvironment::from_environment();
    require(env.world_size == R, "mok bench --ep-mode distributed: --ep " + std::to_string(R) +
                                     " must equal the group's size " + std::to_string(env.world_size) +
                                     " (from " + env.source + ")");
    me = env.rank;
    device = env.cuda_device(cuda_device_count());
    world = env.world_size;
  }
  const bool one_rank = slice || distributed;  // weights of rank `me` only
  namespace fs = std::filesystem;
  const fs::path dir = distributed ? fs::path(work_dir) / ("rank" + std::to_string(me)) : fs::path(work_dir);
  make_option_directory(dir, "--work-dir");
  // Nothing an earlier run left here may be read as this run's (tools/mok/work_dir.h). This
  // comes before the group forms: a rank reads another's directory only after it.
  // (In a group, rank 0 also clears WORK_DIR itself: peer_dist.py's peer.json goes there.)
  for (const fs::path& d : distributed && me == 0 ? std::vector<fs::path>{dir, work_dir} : std::vector<fs::path>{dir})
    if (const auto cleared = clear_bench_outputs(d); !cleared.empty())
      std::printf("mok bench: removed %zu files an earlier run left in %s\n", cleared.size(), d.string().c_str());
  auto path = [&](const std::string& name) { return (dir / name).string(); };
  auto rank_file = [&](int r, const std::string& name) { return fs::path(work_dir) / ("rank" + std::to_string(r)) / name; };
  const std::string mok_json = bench_file_name(BenchFile::kMokJson), mok_json_tmp = mok_json + ".tmp";

  // ---- data and routing (every rank of a group makes the same, with its own weights) ----
  const RoutingBalance balance = routing_balance(p, routing);
  LayerData host = make_layer_data(p, routing, seed, false, one_rank ? me : -1);
  const auto fwd = host.forward_args();
  const std::size_t slot_elems = static_cast<std::size_t>(T) * k * H;
  // The rank's combine slots before the run: in a slice, the slots other ranks' experts fill
  // hold a seeded pattern (their weights are not here), and y_ref is taken over it.
  ref::SlotBuffer combine_local(slot_elems);
  for (std::size_t i = 0; i < slot_elems; ++i) combine_local[i] = num::bf16_from_float(rng::normal(seed, 77, i));

  // ---- mok on the GPU: the layer (a group forms here, all ranks at about the same time) ----
  BENCH_CUDA(cudaSetDevice(device));
  // Declared before the layer, so destroyed after it: a layer's destructor waits for its
  // stream (a group's for its queued work), and a destroyed stream is no handle to wait on.
  const OwnedStream owned_stream;
  cudaStream_t stream = owned_stream.stream;
  LayerOptions o;
  o.backend = Backend::cuda;
  o.ep_mode = distributed ? EpMode::distributed : slice ? EpMode::rank_slice : EpMode::all_ranks;
  o.active_rank = slice ? me : 0;  // (a group's rank is the process's own, not an option)
  o.cuda_device = device;
  o.cuda_stream = stream;
  Layer layer = naming_options([&] { return Layer(p, config, o); }, kNotTaken);
  DeviceMirror mirror(host, device, distributed ? me : -1);  // (a group's process passes its own rank alone)
  const auto all_args = mirror.forward_args();
  const std::vector<RankForward> args_dev = distributed ? std::vector<RankForward>{all_args[me]} : all_args;

  // ---- reference: this rank's rows (its experts, every source), its shared experts ----
  // A group's ranks compute it after timing (so they meet at the layer's bootstrap together);
  // one GPU needs it first: combine_local (y_ref's slots) takes the own tokens' rows from it.
  ref::ThreadPool pool(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));
  std::vector<const std::int32_t*> tops;
  for (const auto& r : host.ranks) tops.push_back(r.top_experts.data<std::int32_t>());
  const RankSchedule sched = build_schedule(p, config, tops, me);
  std::vector<std::int64_t> row_source;
  std::vector<ScheduleRow> row_at;  // (source rank, slot) of reference row r
  std::vector<std::int32_t> row_expert;
  std::vector<float> row_weight;
  std::int64_t remote = 0;
  for (int e = 0; e < p.local_experts(); ++e)
    for (std::int64_t i = 0; i < sched.expert_rows[e]; ++i) {
      const ScheduleRow row = sched.rows[sched.expert_begin[e] + i];
      row_source.push_back(std::int64_t(row.src_rank) * T + row.slot / k);
      row_at.push_back(row);
      row_expert.push_back(e);
      row_weight.push_back(host.ranks[row.src_rank].router_weights.data<float>()[row.slot]);
      if (row.src_rank != me) ++remote;
    }
  const std::int64_t N = static_cast<std::int64_t>(row_source.size());
  ref::SlotBuffer rows_ref;
  std::vector<ref::SlotBuffer> shared_ref;
  auto compute_reference = [&] {
    rows_ref = ref::routed_rows_rank(p, pool, sched, me, fwd);
    shared_ref = ref::shared_forward_rank(p, pool, fwd[me]);
  };
  if (!distributed) {
    compute_reference();
    for (std::int64_t r = 0; r < N; ++r)
      if (row_at[r].src_rank == me) std::copy_n(&rows_ref[r * H], H, &combine_local[std::size_t(row_at[r].slot) * H]);
  }
  // The slots mok and the peer start from: the rows of this rank's own tokens NaN, so that
  // each side's rows and y are checked on the rows it placed itself (reference rows put there
  // beforehand would pass for a forward that never wrote them); the other ranks' slots hold
  // what they would push. combine_local keeps the reference rows, for y_ref.
  std::vector<std::int64_t> row_slot(static_cast<std::size_t>(N), -1);
  ref::SlotBuffer start_slots = combine_local;
  for (std::int64_t r = 0; r < N; ++r)
    if (row_at[r].src_rank == me) {
      row_slot[r] = row_at[r].slot;
      std::fill_n(&start_slots[std::size_t(row_at[r].slot) * H], H, std::uint16_t{0x7fc0});
    }
  BENCH_CUDA(cudaMemcpy(layer.combine_slots(me).data, start_slots.data(), slot_elems * 2, cudaMemcpyHostToDevice));

  // ---- timing ----
  // Timed like the peers (bench/peer_torch.py), see core/device_timer.h. In a group,
  // synchronising every 50 calls keeps its bounded wait (MOK_WAIT_TIMEOUT_MS) about
  // progress, not the whole queue. `ms` is in iteration order (a group's record takes the
  // slowest rank per iteration).
  // The host's clock right after the latest synchronisation: after device_times_ms, the timed
  // loop's end (read before the events are, which would put it a few hundred microseconds
  // late, and with it every iteration the record pairs with a clock sample).
  double synchronized_unix_s = 0;
  const DeviceTimerCalls forward_calls{[&] { layer.forward(args_dev); },
                                       [&] {
                                         layer.synchronize();
                                         synchronized_unix_s = unix_seconds_now();
                                       },
                                       distributed ? 50 : 0};
  const std::vector<double> ms = device_times_ms(stream, warmup, iters, forward_calls);
  const double timed_end_unix_s = synchronized_unix_s;
  const Timing fwd_time = summarize(ms);

  // ---- where a forward's time goes: a separate pass with events between the phases (they
  // serialise what PDL overlaps), forwards back to back as in the timed run and right behind
  // it, so that they run in the state the timed run left the GPU in. (Run after the check's
  // reads, as before 2026-12-06, the pass followed up to seconds of host copies, one per row,
  // with the GPU idle, and its phases summed to 5-13% less than the timed median in every
  // record of the issue's shapes: a cooler GPU clocks higher under the power cap, the likely
  // cause.) The checked forward below overwrites whatever this pass left. ----
  constexpr int kPhaseIters = 20;
  std::vector<std::string> phase_order;
  std::map<std::string, std::vector<double>> phase_ms;
  {
    BackendImpl& backend = LayerInternals::backend(layer);
    backend.record_phases(kPhaseIters);
    for (int i = 0; i < kPhaseIters; ++i) layer.forward(args_dev);
    layer.synchronize();
    for (const auto& split : backend.phase_times())
      for (const auto& ph : split) {
        if (!phase_ms.count(ph.name)) phase_order.push_back(ph.name);
        phase_ms[ph.name].push_back(ph.ms);
      }
    backend.record_phases(0);
  }
  // As many forwards as the pass, timed the way the timed run times them (PDL on, no events
  // between the phases), right after it: against the pass's sum, what the pass's own way of
  // running costs; against the timed median, how far the GPU's state moved (docs/PERFORMANCE.md).
  const Timing after_phases = summarize(device_times_ms(stream, 0, kPhaseIters, forward_calls));
  std::ostringstream phases;
  phases.precision(8);
  phases << "{\"iters\": " << kPhaseIters
         << ", \"method\": \"cuda events between the forward's phases, forwards back to back, "
            "right after the timed run\", \"timed_after_ms\": "
         << after_phases.median << ", \"median_ms\": {";
  for (std::size_t i = 0; i < phase_order.size(); ++i)
    phases << (i ? ", \"" : "\"") << json_text(phase_order[i]) << "\": " << summarize(phase_ms[phase_order[i]]).median;
  phases << "}}";
  const std::string phases_json = phases.str();

  // ---- the checked forward: queued right behind a forward of other inputs (every x
  // negated, so every pulled row, SwiGLU row, pushed row and y differs), as each timed
  // forward is queued behind the one before. Identical inputs would hide a forward that read a
  // row, a slot or y before it was written: the previous forward's values would be right. ----
  {
    std::vector<void*> negated;  // device copies of -x, one per rank passed
    std::vector<RankForward> other_args = args_dev;
    try {
      for (std::size_t i = 0; i < other_args.size(); ++i) {
        const HostTensor& x = host.ranks[distributed ? me : static_cast<int>(i)].x;
        std::vector<std::uint16_t> minus(x.data<std::uint16_t>(), x.data<std::uint16_t>() + x.numel());
        for (auto& v : minus) v ^= 0x8000u;  // (bf16's sign bit: exact)
        void* d = nullptr;
        BENCH_CUDA(cudaMalloc(&d, x.bytes()));
        negated.push_back(d);
        BENCH_CUDA(cudaMemcpy(d, minus.data(), x.bytes(), cudaMemcpyHostToDevice));
        other_args[i].inputs.x.data = d;
      }
      layer.forward(other_args);
      layer.forward(args_dev);
      layer.synchronize();
    } catch (...) {
      try {
        layer.synchronize();  // (queued work may still read the copies; its error is not the news)
      } catch (...) {
      }
      for (void* d : negated) cudaFree(d);
      throw;
    }
    for (void* d : negated) cudaFree(d);
  }

  // ---- what the check reads, taken now: the checked forward's outputs, not the phase
  // pass's below (its events serialise what PDL overlaps, so a forward wrong only when its
  // kernels overlap would pass there) ----
  const auto stats = layer.last_schedule_stats();
  LayerData out = host;
  mirror.copy_outputs_to(out);
  // One GPU: the rows this rank computed, read where they were pushed (their owners' slots),
  // in reference order. A group: this rank's own slots (every rank's rows for its tokens).
  std::vector<std::uint16_t> rows_got;
  ref::SlotBuffer slots_got;
  if (!distributed) {
    rows_got.resize(static_cast<std::size_t>(N) * H);
    for (std::int64_t r = 0; r < N; ++r) {
      const std::uint16_t* slot = layer.combine_slots(row_at[r].src_rank).as<std::uint16_t>() +
                                  static_cast<std::int64_t>(row_at[r].slot) * H;
      BENCH_CUDA(cudaMemcpy(&rows_got[std::size_t(r) * H], slot, H * 2, cudaMemcpyDeviceToHost));
    }
  } else {
    slots_got.resize(slot_elems);
    BENCH_CUDA(cudaMemcpy(slots_got.data(), layer.combine_slots(me).data, slot_elems * 2, cudaMemcpyDeviceToHost));
  }

  // ---- check: every slot this rank's y reads, and y (as taken after the timed run) ----
  // One GPU: the rows this rank computed, read where they were pushed (their owners' slots),
  // and y over the slots (the slice's other slots: the seeded pattern). A real group: each
  // rank hands the reference rows it computed for other ranks' tokens to their owners
  // through WORK_DIR (rows_for<r>.npy, slots_for<r>.npy), so every rank checks all its slots
  // and y against references none of the GPUs produced.
  HostTensor y_ref(DType::bf16, {T, H});
  ref::SlotBuffer ref_slots;  // a group: the reference rows in this rank's slots (slots_ref.npy)
  std::vector<float> a, b;
  auto add_row = [&](const std::uint16_t* got, const std::uint16_t* want) {
    for (int c = 0; c < H; ++c) {
      a.push_back(num::bf16_to_float(got[c]));
      b.push_back(num::bf16_to_float(want[c]));
    }
  };
  if (!distributed) {
    for (std::int64_t r = 0; r < N; ++r) add_row(&rows_got[std::size_t(r) * H], &rows_ref[r * H]);
    ref::combine_epilogue_rank(p, pool, shared_ref, combine_local, host.ranks[me].router_weights.data<float>(),
                               y_ref.data<std::uint16_t>());
  } else {
    compute_reference();
    // Reference slots of this rank's tokens: its own rows, then the other ranks' files.
    ref_slots.assign(slot_elems, 0);
    std::vector<char> covered(static_cast<std::size_t>(T) * k, 0);
    std::vector<std::vector<std::int64_t>> slots_for(R);
    std::vector<std::vector<std::uint16_t>> rows_for(R);
    for (std::int64_t r = 0; r < N; ++r) {
      const int src = row_at[r].src_rank;
      const std::int64_t slot = row_at[r].slot;
      if (src == me) {
        std::copy_n(&rows_ref[r * H], H, &ref_slots[std::size_t(slot) * H]);
        covered[slot] = 1;
      } else {
        slots_for[src].push_back(slot);
        rows_for[src].insert(rows_for[src].end(), &rows_ref[r * H], &rows_ref[r * H] + H);
      }
    }
    for (int s = 0; s < R; ++s)
      if (s != me) {
        const auto n = static_cast<std::int64_t>(slots_for[s].size());
        save_atomic(rank_file(me, rows_for_file(s)),
                    tensor_from(DType::bf16, {n, H}, rows_for[s].data()));
        save_atomic(rank_file(me, slots_for_file(s)),
                    tensor_from(DType::i64, {n}, slots_for[s].data()));
      }
    std::vector<fs::path> incoming;
    for (int s = 0; s < R; ++s)
      if (s != me) incoming.push_back(rank_file(s, slots_for_file(me)));
    wait_for_files(incoming, exchange_timeout_s, "reference rows for this rank's tokens");
    for (int s = 0; s < R; ++s) {
      if (s == me) continue;
      const HostTensor sl = npy::load(rank_file(s, slots_for_file(me)).string(), DType::i64);
      const std::int64_t n = sl.numel();
      const HostTensor rw =
          npy::load(rank_file(s, rows_for_file(me)).string(), DType::bf16, {n, H});
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t slot = sl.data<std::int64_t>()[i];
        require(slot >= 0 && slot < std::int64_t(T) * k && !covered[slot],
                "mok bench: rank " + std::to_string(s) + " sent a reference row for slot " + std::to_string(slot) +
                    " that is out of range or already covered");
        std::copy_n(rw.data<std::uint16_t>() + i * H, H, &ref_slots[std::size_t(slot) * H]);
        covered[slot] = 1;
      }
    }
    for (std::size_t slot = 0; slot < covered.size(); ++slot)
      require(covered[slot], "mok bench: no rank computed a reference row for slot " + std::to_string(slot));
    for (std::size_t slot = 0; slot < covered.size(); ++slot)
      add_row(&slots_got[slot * H], &ref_slots[slot * H]);
    ref::combine_epilogue_rank(p, pool, shared_ref, ref_slots, host.ranks[me].router_weights.data<float>(),
                               y_ref.data<std::uint16_t>());
  }
  const Comparison rows_cmp = compare(a.data(), b.data(), static_cast<std::int64_t>(a.size()));
  const Comparison y_cmp = compare(out.ranks[me].y, y_ref);
  const Tolerance tol = mok_tolerance(p.precision);
  const bool passes = rows_cmp.passes(tol.max_abs, tol.rel) && y_cmp.passes(tol.max_abs, tol.rel);

  // ---- the peers' inputs ----
  // Single GPU: the work of this rank for bench/peer_torch.py. Distributed: each rank's own
  // inputs and weights in WORK_DIR/rank<r> for bench/peer_dist.py (tokens travel there by
  // torch.distributed all-to-all, as users run it).
  // --no-peer-inputs: none of them (mok.json says so, and the peers refuse such a DIR).
  const RankData& mine = host.ranks[me];
  if (peer_inputs) {
    if (!distributed) {
      HostTensor x_all(DType::bf16, {std::int64_t(R) * T, H});
      for (int r = 0; r < R; ++r)
        std::memcpy(x_all.data<std::uint16_t>() + std::size_t(r) * T * H, host.ranks[r].x.data<void>(),
                    std::size_t(T) * H * 2);
      npy::save(path(bench_file_name(BenchFile::kXAll)), x_all);
      npy::save(path(bench_file_name(BenchFile::kRowSource)), tensor_from(DType::i64, {N}, row_source.data()));
      npy::save(path(bench_file_name(BenchFile::kRowExpert)), tensor_from(DType::i32, {N}, row_expert.data()));
      npy::save(path(bench_file_name(BenchFile::kRowWeight)), tensor_from(DType::f32, {N}, row_weight.data()));
      // The peer writes the rows of this rank's own tokens into their slots itself, as mok does:
      // row_slot names each row's slot (-1: another rank's token), and the file holds the
      // start_slots mok had (those slots NaN), so the peer's y is checked on the rows it computed.
      npy::save(path(bench_file_name(BenchFile::kRowSlot)), tensor_from(DType::i64, {N}, row_slot.data()));
      npy::save(path(bench_file_name(BenchFile::kCombineLocal)),
                tensor_from(DType::bf16, {std::int64_t(T) * k, H}, start_slots.data()));
      npy::save(path(bench_file_name(BenchFile::kRowsRef)), tensor_from(DType::bf16, {N, H}, rows_ref.data()));
      HostTensor dy(DType::bf16, {T, H});
      for (std::int64_t i = 0; i < dy.numel(); ++i)
        dy.data<std::uint16_t>()[i] = num::bf16_from_float(rng::normal(seed, rng::kDy, std::uint64_t(me) * T * H + i));
      npy::save(path(bench_file_name(BenchFile::kDyLocal)), dy);
    } else {
      npy::save(path(bench_file_name(BenchFile::kTopExperts)), mine.top_experts);
      // (peer_dist checks its combine slots, every row of this rank's tokens, against these.)
      npy::save(path(bench_file_name(BenchFile::kSlotsRef)),
                tensor_from(DType::bf16, {std::int64_t(T) * k, H}, ref_slots.data()));
    }
    npy::save(path(bench_file_name(BenchFile::kWGate)), mine.w_gate);
    npy::save(path(bench_file_name(BenchFile::kWUp)), mine.w_up);
    npy::save(path(bench_file_name(BenchFile::kWDown)), mine.w_down);
    for (int s = 0; s < p.num_shared(); ++s) {
      npy::save(path(shared_weight_file(s, BenchFile::kWGate)), mine.shared[s].w_gate);
      npy::save(path(shared_weight_file(s, BenchFile::kWUp)), mine.shared[s].w_up);
      npy::save(path(shared_weight_file(s, BenchFile::kWDown)), mine.shared[s].w_down);
    }
    npy::save(path(bench_file_name(BenchFile::kXLocal)), mine.x);
    npy::save(path(bench_file_name(BenchFile::kRouterWeights)), mine.router_weights);
    npy::save(path(bench_file_name(BenchFile::kYRef)), y_ref);
  }

  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  {
    std::ofstream js(path(mok_json_tmp));
    js.precision(8);
    js << "{\n  \"tool\": \"mok bench\",\n  \"shape\": \"" << (pa.shape_name.empty() ? "custom" : pa.shape_name)
       << "\",\n  \"problem\": " << io::problem_to_json(p) << "  ,\"ep_mode\": \""
       << (distributed ? "distributed" : slice ? "slice" : "all") << "\",\n  \"active_rank\": " << me
       << ",\n  \"peer_inputs\": " << (peer_inputs ? "true" : "false")
       << ",\n  \"routing\": {\"spec\": \"" << json_text(routing_spec.describe())
       << "\", \"max_over_mean_expert\": " << balance.max_over_mean_expert
       << ", \"max_over_mean_rank\": " << balance.max_over_mean_rank << "},\n  \"rows\": {\"real\": " << N
       << ", \"remote\": " << remote << ", \"padded\": " << stats[0].padded_rows
       << "},\n  \"config\": {\"minibatch_rows\": " << layer.config().minibatch_rows
       << ", \"macrobatch_rows\": " << layer.config().macrobatch_rows
       << ", \"schedule_capacity_factor\": " << layer.config().schedule_capacity_factor
       << ", \"forward_comm_sms\": " << layer.config().forward_comm_sms
       << ", \"task_band_tiles\": " << layer.config().task_band_tiles << ", \"tile_rows\": " << layer.config().tile_rows
       << ", \"task_pairs\": " << (layer.config().task_pairs ? "true" : "false") << ", \"env\": {" << tuning_env_json()
       << "}},\n  \"gpu\": {\"name\": \"" << json_text(prop.name) << "\", \"uuid\": \"" << uuid_text(prop.uuid)
       << "\", \"sms\": " << prop.multiProcessorCount
       << ", \"capability\": \"" << prop.major << "." << prop.minor << "\""
       << ", \"driver\": \"" << driver / 1000 << "." << (driver % 1000) / 10 << "\", \"cuda_runtime\": \""
       << runtime / 1000 << "." << (runtime % 1000) / 10 << "\"},\n  \"timing\": {\"warmup\": " << warmup
       << ", \"iters\": " << iters << ", \"window_unix_s\": " << json_window(ms, timed_end_unix_s)
       << ", \"method\": \"cuda events around each forward call on one stream, enqueued back to back, read after "
          "a synchronisation (in a group every 50 calls)\"},\n"
       << "  \"forward\": " << json_timing(fwd_time) << ",\n  \"forward_phases\": " << phases_json
       << ",\n  \"forward_iters_ms\": " << json_list(ms)
       << ",\n  \"backward\": null,\n"
       << "  \"check\": {\"forward\": {\"max_abs\": " << std::max(rows_cmp.max_abs, y_cmp.max_abs)
       << ", \"rel\": " << std::max(rows_cmp.rel, y_cmp.rel) << ", \"rows\": \"" << rows_cmp.describe()
       << "\", \"y\": \"" << y_cmp.describe() << "\", \"passes\": " << (passes ? "true" : "false") << "}},\n"
       << "  \"build\": {\"commit\": \"" << MOK_GIT_COMMIT << "\", \"dirty\": " << (MOK_GIT_DIRTY ? "true" : "false")
       << "}\n}\n";
    js.close();
    // A truncated record must never become mok.json (the Python side would read it as whole).
    if (!js) throw Error("mok bench: writing " + path(mok_json_tmp) + " failed (disk full?)");
  }
  {
    std::error_code ec;
    fs::rename(path(mok_json_tmp), path(mok_json), ec);
    if (ec) {
      const std::string why = ec.message();
      fs::remove(path(mok_json_tmp), ec);
      throw Error("mok bench: cannot put the record in place as " + path(mok_json) + " (" + why +
                  "); the record is not written");
    }
  }
  std::printf("mok bench: %s %s rank %d rows=%lld remote=%lld forward median %.4f ms (min %.4f max %.4f) %.1f TFLOP/s; "
              "check %s rows[%s] y[%s]\n",
              pa.shape_name.c_str(), p.describe().c_str(), me, static_cast<long long>(N),
              static_cast<long long>(remote), fwd_time.median, fwd_time.min, fwd_time.max,
              p.mok_forward_flops() / (fwd_time.median * 1e-3) / 1e12, passes ? "PASS" : "FAIL",
              rows_cmp.describe().c_str(), y_cmp.describe().c_str());
  if (distributed) {
    // Every rank's mok.json exists before any rank exits: mok launch stops the others as soon
    // as one exits non-zero (a failed check), which must not cost their records.
    std::vector<fs::path> records;
    for (int r = 0; r < R; ++r) records.push_back(rank_file(r, mok_json));
    wait_for_files(records, exchange_timeout_s, "every rank's record before exiting");
  }
  return passes ? 0 : 3;
}

#else

int bench_command(const std::vector<std::string>& argv) {
  if (std::find(argv.begin(), argv.end(), "--help") != argv.end()) {
    std::puts("usage: mok bench --work-dir DIR [options]\nTimes the CUDA forward; this build has no CUDA "
              "backend (configure with nvcc available to get it).");
    return 0;
  }
  std::fprintf(stderr, "mok bench: this build has no CUDA backend; the benchmark runs on a CUDA GPU only\n");
  return 2;
}

#endif

}  // namespace mok::cli

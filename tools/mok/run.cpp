// mok run: runs the layer on a shape, optionally checks it against the CPU reference,
// saves/loads every tensor as .npy, and prints a short table.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "comm/group_env.h"
#include "core/backend.h"
#include "core/compare.h"
#include "core/device_mirror.h"
#include "core/device_timer.h"
#include "io/layer_io.h"
#include "io/npy.h"
#include "mok/cli_args.h"
#include "mok/work_dir.h"

namespace mok::cli {
namespace {

const char* kRunHelp = R"(usage: mok run [options]
Runs the MoE layer and prints a short table.

problem (a named shape, or explicit sizes):
  --shape NAME            a named shape (mok shapes lists them; default: qwen3.5-397b-a17b
                          on the cuda backend, small on the cpu)
  --experts E --hidden H --intermediate I --topk K
  --shared LIST|none      shared expert widths, e.g. 1024 or 1024,512
  --ep R                  EP size (default: the shape's; 1 with explicit sizes)
  --tokens T              tokens per rank (default: the shape's; 256 with explicit sizes)
  --dtype bf16|mxfp8      numerics (default bf16)
  --swiglu-limit L        clamped SwiGLU
routing and data:
  --routing SPEC          gaussian | zipf[:s] | hot[:fraction[:expert]] | worst[:rank] | file:DIR
  --seed N                data and routing seed (default 1)
  --load DIR              read problem.json and every input, routing included, from DIR (see
                          --save; the shape, routing and seed options are refused with it)
  --save DIR              write inputs, outputs and gradients as .npy, then problem.json (last:
                          a save cut short leaves none, and --load refuses it)
                          (distributed: each process writes its rank's y; not with a slice,
                          which holds one rank's weights, so --load could not read its save)
  --expect DIR            require every computed rank's y to equal DIR/rank<r>/y.npy bit for bit
                          (not with a slice; a DIR whose problem.json is another problem, or
                          with ranks beyond this run's, is refused)
execution:
  --backend cpu|cuda      default: cuda when a GPU is present, else cpu
  --ep-mode auto|all|slice|distributed
                          all ranks here, one rank's slice (cuda; the default there for EP > 8),
                          or this process's rank of a real group (cuda; start with mok launch);
                          auto (the default): slice on cuda for EP > 8, else all
  --active-rank R|busiest the rank a slice runs (default busiest: the rank with the most rows)
  --pass forward|backward|both   default: both on cpu, forward on cuda (its only pass yet)
  --check                 compare with the CPU reference (MoK's tolerances)
  --iters N --warmup N    timed repetitions (default 1 and 0 on cpu, 20 and 5 on cuda; at most
                          10000 each on cpu, whose passes take up to seconds, 1000000 on cuda)
  --threads N             CPU threads (default: all cores; on cuda, for --check's reference only)
  --capacity F --minibatch N --macrobatch N --comm-sms N --tile-rows N --band N   config
  --pairs                 compute SMs in 2-CTA clusters sharing weight tiles (experimental)
)";

// The --save directories a run created, removed again when it ends before its save (a refused
// or failed run leaves no empty directory behind): deepest first, each only while empty
// (std::filesystem::remove leaves a directory that holds anything).
class CreatedDirectories {
 public:
  CreatedDirectories() = default;
  CreatedDirectories(const CreatedDirectories&) = delete;
  CreatedDirectories& operator=(const CreatedDirectories&) = delete;
  ~CreatedDirectories() {
    for (const auto& d : created_) {
      std::error_code ignored;
      std::filesystem::remove(d, ignored);
    }
  }
  // Creates `dir` and its missing parents (make_option_directory), noting which were missing
  // (noted first: a creation that fails part way leaves its upper ones, removed too), or only
  // `dir` itself with `parents_shared` (a group's ranks share the parent: one rank's removal
  // could race another's creation of its own directory there).
  void create(const std::filesystem::path& dir, const std::string& option, bool parents_shared) {
    std::error_code ec;
    for (std::filesystem::path d = std::filesystem::absolute(dir, ec); !ec && !d.empty() && d != d.root_path();
         d = d.parent_path()) {
      // (symlink_status: a link is there even when its target is not; exists() follows it,
      // and a dangling link counted as missing would be removed as this run's own. Missing
      // only when not found: any other answer, an error say, is left alone.)
      std::error_code status_ec;
      if (std::filesystem::symlink_status(d, status_ec).type() != std::filesystem::file_type::not_found) break;
      created_.push_back(d);  // (deepest first)
      if (parents_shared) break;
    }
    make_option_directory(dir, option);
  }
  void keep() { created_.clear(); }

 private:
  std::vector<std::filesystem::path> created_;
};

// The --save directory's claim: a file made with O_EXCL when the run claims the directory and
// removed once its save is written (or the run fails), so that two runs started on one empty
// directory cannot both save there: the second is refused at its claim. It holds the claiming
// process's pid and host: a run killed outright (a signal: `mok launch` stops a failed group's
// other ranks so) leaves the file, and a later claim on the same host whose process is gone
// takes it over instead of refusing the directory for good.
class SaveClaim {
 public:
  static constexpr const char* kFileName = ".mok_save_claim";
  SaveClaim() = default;
  SaveClaim(const SaveClaim&) = delete;
  SaveClaim& operator=(const SaveClaim&) = delete;
  ~SaveClaim() { release(); }
  // (A stale claim is judged before, with the directory's other checks: remove_if_stale.)
  void claim(const std::filesystem::path& dir) {
    const std::filesystem::path file = dir / kFileName;
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
      const int err = errno;
      if (err == EEXIST) throw held_elsewhere(dir);
      throw Error("option --save " + dir.string() + ": cannot write there: " + std::strerror(err));
    }
    file_ = file;
    const std::string owner = std::to_string(getpid()) + " " + host_name() + "\n";
    const bool written = ::write(fd, owner.data(), owner.size()) == static_cast<ssize_t>(owner.size());
    const int err = errno;
    ::close(fd);
    if (!written) throw Error("option --save " + dir.string() + ": cannot write there: " + std::strerror(err));
  }
  // Removes `dir`'s claim when the process that made it is gone (same host, no such pid);
  // whether it did. A claim it cannot read or judge (another host, a pid alive) is left.
  static bool remove_if_stale(const std::filesystem::path& dir) {
    const std::filesystem::path file = dir / kFileName;
    std::FILE* f = std::fopen(file.c_str(), "r");
    if (f == nullptr) return false;
    long pid = 0;
    char host[256] = {};
    const int read = std::fscanf(f, "%ld %255s", &pid, host);
    std::fclose(f);
    if (read != 2 || pid <= 0 || host != host_name()) return false;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) return false;
    std::error_code ec;
    std::filesystem::remove(file, ec);
    return !ec;
  }
  // The error for a directory another run has claimed.
  static Error held_elsewhere(const std::filesystem::path& dir) {
    return Error("option --save " + dir.string() + ": another mok run is saving there (its claim " +
                 (dir / kFileName).string() + " is there; remove it if that run was killed on another host)");
  }
  void release() {
    if (file_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove(file_, ignored);
    file_.clear();
  }

 private:
  static std::string host_name() {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
    return name;
  }
  std::filesystem::path file_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Row {
  std::string pass;
  double ms = 0;
  double tflops = 0;
  std::string check = "-";
};

}  // namespace

int run_command(const std::vector<std::string>& argv) {
  if (std::find(argv.begin(), argv.end(), "--help") != argv.end()) {
    std::fputs(kRunHelp, stdout);
    return 0;
  }
  Args args(argv, {"check", "pairs"});
  const bool gpu = cuda_available();
  const auto load_dir = args.take("load");
  const auto save_dir = args.take("save");
  const auto expect_dir = args.take("expect");
  // A loaded run takes its problem, data and routing from DIR: options that would make them
  // are refused rather than ignored (the output would print them as if they had been used).
  if (load_dir)
    for (const char* n : {"shape", "experts", "hidden", "intermediate", "topk", "shared", "ep", "tokens", "dtype",
                          "swiglu-limit", "seed", "routing"})
      if (args.has(n))
        throw Error(std::string("option --") + n + ": --load takes the problem, data and routing from DIR");
  const std::uint64_t seed = args.take_seed("seed").value_or(1);
  const std::string routing_given = args.take_or("routing", "gaussian");
  const RoutingSpec routing_spec =
      naming_option("routing", routing_given, [&] { return RoutingSpec::parse(routing_given); });

  LayerOptions options;
  if (!gpu && !args.has("backend"))
    std::printf("mok run: no usable CUDA GPU here: the CPU reference backend runs (on a Hopper GPU the CUDA "
                "backend does)\n");
  const std::string backend = args.take_or("backend", gpu ? "cuda" : "cpu");
  options.backend = naming_option("backend", backend, [&] { return backend_from_string(backend); });
  // With no --ep-mode, a large EP group on the GPU runs as one rank's slice.
  const std::string ep_mode = args.take_or("ep-mode", "auto");
  if (ep_mode != "all" && ep_mode != "slice" && ep_mode != "distributed" && ep_mode != "auto")
    throw Error("option --ep-mode: must be auto, all, slice or distributed, got '" + ep_mode + "'");
  options.ep_mode = ep_mode == "slice"         ? EpMode::rank_slice
                    : ep_mode == "distributed" ? EpMode::distributed
                                               : EpMode::all_ranks;
  // Distributed: this process is one rank of the group its launcher started.
  int my_rank = -1, group_size = 0;
  // (The cpu backend refuses a group: LayerOptions::validate below says so, before the
  // environment's complaint that this process is not in one would send the user to mok launch.)
  if (options.ep_mode == EpMode::distributed && options.backend == Backend::cuda) {
    const auto env = comm::GroupEnvironment::from_environment();
    my_rank = env.rank;
    group_size = env.world_size;
    // The group's device for this process (the data goes there too).
    options.cuda_device = env.cuda_device(cuda_device_count());
  }
  const auto active_rank_text = args.take("active-rank");
  // On the cuda backend only --check's CPU reference reads --threads: without it, refused
  // rather than accepted and ignored (before the options' own rules, which need a GPU there).
  if (args.has("threads") && options.backend == Backend::cuda && !args.has("check"))
    throw Error("option --threads: sizes the CPU reference's thread pool, which --backend cuda runs only with "
                "--check");
  options.cpu_threads = static_cast<int>(args.take_int("threads", 0).value_or(0));
  // (Before any work or file: the Layer checks them again, with the active rank's bound.)
  naming_options([&] { options.validate(); });
  const bool on_cuda = options.backend == Backend::cuda;
  const std::string pass = args.take_or("pass", on_cuda ? "forward" : "both");
  if (pass != "forward" && pass != "backward" && pass != "both")
    throw Error("option --pass: must be forward, backward or both, got '" + pass + "'");
  const bool do_fwd = pass != "backward", do_bwd = pass != "forward";
  // Refused before any work (the backend would throw only after the forward had run).
  if (on_cuda && do_bwd)
    throw Error("option --pass " + pass +
                ": the cuda backend runs the forward only (no CUDA backward yet): use --pass forward, or "
                "--backend cpu for the backward");
  if (expect_dir && !do_fwd) throw Error("option --expect: compares y, which --pass backward does not compute");
  const bool check = args.take_flag("check");
  const auto [warmup, iters] = take_repetitions(args, options.backend, on_cuda ? 5 : 0, on_cuda ? 20 : 1);

  const char* cuda_only_tuning = nullptr;  // (--capacity and --tile-rows shape the CPU's schedule too)
  if (!on_cuda)
    for (const char* n : {"minibatch", "macrobatch", "comm-sms", "band", "pairs"})
      if (!cuda_only_tuning && args.has(n)) cuda_only_tuning = n;
  Config config;
  if (auto v = args.take_double("capacity", kCapacityRange)) config.schedule_capacity_factor = *v;
  if (auto v = args.take_int("minibatch", 1)) config.minibatch_rows = static_cast<int>(*v);
  if (auto v = args.take_int("macrobatch", 1)) config.macrobatch_rows = static_cast<int>(*v);
  if (auto v = args.take_int("comm-sms", 0)) config.forward_comm_sms = config.backward_comm_sms = static_cast<int>(*v);
  if (auto v = args.take_int("tile-rows", 1)) config.tile_rows = static_cast<int>(*v);
  if (auto v = args.take_int("band", 0)) config.task_band_tiles = static_cast<int>(*v);
  if (args.take_flag("pairs")) config.task_pairs = true;
  naming_options([&] { config.validate(); });  // (before any work or file: the Layer checks it again)
  // Tuning that only the cuda backend reads is refused on the cpu backend rather than printed
  // as if it had been used (after the config's own rules, which name a bad value first).
  if (cuda_only_tuning)
    throw Error(std::string("option --") + cuda_only_tuning + ": tunes the cuda backend; the cpu backend does not read it");

  // A save inside the directory a run loads from would change that save (a rank<r>/ or
  // stray files there make it another problem's, or unloadable).
  if (load_dir && save_dir) {
    std::error_code ec1, ec2;
    const auto from = std::filesystem::weakly_canonical(*load_dir, ec1);
    const auto to = std::filesystem::weakly_canonical(*save_dir, ec2);
    if (!ec1 && !ec2) {
      const auto rel = to.lexically_relative(from);
      if (!rel.empty() && *rel.begin() != "..")
        throw Error("option --save " + *save_dir + ": is inside --load's directory " + *load_dir +
                    ", whose files a save there would change: save somewhere else");
    }
  }
  // The save directory is claimed before any work: a run never mixes its tensors with an
  // earlier run's files, and an unwritable path is found before the results exist.
  // (A group's rank saves its own y in rank<r>/.)
  const std::filesystem::path save_target =
      !save_dir ? std::filesystem::path()
      : my_rank >= 0 ? std::filesystem::path(*save_dir) / ("rank" + std::to_string(my_rank))
                     : std::filesystem::path(*save_dir);
  CreatedDirectories created_for_save;
  SaveClaim save_claim;  // (after created_for_save: gone before a directory it leaves is removed)
  auto claim_save_dir = [&] {
    if (!save_dir) return;
    std::error_code ec;
    if (std::filesystem::is_directory(save_target, ec)) {
      if (std::filesystem::exists(std::filesystem::symlink_status(save_target / SaveClaim::kFileName, ec)) &&
          !SaveClaim::remove_if_stale(save_target))
        throw SaveClaim::held_elsewhere(save_target);
      const bool empty = std::filesystem::is_empty(save_target, ec);
      if (ec)
        throw Error("option --save " + save_target.string() + ": cannot read the directory: " + ec.message());
      if (!empty)
        throw Error("option --save " + save_target.string() +
                    ": already holds files (an earlier run's?); mok does not mix two runs' tensors: give a new or "
                    "empty directory");
    }
    created_for_save.create(save_target, "--save", my_rank >= 0);
    // Held until the save is written; a directory this process may not write to is found now,
    // not after the run.
    save_claim.claim(save_target);
    // Empty still, but for the claim: another run may have saved there between the check above
    // and the claim.
    std::size_t others = 0;
    for (std::filesystem::directory_iterator it(save_target, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().filename() != SaveClaim::kFileName) ++others;
    if (ec || others != 0)
      throw Error("option --save " + save_target.string() +
                  ": another run wrote there while this one claimed it; give a new or empty directory");
  };

  // The options that depend on the EP mode, checked once it is settled and before any work
  // or any file is written. A slice computes one rank's y from combine slots the other ranks
  // would fill (not filled by mok run), so its y is not the layer's: nothing to compare.
  // The --expect files, read (and checked: shape, dtype, size) before any work.
  std::vector<HostTensor> expected_y;
  auto check_mode_options = [&](const Problem& problem) {
    const int ep_size = problem.ep_size;
    const char* mode = options.ep_mode == EpMode::rank_slice ? "slice" : "distributed";
    // (The EP mode named as the user gave it, or as the default chose it.)
    const std::string by_default =
        ep_mode == "auto" && options.ep_mode == EpMode::rank_slice ? " (the default on the GPU for EP > 8)" : "";
    if (check && on_cuda && options.ep_mode != EpMode::all_ranks)
      throw Error(std::string("option --check with --ep-mode ") + mode + by_default +
                  ": the comparison needs every rank's y here (--ep-mode all); the GPU test suite (tests/gpu) "
                  "checks a slice's rows");
    if (save_dir && options.ep_mode == EpMode::rank_slice)
      throw Error(std::string("option --save with --ep-mode slice") + by_default +
                  ": a slice makes only its active rank's weights and its y is not the layer's, so the save "
                  "could not be loaded (--load needs every rank's weights): save with --ep-mode all");
    if (expect_dir && options.ep_mode == EpMode::rank_slice)
      throw Error("option --expect with --ep-mode slice" + by_default + ": a slice's y depends on combine slots mok run does not "
                  "fill, so it is not the layer's y (use --ep-mode all or distributed)");
    if (expect_dir) {
      // (Loaded before the run's own memory check, which then sees them as used.)
      const std::uint64_t expect_bytes = static_cast<std::uint64_t>(my_rank >= 0 ? 1 : ep_size) *
                                         static_cast<std::uint64_t>(problem.tokens_per_rank) *
                                         static_cast<std::uint64_t>(problem.hidden) * 2;
      require_host_memory(expect_bytes, "option --expect " + *expect_dir + " (every computed rank's y)");
      // A directory from another problem is refused, not compared in part: its problem.json,
      // when there, must be this run's, and it holds no rank beyond this run's.
      io::require_directory(*expect_dir, "option --expect " + *expect_dir);
      const auto theirs = io::read_problem_json(*expect_dir, "option --expect " + *expect_dir);
      if (theirs && theirs->describe() != problem.describe())
        throw Error("option --expect " + *expect_dir + ": its problem.json is " + theirs->describe() +
                    ", this run's is " + problem.describe());
      std::error_code ec;  // (an unreadable entry is refused as one, not as an internal error)
      const std::string beyond = *expect_dir + "/rank" + std::to_string(ep_size);
      const bool beyond_exists = std::filesystem::exists(beyond, ec);
      if (ec) throw Error("option --expect " + *expect_dir + ": cannot look at " + beyond + ": " + ec.message());
      if (beyond_exists)
        throw Error("option --expect " + *expect_dir + ": holds rank" + std::to_string(ep_size) +
                    "/, beyond this run's " + std::to_string(ep_size) + " ranks (a save of another EP size?)");
      expected_y.assign(ep_size, HostTensor{});
      for (int r = 0; r < ep_size; ++r) {
        if (my_rank >= 0 && r != my_rank) continue;
        const std::string f = *expect_dir + "/rank" + std::to_string(r) + "/y.npy";
        if (!npy::regular_file_at(f, "option --expect " + *expect_dir))
          throw Error("option --expect " + *expect_dir + ": no file " + f);
        try {
          expected_y[r] = npy::load_exact(f, DType::bf16, {problem.tokens_per_rank, problem.hidden});
        } catch (const Error& e) {
          throw Error("option --expect " + *expect_dir + ": " + e.what());
        }
      }
    }
  };

  LayerData data;
  std::string shape_name;
  if (load_dir) {
    args.finish();
    // The CPU reference (the backend, or --check's comparison) holds its slots and work too:
    // counted with the files' data before any is read.
    const bool reference_runs = !on_cuda || check;
    data = io::load_layer_data(*load_dir, do_bwd, [&](const Problem& lp) {
      return reference_runs ? reference_host_bytes(lp, do_bwd) : 0;
    });
    if (ep_mode == "auto" && on_cuda && data.problem.ep_size > 8) options.ep_mode = EpMode::rank_slice;
    check_mode_options(data.problem);
    claim_save_dir();
    // The loaded ids pick the slice's rank (load_layer_data has validated them).
    Routing loaded;
    for (const auto& r : data.ranks) {
      const auto* ids = r.top_experts.data<std::int32_t>();
      loaded.top_experts.emplace_back(ids, ids + r.top_experts.numel());
    }
    options.active_rank =
        resolve_active_rank(active_rank_text, options.ep_mode == EpMode::rank_slice, data.problem, loaded);
    shape_name = "loaded:" + *load_dir;
  } else {
    ProblemArgs pa = parse_problem(args, gpu && on_cuda ? "qwen3.5-397b-a17b" : "small", gpu);
    args.finish();
    if (group_size > 0 && group_size != pa.problem.ep_size)
      throw Error("--ep-mode distributed: the group has " + std::to_string(group_size) + " processes but --ep is " +
                  std::to_string(pa.problem.ep_size) + " (one process per rank: mok launch -n " +
                  std::to_string(pa.problem.ep_size) + ")");
    if (ep_mode == "auto" && on_cuda && pa.problem.ep_size > 8) options.ep_mode = EpMode::rank_slice;
    check_mode_options(pa.problem);
    claim_save_dir();
    shape_name = pa.shape_name.empty() ? "custom" : pa.shape_name;
    // Checked before the routing is drawn: it alone is R*T*k ids and weights.
    // The CPU reference (the backend, or --check's comparison) holds its slots and work too.
    const bool reference_runs = !on_cuda || check;
    const std::uint64_t bytes =
        layer_data_host_bytes(pa.problem, do_bwd, options.ep_mode == EpMode::rank_slice ? 0 : my_rank) +
        (reference_runs ? reference_host_bytes(pa.problem, do_bwd) : 0);
    require_host_memory(bytes, "this run (" + pa.problem.describe() + ")");
    // (Its errors are the spec's, judged with the problem: a hot expert beyond it, a file:DIR.)
    const Routing routing =
        naming_option("routing", routing_given, [&] { return generate_routing(pa.problem, routing_spec, seed); });
    options.active_rank =
        resolve_active_rank(active_rank_text, options.ep_mode == EpMode::rank_slice, pa.problem, routing);
    const int weights_rank = options.ep_mode == EpMode::rank_slice ? options.active_rank : my_rank;
    data = make_layer_data(pa.problem, routing, seed, do_bwd, weights_rank);
  }
  const Problem& p = data.problem;

  // A loaded problem's fields come from --load's problem.json, not from options (which --load
  // refuses): an error about them says so instead of naming those options.
  static constexpr std::string_view kProblemOptions[] = {
      "--experts or --shape", "--hidden or --shape", "--intermediate or --shape", "--topk or --shape", "--ep",
      "--tokens", "--shared", "--swiglu-limit", "--dtype"};
  Layer layer = [&] {
    try {
      return naming_options([&] { return Layer(p, config, options); },
                            load_dir ? std::span<const std::string_view>(kProblemOptions)
                                     : std::span<const std::string_view>());
    } catch (const PeerWaitError&) {
      throw;
    } catch (const Error& e) {
      const std::string what = e.what();
      if (!load_dir || (what.find("Problem.") == std::string::npos && what.find("problem:") == std::string::npos))
        throw;
      throw Error(what + " (the problem is the one --load's " + *load_dir + "/problem.json holds)");
    }
  }();
  // TFLOP/s counts the work of every rank this run computes (MoK's per-rank formula).
  const double ranks_computed = options.ep_mode == EpMode::all_ranks ? p.ep_size : 1;
  // The ranks' arguments this process passes: all of them, or its own (distributed).
  auto mine = [&](const auto& all) {
    using Arg = typename std::decay_t<decltype(all)>::value_type;
    return my_rank >= 0 ? std::vector<Arg>{all[my_rank]} : all;
  };
  std::vector<Row> rows;
  std::unique_ptr<DeviceMirror> mirror;
  // (A group's process copies its own rank alone: `mine` passes no other.)
  if (on_cuda) mirror = std::make_unique<DeviceMirror>(data, options.cuda_device, my_rank);

  // On the GPU: device time, calls enqueued back to back between events (as `mok bench` and
  // the peers time them: core/device_timer.h). On the CPU: the wall time of each call.
  auto timed = [&](auto&& fn) {
    if (on_cuda)
      return median(device_times_ms(options.cuda_stream, warmup, iters,
                                    {fn, [&] { layer.synchronize(); },
                                     options.ep_mode == EpMode::distributed ? 50 : 0}));
    std::vector<double> ms;
    for (int i = 0; i < warmup + iters; ++i) {  // (take_repetitions bounds the sum)
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      layer.synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    return median(ms);
  };

  // (Errors from the calls, a schedule over its capacity say, name the options that set the
  // fields they name: naming_options.)
  if (do_fwd) {
    Row r{"forward"};
    if (on_cuda) {
      const auto fa = mine(mirror->forward_args());
      r.ms = naming_options([&] { return timed([&] { layer.forward(fa); }); });
    } else {
      const auto fa = data.forward_args();
      r.ms = naming_options([&] { return timed([&] { layer.forward(fa); }); });
    }
    r.tflops = ranks_computed * p.mok_forward_flops() / (r.ms * 1e-3) / 1e12;
    rows.push_back(r);
  }
  if (do_bwd) {
    Row r{"backward"};
    if (on_cuda) {
      const auto ba = mine(mirror->backward_args());
      r.ms = naming_options([&] { return timed([&] { layer.backward(ba); }); });
    } else {
      const auto ba = data.backward_args();
      r.ms = naming_options([&] { return timed([&] { layer.backward(ba); }); });
    }
    r.tflops = ranks_computed * 2 * p.mok_forward_flops() / (r.ms * 1e-3) / 1e12;
    rows.push_back(r);
  }
  if (mirror) mirror->copy_outputs_to(data);

  if (check) {
    if (!on_cuda) {
      for (auto& r : rows) r.check = "reference itself";
    } else {  // (on the GPU only with --ep-mode all: check_mode_options)
      LayerData ref = data;
      ref.poison_outputs();
      LayerOptions ro;
      ro.cpu_threads = options.cpu_threads;
      Layer reference(p, config, ro);
      const Tolerance tol = mok_tolerance(p.precision);
      // (The forward is the cuda backend's only pass: --pass backward is refused there, above.
      // Its check, when it comes, must compare every gradient, not dx alone.)
      for (auto& r : rows) {
        bool ok = true;
        std::string worst;
        reference.forward(ref.forward_args());
        for (int k = 0; k < p.ep_size; ++k) {
          const Comparison c = compare(data.ranks[k].y, ref.ranks[k].y);
          ok = ok && c.passes(tol.max_abs, tol.rel);
          if (k == 0 || !c.passes(tol.max_abs, tol.rel)) worst = c.describe();
        }
        r.check = std::string(ok ? "PASS " : "FAIL ") + worst;
      }
    }
  }
  // Without the forward pass y was never computed (it holds the poison pattern): not saved.
  // (A slice's y is not the layer's either; check_mode_options refuses --save with a slice.)
  const bool y_saved = do_fwd && options.ep_mode != EpMode::rank_slice;
  if (!y_saved)
    for (auto& r : data.ranks) r.y = HostTensor{};
  if (save_dir) {
    // A save that fails part way removes what it wrote (save_layer_data for a whole layer, the
    // catch below for a group rank's y), so no directory of partial tensors is left looking
    // like a saved run; a file this run did not write is never touched.
    namespace fs = std::filesystem;
    if (my_rank >= 0) {
      const fs::path y_file = save_target / "y.npy";
      try {
        if (y_saved) npy::save(y_file.string(), data.ranks[my_rank].y);
      } catch (const std::exception& e) {
        std::error_code ec;  // (without throwing: the save's error is the news)
        fs::remove(y_file, ec);
        throw Error(std::string(e.what()) + "; the partial " + y_file.string() + " is removed");
      }
    } else {
      io::save_layer_data(*save_dir, data);
    }
    save_claim.release();
    created_for_save.keep();
  }
  bool expected = true;
  if (expect_dir) {
    for (int r = 0; r < p.ep_size; ++r) {
      if (my_rank >= 0 && r != my_rank) continue;  // another process's rank
      if (data.ranks[r].y.empty()) continue;       // not computed here
      const bool same = expected_y[r].bitwise_equal(data.ranks[r].y);
      std::printf("  expect: rank %d y %s %s/rank%d/y.npy\n", r, same ? "is bitwise equal to" : "DIFFERS from",
                  expect_dir->c_str(), r);
      expected = expected && same;
    }
  }

  const auto stats = layer.last_schedule_stats();
  std::int64_t max_rows = 0, total = 0;
  for (const auto& s : stats) {
    max_rows = std::max(max_rows, s.real_rows);
    total += s.real_rows;
  }
  std::printf("mok run: %s  %s\n", shape_name.c_str(), p.describe().c_str());
  const std::string active =
      options.ep_mode == EpMode::rank_slice ? " active_rank=" + std::to_string(options.active_rank) : "";
  const std::string routing_text =
      load_dir ? "loaded from " + *load_dir : routing_spec.describe() + " seed=" + std::to_string(seed);
  std::printf("  backend=%s ep_mode=%s%s routing=%s rows/rank max=%lld mean=%.1f  %s\n",
              to_string(options.backend), to_string(options.ep_mode), active.c_str(), routing_text.c_str(),
              static_cast<long long>(max_rows),
              stats.empty() ? 0.0 : double(total) / double(stats.size()), layer.config().describe().c_str());
  std::printf("  %-9s %12s %10s  %s   (TFLOP/s: MoK's formula, %g rank(s) of work)\n", "pass", "median_ms",
              "TFLOP/s", "check", ranks_computed);
  bool all_pass = true;
  for (const auto& r : rows) {
    std::printf("  %-9s %12.3f %10.3f  %s\n", r.pass.c_str(), r.ms, r.tflops, r.check.c_str());
    if (r.check.rfind("FAIL", 0) == 0) all_pass = false;
  }
  if (save_dir)
    std::printf("  saved every tensor under %s%s\n", save_dir->c_str(),
                y_saved ? "" : " (no y: the forward did not run)");
  return all_pass && expected ? 0 : 3;
}

}  // namespace mok::cli

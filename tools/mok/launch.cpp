// mok launch: starts one process per rank of an EP group and watches them.
//
//   mok launch -n N [--timeout SECONDS] [--grace SECONDS] [--peer-grace SECONDS] -- COMMAND [ARGS...]
//
// Each child gets MOK_RANK, MOK_LOCAL_RANK, MOK_WORLD_SIZE and MOK_LAUNCH_DIR (a private
// directory for the rendezvous, e.g. rank 0 writes the NCCL unique id there), and NVLink
// multicast stays off in every process (NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1: on these machines multicast can take the host's GPUs
// out of service). If any rank exits non-zero or dies, the others are stopped (SIGTERM,
// then SIGKILL after --grace seconds) and the launcher exits non-zero naming that rank (and
// any other seen failed in the same look at the ranks, every 20 ms, which cannot tell which
// came first): with its exit status if it exited, 128+N if signal N killed it or kept it
// stopped for longer than --grace (a rank paused and resumed within it goes on).
// SIGINT/SIGTERM/SIGHUP to the launcher stop every rank the same way (exit 128+N; another
// one while they stop kills them at once; SIGINT and SIGHUP ignored when the launcher started,
// by nohup or `&` in a script, stay ignored in it and in the ranks), --timeout does after that
// many seconds (exit 124, naming the ranks still running), and a rank whose launcher dies gets SIGTERM
// (PR_SET_PDEATHSIG); a launcher killed outright (SIGKILL) leaves a guardian process that
// stops every rank's whole process group (Guardian). A rank that even SIGKILL does not end is named and left after another
// --grace (and a second). When the launch
// ends, whatever is still running in a rank's process group (a wrapper's children) is stopped
// too; each rank's process stays unreaped until then, so that group's id is not reused. So is
// a process that left its rank's process group (setsid, `timeout` in a wrapper), found by the
// launch's MOK_LAUNCH_DIR in the environment it started with (one that clears it escapes).
// A rank that exits with mok's "gave up on its peers" status (mok::kPeerWaitExitStatus) is
// not the culprit but a witness: the launcher waits up to --peer-grace seconds (default 10)
// for a rank that fails for its own reason and names that one, else names the ranks still
// running then (the hung ones), else the first witness.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/numbers.h"
#include "mok/cli_args.h"
#include "mok/problem.h"

namespace mok::cli {
namespace {

// The launcher's status when --timeout ran out (as timeout(1) exits), apart from any rank's.
constexpr int kTimeoutExitStatus = 124;

// How often the launcher looks at the ranks (and at its signals, the timeout and the graces).
constexpr int kPollMs = 20;

// How a rank's process ended, from waitid's report (si_code, si_status).
std::string describe_end(int code, int value) {
  if (code == CLD_EXITED) return "exited with status " + std::to_string(value);
  return std::string("was killed by signal ") + std::to_string(value) + " (" + strsignal(value) + ")";
}

// What /proc/PID/stat says of a process; nullopt when it is gone (or unreadable).
struct ProcessStat {
  std::string name;  // (the command name, 15 characters at most)
  char state = 0;
  pid_t group = 0;
  unsigned long long start_time = 0;  // (clock ticks since boot: with the pid, names the process)
};
std::optional<ProcessStat> process_stat(const std::string& pid) {
  std::ifstream stat("/proc/" + pid + "/stat");
  std::ostringstream whole;  // (read whole: a process may put a newline in its name)
  whole << stat.rdbuf();
  const std::string text = whole.str();
  if (text.empty()) return std::nullopt;
  const std::size_t open = text.find('('), close = text.rfind(')');  // (the name may hold ')' and spaces)
  if (open == std::string::npos || close == std::string::npos || close < open) return std::nullopt;
  ProcessStat out;
  out.name = text.substr(open + 1, close - open - 1);
  std::istringstream fields(text.substr(close + 1));
  long long parent = 0, group = 0;
  if (!(fields >> out.state >> parent >> group)) return std::nullopt;
  out.group = static_cast<pid_t>(group);
  std::string skipped;
  for (int field = 6; field < 22; ++field) fields >> skipped;  // (session .. itrealvalue)
  if (!(fields >> out.start_time)) return std::nullopt;
  return out;
}

// Calls `visit(pid, stat)` (the pid as /proc names it) for every process /proc lists, passing
// over those that end meanwhile; false when /proc cannot be read (to its end).
template <typename Visit>
bool for_each_process(Visit&& visit) {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc", ec), end;
  if (ec) return false;
  for (; it != end; it.increment(ec)) {
    if (ec) return false;
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (const auto stat = process_stat(name)) visit(name, *stat);
  }
  return true;
}

// Of the process groups `pgids`, those with a member that is not a zombie (a zombie is gone,
// only not yet reaped by an init that may never do it), in one pass over /proc; without
// /proc, every group with any member counts.
std::vector<pid_t> groups_with_live_processes(const std::vector<pid_t>& pgids) {
  std::vector<pid_t> candidates;
  for (pid_t g : pgids)
    if (g > 0 && kill(-g, 0) == 0) candidates.push_back(g);
  if (candidates.empty()) return candidates;
  std::set<pid_t> live;
  const bool listed = for_each_process([&](const std::string&, const ProcessStat& stat) {
    if (stat.state != 'Z' && stat.state != 'X') live.insert(stat.group);
  });
  if (!listed) return candidates;
  std::vector<pid_t> out;
  for (pid_t g : candidates)
    if (live.count(g)) out.push_back(g);
  return out;
}

// Stops every live process of the groups `pgids`: SIGTERM, then SIGKILL to those still there
// after `grace_s` (at once if `hurry()` turns true meanwhile: a signal to the launcher), then
// up to `grace_s` more for them to go. Returns the groups that are still live then (a process
// SIGKILL cannot end: uninterruptible in a hung driver, say).
std::vector<pid_t> stop_process_groups(const std::vector<pid_t>& pgids, double grace_s,
                                       const std::function<bool()>& hurry) {
  std::vector<pid_t> left = groups_with_live_processes(pgids);
  for (pid_t g : left) kill(-g, SIGTERM);
  for (int round = 0; round < 2 && !left.empty(); ++round) {
    // (After SIGKILL at least a second: the kernel takes a moment to end a process.)
    const double wait_s = round == 0 ? grace_s : std::max(grace_s, 1.0);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
    while (!(left = groups_with_live_processes(left)).empty() && std::chrono::steady_clock::now() < until &&
           !(round == 0 && hurry()))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (round == 0)
      for (pid_t g : left) kill(-g, SIGKILL);
  }
  return left;
}

// The name a guardian process (below) gives itself: a nested launch's guardian carries the
// outer launch's MOK_LAUNCH_DIR and sits in a group of its own, but it is not an escaped
// process of the outer launch (it ends by itself once its own launch is stopped, and must not
// be cut short while it stops that launch's ranks).
constexpr char kGuardianName[] = "mok-guardian";

// This process's start time (0 if /proc cannot say: then no process is too old to look at).
unsigned long long own_start_time() {
  const auto stat = process_stat(std::to_string(getpid()));
  return stat ? stat->start_time : 0;
}

// A process found by escaped_processes: its pid and start time, so that a pid reused by
// another process later is not taken for it.
struct FoundProcess {
  pid_t pid = 0;
  unsigned long long start_time = 0;
  bool operator<(const FoundProcess& o) const { return pid != o.pid ? pid < o.pid : start_time < o.start_time; }
};

// Whether `p` is still there and not yet a zombie (a process still exiting, releasing its
// GPU say, is: its state is not Z until it has let go of everything).
bool still_alive(const FoundProcess& p) {
  const auto stat = process_stat(std::to_string(p.pid));
  return stat && stat->start_time == p.start_time && stat->state != 'Z' && stat->state != 'X';
}

// The live processes (not zombies) of this launch that left their rank's process group
// (setsid, `timeout` in a wrapper, Python's start_new_session): those whose environment holds
// MOK_LAUNCH_DIR=launch_dir (every rank's process has it, and what it starts inherits it; the
// directory is this launch's own, from mkdtemp) and whose process group is none of
// `rank_groups` (those are stopped as groups); a nested launch's guardian (kGuardianName) is
// not one. The environment read is the one each process started with (/proc/PID/environ): a
// process that cleared it before its exec is not found, nor one caught in the middle of an
// exec (whose environment reads empty for that moment: stop_escaped_processes looks again).
// stat is read first, so that the environment (whose read waits for the process's memory map)
// is read only of live processes outside the ranks' groups that started no earlier than
// `not_before` (the launcher's or the guardian's start time: every process of the launch is
// younger). `unreadable`, when given, counts those whose environment read empty.
std::vector<FoundProcess> escaped_processes(const std::string& launch_dir, const std::vector<pid_t>& rank_groups,
                                            unsigned long long not_before, std::size_t* unreadable = nullptr) {
  std::vector<FoundProcess> out;
  const std::string marker = "MOK_LAUNCH_DIR=" + launch_dir;
  for_each_process([&](const std::string& pid, const ProcessStat& stat) {
    if (stat.state == 'Z' || stat.state == 'X' || stat.start_time < not_before || stat.name == kGuardianName ||
        std::find(rank_groups.begin(), rank_groups.end(), stat.group) != rank_groups.end())
      return;
    std::ifstream environ("/proc/" + pid + "/environ", std::ios::binary);
    bool ours = false, any = false;
    for (std::string entry; !ours && std::getline(environ, entry, '\0'); any = true) ours = entry == marker;
    if (ours) out.push_back({static_cast<pid_t>(std::stoll(pid)), stat.start_time});
    if (!any && unreadable != nullptr) ++*unreadable;
  });
  return out;
}

// Stops the escaped processes of this launch (escaped_processes; those it finds are then
// followed by pid and start time, and it is asked again each round, so that one started
// meanwhile is stopped too): SIGTERM, then SIGKILL to those still alive after `grace_s` (at
// once if `hurry()` turns true), then up to `grace_s` (at least a second) more. Returns how
// many it found in all, and how many of them are still alive at the end.
std::pair<std::size_t, std::size_t> stop_escaped_processes(const std::string& launch_dir,
                                                           const std::vector<pid_t>& rank_groups,
                                                           unsigned long long not_before, double grace_s,
                                                           const std::function<bool()>& hurry) {
  std::set<FoundProcess> found;
  std::size_t unreadable = 0;
  const auto look = [&] {
    for (const FoundProcess& p : escaped_processes(launch_dir, rank_groups, not_before, &unreadable))
      found.insert(p);
  };
  const auto alive = [&] {
    std::vector<FoundProcess> out;
    for (const FoundProcess& p : found)
      if (still_alive(p)) out.push_back(p);
    return out;
  };
  look();
  // (A second look a moment later where a candidate's environment read empty: a process in
  // the middle of an exec reads so.)
  if (unreadable > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    look();
  }
  std::vector<FoundProcess> left = alive();
  for (int round = 0; round < 2 && !left.empty(); ++round) {
    const int sig = round == 0 ? SIGTERM : SIGKILL;
    std::set<FoundProcess> signalled;  // (each process once a round: one found since is signalled too)
    const auto signal_new = [&] {
      for (const FoundProcess& p : left)
        if (signalled.insert(p).second && still_alive(p)) kill(p.pid, sig);
    };
    signal_new();
    const double wait_s = round == 0 ? grace_s : std::max(grace_s, 1.0);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
    for (;;) {
      look();
      left = alive();
      if (left.empty() || std::chrono::steady_clock::now() >= until || (round == 0 && hurry())) break;
      signal_new();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return {found.size(), left.size()};
}

// A process that outlives a launcher killed outright (SIGKILL, the OOM killer), so that what
// the ranks started does not run on without it: a rank's PR_SET_PDEATHSIG reaches only the
// rank's first process, not the workers or wrappers it started. The guardian learns each
// rank's process group through a Unix socket pair; when the socket closes without the
// launcher's "done" (a zero pid; the kernel closes it as the launcher dies, however it dies) it stops those groups, SIGTERM
// then SIGKILL after the grace, and removes the rendezvous directory. It sits in a process
// group of its own and ignores the terminal's signals (the launcher handles those); it holds
// neither the launcher's stdin nor its stdout, and lets go of stderr once it has said what it
// stops. A launch that ends normally says "done" and waits for it to go.
class Guardian {
 public:
  Guardian(double grace_s, const std::string& launch_dir) {
    // (A socket pair, not a pipe: a send to a guardian that is gone fails with EPIPE instead of
    // raising SIGPIPE in the launcher.)
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0)
      throw Error(std::string("mok launch: socketpair: ") + std::strerror(errno));
    const pid_t pid = fork();
    if (pid < 0) {
      const int err = errno;
      close(fds[0]);
      close(fds[1]);
      throw Error(std::string("mok launch: fork failed for the guardian process: ") + std::strerror(err));
    }
    if (pid == 0) {
      close(fds[1]);
      watch_until_released(fds[0], grace_s, launch_dir);  // (does not return)
    }
    close(fds[0]);
    write_fd_ = fds[1];
    pid_ = pid;
  }
  Guardian(const Guardian&) = delete;
  Guardian& operator=(const Guardian&) = delete;
  // An unwinding launcher (an unexpected exception) tells no "done": closing the socket leaves
  // the guardian to stop the groups it knows, as when the launcher is killed. Only release(),
  // called once the ranks are stopped, stands it down.
  ~Guardian() {
    if (pid_ >= 0) close(write_fd_);
  }
  // Tells the guardian about a rank's process group (its first process's pid). Called by the
  // rank's process itself before it execs (its copy of the socket closes at exec), and by the
  // launcher after the fork: a launcher killed in between cannot leave a group unknown.
  void watch(pid_t pgid) { send(pgid); }
  // The launch stopped its ranks itself: the guardian exits, and is waited for.
  void release() {
    if (pid_ < 0) return;
    send(0);
    close(write_fd_);
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }

 private:
  void send(pid_t value) {
    const char* p = reinterpret_cast<const char*>(&value);
    for (std::size_t left = sizeof value; left > 0;) {
      const ssize_t n = ::send(write_fd_, p, left, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // (the guardian is gone: nothing to tell)
      p += n;
      left -= static_cast<std::size_t>(n);
    }
  }
  [[noreturn]] static void watch_until_released(int fd, double grace_s, const std::string& launch_dir) {
    // (Named before it leaves the launcher's group: an outer launch never sees it unnamed in a
    // group of its own, and leaves it be: escaped_processes.)
    prctl(PR_SET_NAME, kGuardianName);
    setpgid(0, 0);
    // (Forked before any rank: every process of the launch is younger than it.)
    const unsigned long long started = own_start_time();
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) signal(sig, SIG_IGN);
    const int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
      dup2(null, STDIN_FILENO);
      dup2(null, STDOUT_FILENO);
    }
    std::vector<pid_t> groups;
    for (;;) {
      pid_t value = 0;
      char* p = reinterpret_cast<char*>(&value);
      std::size_t got = 0;
      while (got < sizeof value) {
        const ssize_t n = read(fd, p + got, sizeof value - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += static_cast<std::size_t>(n);
      }
      if (got == sizeof value && value == 0) _exit(0);  // released: the launch cleaned up
      if (got == sizeof value) {
        if (value > 0 && std::find(groups.begin(), groups.end(), value) == groups.end()) groups.push_back(value);
        continue;
      }
      break;  // the socket closed without "done": the launcher (and every rank not yet exec'd) is gone
    }
    // Every registered group that still exists, each round anew (a group's leader may be a
    // zombie while a child it just forked runs on; once the launcher is gone init reaps the
    // zombies, so an existing group has a live member): SIGTERM, then SIGKILL after the grace.
    auto existing = [&] {
      std::vector<pid_t> out;
      for (pid_t g : groups)
        if (kill(-g, 0) == 0) out.push_back(g);
      return out;
    };
    std::vector<pid_t> left = existing();
    const std::size_t escaped = escaped_processes(launch_dir, groups, started).size();
    if (!left.empty() || escaped > 0) {
      std::fprintf(stderr, "mok launch: the launcher ended without stopping its ranks; stopping %zu rank process "
                   "group(s) and %zu process(es) that left them\n", left.size(), escaped);
      if (null >= 0) dup2(null, STDERR_FILENO);  // (the caller's pipe, if any, is not held while it works)
    }
    for (int sig : {SIGTERM, SIGKILL}) {
      for (pid_t g : left) kill(-g, sig);
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(grace_s, 1.0));
      while (!(left = existing()).empty() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (left.empty()) break;
    }
    // Then those that left their rank's group (setsid), whose parents the groups' stop may
    // just have ended; looked for again, as any may have started since.
    stop_escaped_processes(launch_dir, groups, started, grace_s, [] { return false; });
    std::error_code ec;
    std::filesystem::remove_all(launch_dir, ec);
    _exit(0);
  }

  int write_fd_ = -1;
  pid_t pid_ = -1;
};

volatile sig_atomic_t g_launcher_signal = 0;   // the latest signal to the launcher (0: none)
volatile sig_atomic_t g_launcher_signals = 0;  // how many arrived: a second one hurries the stop
extern "C" void on_launcher_signal(int sig) {
  g_launcher_signal = sig;
  g_launcher_signals = g_launcher_signals + 1;
}

// The signals the launcher handles (stop every rank). SIGINT and SIGHUP that were ignored
// when the launcher started (`nohup`, `&` in a script) stay ignored, in it and in the ranks,
// as they would for any other command; SIGTERM is always handled.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

}  // namespace

int launch_command(const std::vector<std::string>& argv) {
  const char* usage =
      "usage: mok launch -n N [--timeout SECONDS] [--grace SECONDS] [--peer-grace SECONDS] -- COMMAND [ARGS...]";
  // Split at "--": options before, the command after.
  const auto dash = std::find(argv.begin(), argv.end(), "--");
  if (std::find(argv.begin(), dash, "--help") != dash) {
    std::printf("%s\nStarts N processes running COMMAND, one per rank (MOK_RANK, MOK_WORLD_SIZE, "
                "MOK_LOCAL_RANK set, and MOK_LAUNCH_DIR: the group's private rendezvous directory), and stops the others when one fails (exit: its status, or 128+N for "
                "signal N). A rank exiting with status %d gave up waiting for its peers: the launcher then "
                "waits up to --peer-grace s (10) for the rank that failed, or names the ranks still running.\n"
                "  --timeout S  stop every rank after S s (0, the default: no limit; exit 124, naming the ranks still running)\n"
                "  --grace S    (10) the wait between SIGTERM and SIGKILL, and how long a rank may stay "
                "stopped by a signal before it fails the launch\n"
                "  --peer-grace S  (10) the wait for the failed rank after one gave up on its peers\n"
                "SIGINT, SIGTERM or SIGHUP stops every rank the same way (exit 128+N), and another one "
                "while they stop kills them at once; SIGINT and SIGHUP ignored when the launcher started "
                "(nohup, `&` in a script) stay ignored. Seconds are at most 1e7. Processes the ranks leave running are stopped when the launch ends "
                "(also those in a session of their own: found by MOK_LAUNCH_DIR in their environment), "
                "also when the launcher itself is killed (a guardian process does it); a "
                "rank that even SIGKILL does not end is named and left after another grace and a second. A "
                "failed fork stops, kills and reaps the ranks already started.\n",
                usage, kPeerWaitExitStatus);
    return 0;
  }
  if (dash == argv.end() || dash + 1 == argv.end()) throw Error(std::string("mok launch: ") + usage);
  std::vector<std::string> opts(argv.begin(), dash), command(dash + 1, argv.end());
  for (auto& o : opts) {
    // The parser reads options as --name, so -n becomes --n; a --n the user typed would then
    // pass as -n unnoticed, which the launcher's usage never promised: refused, naming the spelling.
    if (o == "--n" || o.rfind("--n=", 0) == 0)
      throw Error("mok launch: option " + o.substr(0, 3) + ": the number of ranks is spelled -n (one dash)");
    if (o == "-n" || o.rfind("-n=", 0) == 0) o = "-" + o;
  }
  // (The option is spelled -n: the parser's messages about it say so.)
  const auto spelled = [](const Error& e) {
    std::string m = e.what();
    for (std::size_t at = m.find("--n"); at != std::string::npos; at = m.find("--n", at + 1)) {
      const std::size_t end = at + 3;
      if (end == m.size() || !(std::isalnum(static_cast<unsigned char>(m[end])) || m[end] == '-')) m.erase(at, 1);
    }
    return Error(m);
  };
  std::optional<long long> given_n;
  double timeout_s = 0, grace_s = 10, peer_grace_s = 10;
  try {
    Args args(opts, {});
    given_n = args.take_whole("n");
    // (At most 1e7 s, about 116 days: a deadline that far fits the clock.)
    const NumberRange timeout_range{0, 1e7, false, false, "seconds (0 = none)"};
    const NumberRange grace_range{0, 1e7, false, false,
                                  "seconds (between SIGTERM and SIGKILL, and that a rank may stay stopped)"};
    const NumberRange peer_grace_range{0, 1e7, false, false,
                                       "seconds (to wait for the culprit after a rank gave up on its peers)"};
    timeout_s = args.take_double("timeout", timeout_range).value_or(0);
    grace_s = args.take_double("grace", grace_range).value_or(10);
    peer_grace_s = args.take_double("peer-grace", peer_grace_range).value_or(10);
    args.finish();
  } catch (const Error& e) {
    throw spelled(e);
  }
  if (!given_n) throw Error(std::string("mok launch: -n N (the number of ranks) is required; ") + usage);
  const long long n = *given_n;
  require(n >= 1 && n <= kMaxEpSize,
          "mok launch: -n must be in [1, " + std::to_string(kMaxEpSize) + "], got " + std::to_string(n));

  char dir_template[] = "/tmp/mok-launch-XXXXXX";
  require(mkdtemp(dir_template) != nullptr, "mok launch: cannot create a rendezvous directory in /tmp");
  const std::string launch_dir = dir_template;

  // The ranks' ends are waited for: a SIGCHLD ignored by whatever started the launcher would
  // have the kernel reap them unseen (waitid: ECHILD) and, inherited, their own children too.
  signal(SIGCHLD, SIG_DFL);
  // A signal to the launcher stops the ranks (handled in the watch loop below); one ignored
  // when it started stays ignored (kStopSignals).
  std::vector<int> handled;
  {
    struct sigaction sa {};
    sa.sa_handler = on_launcher_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig : kStopSignals) {
      struct sigaction was {};
      sigaction(sig, nullptr, &was);
      if (sig != SIGTERM && was.sa_handler == SIG_IGN) continue;
      sigaction(sig, &sa, nullptr);
      handled.push_back(sig);
    }
  }
  // Blocked around each fork: a signal meant for a rank that arrives before the new process
  // has dropped the launcher's handler stays pending in it until it has (instead of only
  // setting the flag in its copy of the launcher).
  sigset_t stop_set, unblocked;
  sigemptyset(&stop_set);
  for (int sig : kStopSignals) sigaddset(&stop_set, sig);
  const int signals_at_start = g_launcher_signals;
  const auto signalled_since = [](int count) { return [count] { return g_launcher_signals != count; }; };

  const pid_t launcher = getpid();
  std::optional<Guardian> guardian_slot;
  try {
    guardian_slot.emplace(grace_s, launch_dir);
  } catch (const Error&) {
    std::error_code ec;
    std::filesystem::remove_all(launch_dir, ec);
    throw;
  }
  Guardian& guardian = *guardian_slot;
  std::vector<pid_t> pids(n, -1);
  std::vector<bool> done(n, false);
  for (long long r = 0; r < n; ++r) {
    sigprocmask(SIG_BLOCK, &stop_set, &unblocked);
    const pid_t pid = fork();
    const int fork_errno = errno;
    if (pid != 0) sigprocmask(SIG_SETMASK, &unblocked, nullptr);
    if (pid < 0) {  // the ranks already started are stopped and reaped, the rendezvous directory removed
      const int err = fork_errno;
      const std::vector<pid_t> started(pids.begin(), pids.begin() + r);
      const std::vector<pid_t> left = stop_process_groups(started, grace_s, signalled_since(g_launcher_signals));
      guardian.release();  // (before the reaping below frees the group ids it holds)
      for (pid_t p : started) {
        bool unkillable = false;
        for (pid_t g : left) unkillable = unkillable || g == p;
        int status = 0;
        if (!unkillable) waitpid(p, &status, 0);
      }
      std::error_code ec;
      std::filesystem::remove_all(launch_dir, ec);
      throw Error("mok launch: fork failed for rank " + std::to_string(r) + ": " + std::strerror(err) + " (the " +
                  std::to_string(r) + " rank(s) started were stopped" +
                  (left.empty() ? std::string(")") : "; " + std::to_string(left.size()) + " did not end even after SIGKILL)"));
    }
    if (pid == 0) {
      // The default actions first (the signals ignored from the start stay ignored), then the
      // signals unblocked: a SIGTERM from the launcher's death (below) or its stop must end
      // this process, not set the launcher's flag in it.
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : handled) sigaction(sig, &dfl, nullptr);
      sigprocmask(SIG_SETMASK, &unblocked, nullptr);
      setpgid(0, 0);  // one process group per rank: stopping a rank stops what it started
      guardian.watch(getpid());  // (before the launcher may: it can die before it learns the pid)
      // The rank goes when the launcher goes, however it goes.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != launcher) _exit(1);
      setenv("MOK_RANK", std::to_string(r).c_str(), 1);
      setenv("MOK_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("MOK_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MOK_LAUNCH_DIR", launch_dir.c_str(), 1);
      setenv("NCCL_NVLS_ENABLE", "0", 1);
      setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
      setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
      std::vector<char*> cargv;
      for (auto& c : command) cargv.push_back(c.data());
      cargv.push_back(nullptr);
      execvp(cargv[0], cargv.data());
      std::fprintf(stderr, "mok launch: rank %lld: cannot run '%s': %s\n", r, cargv[0], std::strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid);
    pids[r] = pid;
    guardian.watch(pid);
  }

  const auto start = std::chrono::steady_clock::now();
  int failed_rank = -1, exit_code = 1;
  std::string failure;
  long long remaining = n;
  double stopped_at = -1;  // when the other ranks were asked to stop
  int signals_at_stop = 0;  // how many signals the launcher had had by then
  bool killed = false;      // hurried to SIGKILL by another signal
  auto stop_all = [&](int sig) {
    for (long long r = 0; r < n; ++r)
      if (!done[r]) kill(-pids[r], sig);
  };
  // The first rank that gave up on its peers (a witness), while the culprit is awaited.
  int witness_rank = -1;
  double witness_at = 0, last_witness_at = 0;
  auto elapsed_s = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  auto still_running = [&] {  // "rank 2, rank 5"
    std::string running;
    for (long long r = 0; r < n; ++r)
      if (!done[r]) running += (running.empty() ? "rank " : ", rank ") + std::to_string(r);
    return running;
  };
  // The launch's failure: recorded, then told and the other ranks stopped (at once by `fail`;
  // for ranks seen failed in a look at the ranks, once that look is over).
  auto record_failure = [&](int rank, int code, const std::string& what) {
    failed_rank = rank;
    exit_code = code;
    failure = what;
  };
  auto announce_failure = [&] {
    std::fprintf(stderr, "mok launch: %s; stopping the other ranks\n", failure.c_str());
    stop_all(SIGTERM);
  };
  auto fail = [&](int rank, int code, const std::string& what) {
    record_failure(rank, code, what);
    announce_failure();
  };
  // When each rank was seen stopped by a signal (-1: running), and by which.
  std::vector<double> rank_stopped_at(n, -1);
  std::vector<int> stop_signal(n, 0);
  while (remaining > 0) {
    bool reported = false;
    // A rank that fails for its own reason is named, and the others told to stop, only once
    // this pass has looked at every rank: a second one that ended in the same pass, before any
    // TERM of ours, failed on its own too, and the pass cannot tell which was first (it looks
    // at the ranks in order), so it is named beside the first ("also").
    bool failed_in_this_pass = false;
    std::string also_failed;
    // Ranks seen ended in this pass (their unreaped leaders keep their group ids): their groups
    // get the TERM too, so that what they left running stops with the rest.
    std::vector<long long> ended_in_this_pass;
    // A rank that failed for its own reason: the first is the launch's failure (told once the
    // pass is over), any other of the same pass is named beside it.
    auto own_failure = [&](long long r, int code, const std::string& what) {
      if (failed_rank < 0) {
        record_failure(static_cast<int>(r), code, what);
        failed_in_this_pass = true;
      } else if (failed_in_this_pass) {
        also_failed += (also_failed.empty() ? "" : "; ") + what;
      }
    };
    for (long long r = 0; r < n; ++r) {
      if (done[r]) continue;
      // Stops and continues are taken as they come (a rank stopped for good, by SIGTTIN for
      // reading the terminal say, would be waited for without end; one paused and resumed, by
      // a job scheduler say, goes on). An exit is only looked at (WNOWAIT): the rank's process
      // stays a zombie until the launch ends, so its pid, which names its process group, is
      // not handed to another process before that group's leftovers are stopped (below).
      siginfo_t info{};
      if (waitid(P_PID, pids[r], &info, WSTOPPED | WCONTINUED | WNOHANG) == 0 && info.si_pid == pids[r]) {
        reported = true;
        if (info.si_code == CLD_CONTINUED) {
          rank_stopped_at[r] = -1;
        } else if (rank_stopped_at[r] < 0) {
          rank_stopped_at[r] = elapsed_s();
          stop_signal[r] = info.si_status;
          if (failed_rank < 0)
            std::fprintf(stderr, "mok launch: rank %lld was stopped by signal %d (%s); it fails the launch unless it "
                                 "continues within %s s\n", r, info.si_status, strsignal(info.si_status),
                         exact_number(grace_s).c_str());
        }
      }
      info = siginfo_t{};
      if (waitid(P_PID, pids[r], &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
        if (errno != ECHILD) continue;
        // (Not after SIGCHLD is back to its default, above; should something reap it anyway,
        // the rank is gone and how it ended is not known: a failure, never a success.)
        // (Its group id may be another's by now: no signal goes to it.)
        reported = true;
        done[r] = true;
        --remaining;
        rank_stopped_at[r] = -1;
        own_failure(r, 1, "rank " + std::to_string(r) + " ended and its exit status was lost (reaped by something "
                          "else)");
        continue;
      }
      if (info.si_pid != pids[r]) continue;
      reported = true;
      done[r] = true;
      --remaining;
      rank_stopped_at[r] = -1;
      ended_in_this_pass.push_back(r);
      const bool exited = info.si_code == CLD_EXITED;
      const bool ok = exited && info.si_status == 0;
      const bool witness = exited && info.si_status == kPeerWaitExitStatus;
      if (ok || (witness && failed_rank >= 0)) continue;
      if (witness) {
        // Each witness restarts the wait (the others may still be giving up, each on its
        // own deadline), up to three graces after the first.
        last_witness_at = elapsed_s();
        if (witness_rank < 0) {
          witness_rank = static_cast<int>(r);
          witness_at = last_witness_at;
          std::fprintf(stderr, "mok launch: rank %lld gave up waiting for its peers; looking for the rank "
                               "that failed (up to %s s)\n", r, exact_number(peer_grace_s).c_str());
        }
        continue;
      }
      // (A rank killed by a signal exits 128 + its number, as a shell reports it.)
      own_failure(r, exited ? info.si_status : 128 + info.si_status,
                  "rank " + std::to_string(r) + " " + describe_end(info.si_code, info.si_status));
    }
    if (failed_in_this_pass) {
      if (!also_failed.empty())
        failure += " (" + also_failed + " too, seen in the same look at the ranks, every " + std::to_string(kPollMs) +
                   " ms: which came first is not known)";
      announce_failure();
      for (long long r : ended_in_this_pass) kill(-pids[r], SIGTERM);
    }
    for (long long r = 0; r < n; ++r) {
      if (done[r] || rank_stopped_at[r] < 0) continue;
      if (failed_rank < 0 && elapsed_s() - rank_stopped_at[r] > grace_s)
        fail(static_cast<int>(r), 128 + stop_signal[r],
             "rank " + std::to_string(r) + " was stopped by signal " + std::to_string(stop_signal[r]) + " (" +
                 strsignal(stop_signal[r]) + ") and did not continue within " + exact_number(grace_s) +
                 " s; a stopped rank never ends");
      if (failed_rank >= 0) kill(-pids[r], SIGCONT);  // (so that the TERM sent to its group can act)
    }
    if (reported) continue;
    const double elapsed = elapsed_s();
    if (failed_rank < 0 && witness_rank >= 0 &&
        (elapsed - last_witness_at > peer_grace_s || elapsed - witness_at > 3 * peer_grace_s)) {
      // (Some rank is still running here: the loop ends once every rank is reaped.)
      fail(witness_rank, kPeerWaitExitStatus,
           still_running() + " still running " + std::to_string(static_cast<int>(elapsed - witness_at)) +
               " s after rank " + std::to_string(witness_rank) + " gave up waiting for its peers (died or hangs)");
    }
    if (failed_rank < 0 && g_launcher_signal != 0) {
      failed_rank = n;
      exit_code = 128 + g_launcher_signal;
      failure = std::string("the launcher got signal ") + strsignal(g_launcher_signal);
      std::fprintf(stderr, "mok launch: %s; stopping every rank\n", failure.c_str());
      stop_all(SIGTERM);
    }
    if (failed_rank < 0 && timeout_s > 0 && elapsed > timeout_s) {
      failed_rank = n;  // no single rank to blame
      exit_code = kTimeoutExitStatus;
      failure = "timed out after " + exact_number(timeout_s) + " s with " + still_running() + " still running";
      if (witness_rank >= 0)
        failure += " (rank " + std::to_string(witness_rank) + " had given up waiting for its peers)";
      std::fprintf(stderr, "mok launch: %s; stopping every rank\n", failure.c_str());
      stop_all(SIGTERM);
    }
    if (failed_rank >= 0) {
      if (stopped_at < 0) {
        stopped_at = elapsed;
        signals_at_stop = g_launcher_signals;
      }
      // A signal to the launcher while it stops the ranks (a second Ctrl-C, say) kills them now.
      if (!killed && g_launcher_signals != signals_at_stop) {
        std::fprintf(stderr, "mok launch: got signal %s while stopping the ranks; killing them now\n",
                     strsignal(g_launcher_signal));
        killed = true;
      }
      if (killed || elapsed - stopped_at > grace_s) stop_all(SIGKILL);
      // A rank that SIGKILL does not end (uninterruptible, in a hung driver say) is not
      // waited for without end: after another grace it is named and left.
      if (elapsed - stopped_at > 2 * grace_s + 1) {
        std::fprintf(stderr, "mok launch: %s did not end %s s after SIGKILL (uninterruptible?); leaving it\n",
                     still_running().c_str(), exact_number(grace_s + 1).c_str());
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
  }
  if (failed_rank < 0 && witness_rank >= 0) {  // every rank is gone, none for its own reason
    failed_rank = witness_rank;
    exit_code = kPeerWaitExitStatus;
    failure = "rank " + std::to_string(witness_rank) +
              " gave up waiting for its peers, and no rank failed for another reason";
  }
  // A rank's process group outlives its first process when that one started others (a shell
  // wrapper, workers) and they are still running: whatever is left in any rank's group is
  // stopped too, TERM first and KILL after the grace, so that no process of the launch keeps
  // a GPU or a communicator after it.
  // (Ranks that did not end even after SIGKILL, above, were stopped already: only named.)
  std::vector<pid_t> ended;
  for (long long r = 0; r < n; ++r)
    if (done[r]) ended.push_back(pids[r]);
  const std::vector<pid_t> leftover = groups_with_live_processes(ended);
  if (!leftover.empty()) {
    std::string which;
    for (long long r = 0; r < n; ++r)
      if (done[r] && std::find(leftover.begin(), leftover.end(), pids[r]) != leftover.end())
        which += (which.empty() ? "rank " : ", rank ") + std::to_string(r);
    if (!which.empty())
      std::fprintf(stderr, "mok launch: processes started by %s are still running after it ended; stopping them\n",
                   which.c_str());
    // (Killed at once if a second signal already hurried the ranks' stop, or one comes now.)
    const int signals_now = g_launcher_signals;
    const std::vector<pid_t> unkillable = stop_process_groups(
        leftover, grace_s, [&] { return killed || g_launcher_signals != signals_now; });
    if (!unkillable.empty())
      std::fprintf(stderr, "mok launch: %zu process group(s) of the launch did not end even after SIGKILL; leaving "
                   "them\n", unkillable.size());
  }
  // Processes that left their rank's process group (setsid, `timeout` in a wrapper, Python's
  // start_new_session) are not reached through the groups: they are found by the launch's
  // MOK_LAUNCH_DIR in their environment and stopped the same way.
  std::size_t escaped = 0;
  {
    const int signals_now = g_launcher_signals;
    std::size_t unstopped = 0;
    std::tie(escaped, unstopped) = stop_escaped_processes(
        launch_dir, pids, own_start_time(), grace_s, [&] { return killed || g_launcher_signals != signals_now; });
    if (escaped > 0)
      std::fprintf(stderr, "mok launch: %zu process(es) the ranks started in a process group of their own were "
                   "still running after the ranks ended; %s\n", escaped,
                   unstopped == 0 ? "stopped them"
                                  : (std::to_string(unstopped) + " did not end even after SIGKILL; leaving them").c_str());
  }
  // The guardian stands down first: once the zombies below are reaped their group ids are free
  // and could be another process's by the time a guardian of a launcher killed now acted.
  guardian.release();
  // The ranks' processes, kept as zombies while their groups were looked at, are reaped (a
  // rank that never ended is not waited for).
  for (long long r = 0; r < n; ++r) {
    siginfo_t info{};
    if (!done[r] && (waitid(P_PID, pids[r], &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != pids[r]))
      continue;
    int status = 0;
    while (waitpid(pids[r], &status, 0) < 0 && errno == EINTR) {
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(launch_dir, ec);
  if (failed_rank < 0 && g_launcher_signals != signals_at_start) {
    // (Every rank had ended well; the signal came as the last of them ended, or while their
    // leftovers were being stopped.)
    failed_rank = static_cast<int>(n);
    exit_code = 128 + g_launcher_signal;
    failure = std::string("the launcher got signal ") + strsignal(g_launcher_signal) +
              (leftover.empty() && escaped == 0 ? " as its ranks ended" : " while it stopped the processes the ranks left");
  }
  if (failed_rank >= 0) {
    std::fprintf(stderr, "mok launch: failed: %s\n", failure.c_str());
    return exit_code != 0 ? exit_code : 1;
  }
  return 0;
}

}  // namespace mok::cli

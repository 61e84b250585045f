#include "tensordict/distributed/runner.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>

#include "core/env.h"
#include "tensordict/distributed/process_group.h"

extern char** environ;

namespace tensordict::dist {
namespace {

constexpr const char* kEnvRank = "TENSORDICT_RUN_RANK";
constexpr const char* kEnvWorldSize = "TENSORDICT_RUN_WORLD_SIZE";
constexpr const char* kEnvDir = "TENSORDICT_RUN_DIR";
constexpr const char* kEnvIndex = "TENSORDICT_RUN_INDEX";
constexpr const char* kEnvParent = "TENSORDICT_RUN_PARENT";
// How long the runner waits, after a rank failed, for the ranks that failure takes with it.
constexpr std::chrono::milliseconds kFailureGrace{300};

// Which run() call of this process we are in: a rank re-runs main() and must stop at the call
// that started it.
std::atomic<int> g_run_calls{0};
std::string g_scratch_dir;  // set in a rank only

using core::env;

std::string error_file(const std::string& dir, int rank) {
  return dir + "/rank" + std::to_string(rank) + ".error";
}

// The error file starts with the failure time on the system-wide monotonic clock: when one
// rank's failure makes its peers fail too, the caller reports the earliest, the cause.
void write_error(const std::string& dir, int rank, const std::string& message) {
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  std::ofstream(error_file(dir, rank))
      << std::chrono::duration_cast<std::chrono::nanoseconds>(now).count() << "\n"
      << message;
}

// (failure time, message); time max() when the rank left no file (killed, _exit).
std::pair<int64_t, std::string> read_error(const std::string& dir, int rank) {
  std::ifstream in(error_file(dir, rank));
  int64_t when = std::numeric_limits<int64_t>::max();
  if (!(in >> when)) {
    return {std::numeric_limits<int64_t>::max(), ""};
  }
  in.get();
  std::stringstream text;
  text << in.rdbuf();
  return {when, text.str()};
}

[[noreturn]] void finish_rank(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // Not exit(): the rank must not run the rest of main(), and static destructors of a process
  // with live communication threads are not worth the risk.
  std::_Exit(code);
}

// Spawned ranks (all running this same function): a barrier on the default group before it
// goes, since a rank that has nothing to exchange could otherwise exit while a peer is still
// connecting the group's mesh, failing that peer.
void leave_together() {
  if (is_initialized()) default_group()->barrier()->wait();
}

// The rank's side of run(): called when the environment says we are rank `rank`.
void run_as_rank(const std::function<void(int, int)>& fn, const RunOptions& options) {
  const int rank = std::stoi(*env(kEnvRank));
  const int world_size = std::stoi(*env(kEnvWorldSize));
  const std::string dir = *env(kEnvDir);
  if (auto parent = env(kEnvParent); parent && getppid() != std::stoi(*parent)) {
    finish_rank(1);  // the caller died before PR_SET_PDEATHSIG took effect
  }
  g_scratch_dir = dir;
  try {
    if (options.init_process_group) {
      init_process_group({.backend = options.backend,
                          .init_method = "file://" + dir + "/store",
                          .rank = rank,
                          .world_size = world_size,
                          .timeout = options.group_timeout,
                          .gloo_hostname = "127.0.0.1"});
    }
    fn(rank, world_size);
    if (is_initialized()) {
      leave_together();
      destroy_process_group();
    }
  } catch (const std::exception& e) {
    // c10::Error::what() carries a backtrace; the message alone is what the caller needs.
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::string message = c10_error ? c10_error->msg() : e.what();
    write_error(dir, rank, message);
    std::cerr << "[rank " << rank << "] " << message << std::endl;
    finish_rank(1);
  } catch (...) {
    write_error(dir, rank, "unknown exception");
    finish_rank(1);
  }
  finish_rank(0);
}

std::vector<std::string> own_command_line() {
  std::ifstream file("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  for (std::string arg; std::getline(file, arg, '\0');) {
    args.push_back(arg);
  }
  TORCH_CHECK(!args.empty(), "dist::run: cannot read /proc/self/cmdline");
  return args;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) {
    return c10::str("exit code ", WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return c10::str("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  return c10::str("status ", status);
}

struct Child {
  pid_t pid = -1;
  int pidfd = -1;
  bool done = false;
  int status = 0;
};

void kill_and_reap(std::vector<Child>& children) {
  for (auto& c : children) {
    if (!c.done && c.pid > 0) {
      ::kill(c.pid, SIGKILL);
    }
  }
  for (auto& c : children) {
    if (!c.done && c.pid > 0) {
      while (::waitpid(c.pid, &c.status, 0) < 0 && errno == EINTR) {
      }
      c.done = true;
    }
    if (c.pidfd >= 0) {
      ::close(c.pidfd);
      c.pidfd = -1;
    }
  }
}

// Reaps what has exited without waiting.
void reap(std::vector<Child>& children, std::vector<size_t>& exit_order) {
  for (size_t i = 0; i < children.size(); ++i) {
    auto& c = children[i];
    if (!c.done && ::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
      c.done = true;
      exit_order.push_back(i);
    }
  }
}

bool any_failed(const std::vector<Child>& children) {
  return std::any_of(children.begin(), children.end(),
                     [](const Child& c) { return c.done && c.status != 0; });
}

// The failed ranks, the likely cause first. A rank that died without a message of its own (a
// signal, _Exit) comes first: its peers' errors ("connection closed by peer") are its
// consequences, and they may be reaped before it when the machine is loaded. Then ranks by the
// time they wrote their error.
std::vector<size_t> failures_in_order(const std::vector<Child>& children,
                                      const std::vector<size_t>& exit_order,
                                      const std::string& dir) {
  std::vector<std::pair<int64_t, size_t>> failed;
  for (size_t i : exit_order) {
    if (children[i].status != 0) {
      const int64_t when = read_error(dir, static_cast<int>(i)).first;
      failed.emplace_back(when == std::numeric_limits<int64_t>::max() ? -1 : when, i);
    }
  }
  std::stable_sort(failed.begin(), failed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<size_t> ranks;
  for (const auto& f : failed) {
    ranks.push_back(f.second);
  }
  return ranks;
}

}  // namespace

std::string run_scratch_dir() { return g_scratch_dir; }

bool is_run_rank() { return env(kEnvRank).has_value(); }

namespace {

// Whether a launcher (torchrun) set the four env:// variables; some but not all of them is a
// mistake that would otherwise start this program's own ranks in every launched process.
bool launched_by_env() {
  std::vector<std::string> missing;
  bool any = false;
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    if (env(name)) {
      any = true;
    } else {
      missing.emplace_back(name);
    }
  }
  TORCH_CHECK_VALUE(!any || missing.empty(),
                    "dist::run: the env:// variables are set only in "
                    "part: ",
                    c10::Join(", ", missing),
                    " missing. A launcher sets RANK, "
                    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT; unset them all to let run() start "
                    "its own ranks");
  return any;
}

// This process is one of a launcher's ranks: fn runs on the env:// group.
void run_launched(const std::function<void(int, int)>& fn, int world_size,
                  const RunOptions& options) {
  const int env_world = std::stoi(*env("WORLD_SIZE"));
  TORCH_CHECK_VALUE(env_world == world_size, "dist::run: launched with WORLD_SIZE=", env_world,
                    " but called with world_size=", world_size);
  init_process_group(
      {.backend = options.backend, .init_method = "env://", .timeout = options.group_timeout});
  const int rank = static_cast<int>(get_rank());
  try {
    fn(rank, world_size);  // no leave_together(): the other ranks may not be ours
  } catch (...) {
    destroy_process_group();
    throw;
  }
  destroy_process_group();
}

// Starts `world_size` copies of this program (or options.argv) as the ranks of run() call
// `call`, each with its rank and the shared scratch directory in its environment.
std::vector<Child> start_ranks(int world_size, int call, const std::string& dir,
                               const RunOptions& options) {
  // Everything exec needs is built before fork: between fork and exec the child may only make
  // async-signal-safe calls.
  std::vector<std::string> args = options.argv.empty() ? own_command_line() : options.argv;
  std::vector<char*> argv;
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  argv.push_back(nullptr);
  std::vector<std::string> base_env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "TENSORDICT_RUN_", 15) != 0) {
      base_env.emplace_back(*e);
    }
  }
  const pid_t parent = ::getpid();
  std::vector<std::vector<std::string>> envs(world_size, base_env);
  std::vector<std::vector<char*>> envps(world_size);
  for (int r = 0; r < world_size; ++r) {
    auto& e = envs[r];
    e.push_back(c10::str(kEnvRank, "=", r));
    e.push_back(c10::str(kEnvWorldSize, "=", world_size));
    e.push_back(c10::str(kEnvDir, "=", dir));
    // A custom command line starts a program that reaches its own first run() call.
    e.push_back(c10::str(kEnvIndex, "=", options.argv.empty() ? call : 0));
    e.push_back(c10::str(kEnvParent, "=", parent));
    for (auto& s : e) {
      envps[r].push_back(s.data());
    }
    envps[r].push_back(nullptr);
  }

  std::vector<Child> children(world_size);
  for (int r = 0; r < world_size; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) {
        ::_exit(127);
      }
      ::execve("/proc/self/exe", argv.data(), envps[r].data());
      ::_exit(127);
    }
    if (pid < 0) {
      const int err = errno;
      kill_and_reap(children);
      TORCH_CHECK(false, "dist::run: fork failed: ", std::strerror(err));
    }
    children[r].pid = pid;
    children[r].pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  }
  return children;
}

// Waits for every rank: returns when all exited cleanly; on the first failure (or the timeout)
// kills the others and raises, with the failed rank's own error.
void supervise(std::vector<Child>& children, const std::string& dir, const RunOptions& options) {
  const bool have_pidfds =
      std::all_of(children.begin(), children.end(), [](const Child& c) { return c.pidfd >= 0; });
  const auto start = std::chrono::steady_clock::now();
  std::vector<size_t> exit_order;
  while (true) {
    reap(children, exit_order);
    if (any_failed(children)) {
      // A short grace lets the ranks the failure took with it exit too, so the cause is known.
      const auto grace_end = std::chrono::steady_clock::now() + kFailureGrace;
      while (exit_order.size() < children.size() && std::chrono::steady_clock::now() < grace_end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        reap(children, exit_order);
      }
      kill_and_reap(children);
      const std::vector<size_t> failed = failures_in_order(children, exit_order, dir);
      const size_t first = failed.front();
      const std::string message = read_error(dir, static_cast<int>(first)).second;
      std::string others;
      for (size_t k = 1; k < failed.size(); ++k) {
        others += c10::str(others.empty() ? "; then rank " : ", rank ", failed[k], " (",
                           describe_status(children[failed[k]].status), ")");
      }
      TORCH_CHECK(false, "dist::run: rank ", first, " failed (",
                  describe_status(children[first].status), ")",
                  message.empty() ? std::string() : ": " + message, others);
    }
    if (exit_order.size() == children.size()) {
      kill_and_reap(children);  // closes the pidfds
      return;
    }
    auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    int wait_ms = 100;
    if (options.timeout.count() > 0) {
      if (elapsed >= options.timeout) {
        std::string running;
        for (size_t i = 0; i < children.size(); ++i) {
          if (!children[i].done) {
            running += (running.empty() ? "" : ", ") + std::to_string(i);
          }
        }
        kill_and_reap(children);
        TORCH_CHECK(false, "dist::run: timed out after ", options.timeout.count(),
                    " ms; ranks still running: ", running);
      }
      wait_ms = static_cast<int>(std::min<int64_t>(wait_ms, (options.timeout - elapsed).count()));
    }
    if (have_pidfds) {
      // Block until some rank exits (or the next deadline check).
      std::vector<pollfd> fds;
      for (auto& c : children) {
        if (!c.done) {
          fds.push_back({c.pidfd, POLLIN, 0});
        }
      }
      ::poll(fds.data(), fds.size(), std::max(wait_ms, 1));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

}  // namespace

void run(const std::function<void(int, int)>& fn, int world_size, const RunOptions& options) {
  TORCH_CHECK_VALUE(world_size >= 1, "dist::run: world_size must be positive, got ", world_size);
  const bool launched = launched_by_env();
  const int call = g_run_calls++;
  if (is_run_rank()) {
    // Ranks count run() calls from their own start: the one that started them runs fn.
    const int target = std::stoi(env(kEnvIndex).value_or("0"));
    if (call < target) {
      return;  // an earlier run() of the program: the caller process runs it, not this rank
    }
    TORCH_CHECK(call == target, "dist::run: a rank reached run() call ", call,
                " but was started for call ", target);
    run_as_rank(fn, options);
  }
  if (launched) return run_launched(fn, world_size, options);

  // The caller: start the ranks in a scratch directory of their own, and wait for them.
  std::string tmpl = (std::filesystem::temp_directory_path() / "tensordict-run-XXXXXX").string();
  TORCH_CHECK(::mkdtemp(tmpl.data()) != nullptr,
              "dist::run: mkdtemp failed: ", std::strerror(errno));
  const std::string dir = tmpl;
  struct DirGuard {
    std::string path;
    ~DirGuard() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } dir_guard{dir};
  std::vector<Child> children = start_ranks(world_size, call, dir, options);
  supervise(children, dir, options);
}

}  // namespace tensordict::dist

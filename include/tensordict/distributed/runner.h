#pragma once
// dist::run: start world_size ranks of this program on this host, like
// torch.multiprocessing.spawn, or join a torchrun launch.

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace tensordict::dist {

struct RunOptions {
  std::string backend = "gloo";
  /// Whole-run deadline: when it passes, every rank still running is killed and run() throws.
  /// Zero means none.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  /// Timeout of the default group each rank gets (its blocking c10d calls give up after it).
  std::chrono::milliseconds group_timeout = std::chrono::seconds(60);
  /// Give each rank a default process group (Gloo over 127.0.0.1, a FileStore in the run's
  /// scratch directory). Off: fn builds its own groups, e.g. on run_scratch_dir().
  bool init_process_group = true;
  /// Command line of the ranks (argv[0] is only a name: the ranks run this program's
  /// executable); empty: this program's own (/proc/self/cmdline). With a custom command line a
  /// rank runs fn at the first run() call it reaches: a test binary passes a filter that
  /// selects the calling test.
  std::vector<std::string> argv{};
};

/// Runs fn(rank, world_size) on world_size ranks and returns when all of them have returned.
///
/// How: the ranks are fresh processes of this program (fork, then exec, so no thread of the
/// caller is copied), started with the same command line and marked by environment
/// variables. A rank runs the program from main() again until it reaches the same run() call
/// (counted by order, so earlier run() calls return at once in a rank); there run() calls fn
/// with a default process group, then ends the process (exit code 0, or 1 with fn's error).
/// The program must therefore reach that call deterministically, as with Python's "spawn".
/// Ranks die with the caller (PR_SET_PDEATHSIG).
///
/// The caller waits without spinning. As soon as one rank fails (non-zero exit, signal) or
/// the timeout passes, it kills the others and throws c10::Error with that rank's error text.
///
/// Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) run() does not start
/// processes: it initialises the default group with env://, calls fn in this process and
/// returns. ValueError if WORLD_SIZE differs from world_size.
void run(const std::function<void(int rank, int world_size)>& fn, int world_size,
         const RunOptions& options = {});

/// Inside fn, a directory shared by the ranks of the current run(), removed when it ends
/// (for extra FileStores and files); empty elsewhere, and under torchrun.
std::string run_scratch_dir();

/// True in a process that run() started as a rank.
bool is_run_rank();

}  // namespace tensordict::dist

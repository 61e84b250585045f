#pragma once
// Fault-injection tests: a test body runs as several real processes ("roles"), each one this
// test binary re-executed with a filter selecting the current test and TD_FAULT_ROLE set. Unlike
// dist::run (which kills every rank as soon as one fails), the parent here waits for each child
// on its own, so a test can SIGKILL one process mid-transfer and then check that the survivor
// raised in time and exited 0. Roles talk through small files in a fresh temporary directory;
// times are CLOCK_MONOTONIC (std::chrono::steady_clock), which is shared by every process.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace fault_test {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

inline constexpr const char* kRoleEnv = "TD_FAULT_ROLE";
inline constexpr const char* kDirEnv = "TD_FAULT_DIR";

inline std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::optional<std::string>(v) : std::nullopt;
}
/// The role of this process, or nullopt in the parent (the test itself).
inline std::optional<std::string> role() { return env(kRoleEnv); }
/// The directory shared by the roles of the current test (in a role).
inline std::string role_dir() { return env(kDirEnv).value_or(""); }

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

inline void write_file(const std::string& path, const std::string& text) {
  // Written under a temporary name then renamed: a reader never sees half a file.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
  }
  std::filesystem::rename(tmp, path);
}

inline std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// Waits up to `timeout` for a file to appear; its text, or nullopt.
inline std::optional<std::string> await_file(const std::string& path,
                                             std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (auto text = read_file(path)) return text;
    std::this_thread::sleep_for(5ms);
  }
  return std::nullopt;
}

/// A fresh temporary directory, removed with its contents at the end of the scope.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "td-fault-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// Records the kill time in <dir>/<name>.killed, then SIGKILLs this process.
[[noreturn]] inline void kill_self(const std::string& name) {
  write_file(role_dir() + "/" + name + ".killed", std::to_string(now_ns()));
  std::raise(SIGKILL);
  std::abort();  // unreachable
}

/// The kill time a victim recorded, or nullopt.
inline std::optional<int64_t> kill_time(const std::string& dir, const std::string& name) {
  auto text = read_file(dir + "/" + name + ".killed");
  if (!text) return std::nullopt;
  return std::stoll(*text);
}

/// A field of /proc/self/io (rchar, wchar: bytes through read()/write() family calls, sockets
/// included), or -1 when unreadable.
inline int64_t io_counter(const std::string& field) {
  std::ifstream in("/proc/self/io");
  std::string name;
  int64_t value = 0;
  while (in >> name >> value) {
    if (name == field + ":") return value;
  }
  return -1;
}

/// Starts this test binary again as `role` (the current test only), with dir and extra
/// environment; the child dies with this process.
inline pid_t spawn_role(const std::string& role, const std::string& dir,
                        const std::vector<std::pair<std::string, std::string>>& extra = {}) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::vector<std::string> args = {
      "fault_tests", std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name(),
      "--gtest_brief=1"};
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "TD_FAULT_", 9) != 0) envs.emplace_back(*e);
  }
  envs.push_back(std::string(kRoleEnv) + "=" + role);
  envs.push_back(std::string(kDirEnv) + "=" + dir);
  for (const auto& [k, v] : extra) envs.push_back(k + "=" + v);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::execve("/proc/self/exe", argv.data(), envp.data());
    ::_exit(127);
  }
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  return pid;
}

/// Waits up to `timeout` for a child; its wait status, or nullopt after killing it on timeout.
inline std::optional<int> wait_child(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) return status;
    if (got < 0 && errno != EINTR) return std::nullopt;
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return std::nullopt;
    }
    std::this_thread::sleep_for(10ms);
  }
}

inline std::string describe(std::optional<int> status) {
  if (!status) return "timed out (killed by the test)";
  if (WIFEXITED(*status)) return "exit code " + std::to_string(WEXITSTATUS(*status));
  if (WIFSIGNALED(*status)) return "killed by signal " + std::to_string(WTERMSIG(*status));
  return "status " + std::to_string(*status);
}
inline bool exited_cleanly(std::optional<int> status) {
  return status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0;
}
inline bool was_sigkilled(std::optional<int> status) {
  return status && WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL;
}

/// A failure message that says who failed: the peer's address, a lost connection, or the
/// timeout.
inline bool names_peer_or_timeout(const std::string& msg) {
  const bool peer =
      msg.find("127.0.0.1") != std::string::npos &&
      (msg.find("peer") != std::string::npos || msg.find("onnection") != std::string::npos);
  const bool timeout =
      msg.find("imed out") != std::string::npos || msg.find("timeout") != std::string::npos;
  return peer || timeout;
}

inline double to_ms(std::chrono::milliseconds d) { return static_cast<double>(d.count()); }
inline double ms_between(int64_t from_ns, int64_t to_ns) { return (to_ns - from_ns) / 1e6; }

}  // namespace fault_test

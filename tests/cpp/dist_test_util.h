#pragma once
// Multi-process test support: a test body runs on N real processes, each one this test binary
// re-executed with a filter selecting the current test (dist::run does the launching, the
// PR_SET_PDEATHSIG, the FileStore in a fresh temporary directory, the exit-code checks and the
// watchdog). A rank's gtest failures make that rank fail, so the caller's test fails with it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>

#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/runner.h"
#include "tensordict/errors.h"

namespace tensordict::testing {

struct RanksOptions {
  std::chrono::milliseconds watchdog = std::chrono::seconds(60);       // whole test
  std::chrono::milliseconds group_timeout = std::chrono::seconds(20);  // each c10d wait
  bool init_process_group = true;
};

/// The name of the most derived of our typed errors (tensordict/errors.h) that `e` is, or
/// "c10::Error" when it is none of them.
inline std::string kind_of(const c10::Error& e) {
  if (dynamic_cast<const TimeoutError*>(&e)) return "TimeoutError";
  if (dynamic_cast<const PeerLostError*>(&e)) return "PeerLostError";
  if (dynamic_cast<const PipeClosedError*>(&e)) return "PipeClosedError";
  if (dynamic_cast<const PeerClosedError*>(&e)) return "PeerClosedError";
  if (dynamic_cast<const SchemaMismatchError*>(&e)) return "SchemaMismatchError";
  if (dynamic_cast<const MalformedPeerDataError*>(&e)) return "MalformedPeerDataError";
  if (dynamic_cast<const NoPublisherError*>(&e)) return "NoPublisherError";
  return "c10::Error";
}

/// The message of the c10::Error that fn throws, or "<no error>"; its kind_of in `kind`.
inline std::string error_of(const std::function<void()>& fn, std::string* kind = nullptr) {
  try {
    fn();
  } catch (const c10::Error& e) {
    if (kind) *kind = kind_of(e);
    return e.msg();
  }
  if (kind) kind->clear();
  return "<no error>";
}

/// A string's bytes as a 1-D uint8 CPU tensor: what a raw peer sends.
inline at::Tensor bytes_of(const std::string& s) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());  // null data when empty
  return t;
}

/// 64-bit FNV-1a, the hash of checked transfers (docs/reliability.md), for tests that forge them.
inline uint64_t fnv1a(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

/// The tag of the "go on" messages between the ranks of a test, so that no step of it depends
/// on timing.
inline constexpr int kReady = 9000;
/// One small message on kReady to `dst` of the default group: "go on".
inline void ready(int dst) {
  std::vector<at::Tensor> one{at::ones({1})};
  dist::default_group()->send(one, dst, kReady)->wait();
}
/// Waits for `src`'s "go on".
inline void await_ready(int src) {
  std::vector<at::Tensor> one{at::zeros({1})};
  dist::default_group()->recv(one, src, kReady)->wait();
}

inline void run_ranks(int world_size, const std::function<void(int rank, int world_size)>& fn,
                      RanksOptions options = {}) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter =
      std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  dist::RunOptions run_options;
  run_options.timeout = options.watchdog;
  run_options.group_timeout = options.group_timeout;
  run_options.init_process_group = options.init_process_group;
  run_options.argv = {"dist_tests", filter, "--gtest_brief=1"};
  dist::run(
      [&](int rank, int size) {
        at::set_num_threads(1);
        fn(rank, size);
        if (::testing::Test::HasFailure()) {
          throw std::runtime_error("a gtest expectation failed on this rank (see its output)");
        }
      },
      world_size, run_options);
}

}  // namespace tensordict::testing

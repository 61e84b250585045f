#pragma once
// Helpers of the UCX pipe tests: a watchdog per test, error-message checks, TensorDict
// comparison by bytes, and counts of open file descriptors and threads.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>

#include "expect_throw.h"
#include "tensordict/consolidate.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/tensor_dict.h"

namespace pipe_test {

// UCX over loopback TCP unless the caller chose otherwise: set before any UCX context exists
// (static initialisation), and inherited by child processes. Done here rather than in CTest's
// ENVIRONMENT, which gtest_discover_tests cuts down to its first variable.
inline const bool kUcxLoopbackDefaults = [] {
  ::setenv("UCX_TLS", "tcp", 0);
  ::setenv("UCX_NET_DEVICES", "lo", 0);
  ::setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
  return true;
}();

using namespace std::chrono_literals;

// Aborts the process when a test outlives its budget: a hang must fail, loudly, not stall.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds budget) {
    thread_ = std::thread([this, budget] {
      std::unique_lock<std::mutex> lk(mu_);
      if (!cv_.wait_for(lk, budget, [&] { return done_; })) {
        std::fprintf(stderr, "watchdog: test exceeded %llds\n",
                     static_cast<long long>(budget.count()));
        std::abort();
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

inline int count_dir(const char* path) {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(path)) ++n;
  return n;
}
inline int open_fds() { return count_dir("/proc/self/fd"); }
inline int threads() { return count_dir("/proc/self/task"); }

inline tensordict::pipe::PipeOptions fast_options(bool consolidated = true) {
  tensordict::pipe::PipeOptions o;
  o.consolidated = consolidated;
  o.timeout = 10s;
  return o;
}

inline bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  auto ca = a.contiguous(), cb = b.contiguous();
  // An empty tensor's data pointer may be null, and memcmp(nullptr, ..., 0) is undefined.
  return ca.scalar_type() == cb.scalar_type() && ca.sizes() == cb.sizes() &&
         (ca.nbytes() == 0 ||
          std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0);
}

// The data with every map's keys sorted: the consolidated pipe sends the metadata as
// json.dumps(sort_keys=True) does, so maps arrive sorted, as in the reference.
inline tensordict::JsonValue sorted_maps(const tensordict::JsonValue& v) {
  using tensordict::JsonValue;
  if (v.is_list()) {
    JsonValue::List out;
    for (const auto& item : v.as_list()) out.push_back(sorted_maps(item));
    return out;
  }
  if (!v.is_map()) return v;
  JsonValue::Map out;
  for (const auto& [k, item] : v.as_map()) out.emplace_back(k, sorted_maps(item));
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

// Same keys (at every level), dtypes, shapes and bytes; same non-tensor data (maps in any
// order) and batch sizes.
inline void expect_same(const tensordict::TensorDict& a, const tensordict::TensorDict& b) {
  auto ia = a.items({.include_nested = true, .leaves_only = true});
  auto ib = b.items({.include_nested = true, .leaves_only = true});
  ASSERT_EQ(ia.size(), ib.size());
  for (const auto& [key, value] : ia) {
    ASSERT_TRUE(b.contains(key)) << key;
    EXPECT_TRUE(same_bytes(value.tensor(), b.get(key).tensor())) << key;
  }
  size_t non_tensors = 0;
  for (const auto& [key, value] : a.items({.include_nested = true})) {
    if (!value.is_non_tensor()) continue;
    ++non_tensors;
    ASSERT_TRUE(b.contains(key)) << key;
    const tensordict::Value other = b.get(key);
    ASSERT_TRUE(other.is_non_tensor()) << key;
    EXPECT_EQ(sorted_maps(value.non_tensor().data()).dump(),
              sorted_maps(other.non_tensor().data()).dump())
        << key;
    EXPECT_EQ(value.non_tensor().batch_size(), other.non_tensor().batch_size()) << key;
  }
  size_t theirs = 0;
  for (const auto& [key, value] : b.items({.include_nested = true}))
    theirs += value.is_non_tensor();
  EXPECT_EQ(non_tensors, theirs);
  EXPECT_EQ(a.batch_size(), b.batch_size());
}

// docs/wire-format.md §3.4: a=float32[4], b=float32[4,3], c={d: int64[4]}, batch [4].
inline tensordict::TensorDict worked_example(float offset = 0) {
  using tensordict::TensorDict;
  TensorDict c({{"d", at::arange(4, at::kLong) + static_cast<int64_t>(offset)}}, {4});
  return TensorDict({{"a", at::arange(4, at::kFloat) + offset},
                     {"b", at::arange(12, at::kFloat).view({4, 3}) + offset},
                     {"c", c}},
                    {4});
}

}  // namespace pipe_test

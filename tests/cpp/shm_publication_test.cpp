// Publication over shared memory (docs/publication.md "Shared memory"), on real processes over
// Gloo on 127.0.0.1: a publisher on rank 0 publishing back to back, subscribers on the other
// ranks pulling by copy and zero-copy never see a torn version, a subscriber that cannot map
// the segments is served over its socket beside them and says why, and nothing is left in
// /proc/self/fd once both ends are gone. Kills and stops are in shm_fault_test.cpp.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "dist_test_util.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {
namespace {

using namespace std::chrono_literals;
using testing::await_ready;
using testing::ready;
using testing::run_ranks;

constexpr int64_t kVersions = 20000;

// A version: every element of every leaf is `v` (64 KiB of float32, 800 bytes of int64).
TensorDict version(int64_t v) {
  return TensorDict(
      {{"w", at::full({16384}, static_cast<float>(v))}, {"step", at::full({100}, v, at::kLong)}},
      {});
}

// Every element of every leaf is `v`: a torn version has some of another.
bool whole(const TensorDict& td, int64_t v) {
  return td.get("w").tensor().eq(static_cast<float>(v)).all().item<bool>() &&
         td.get("step").tensor().eq(v).all().item<bool>();
}

size_t open_fds() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST(SharedMemoryPublication, NeverTornByCopyOrZeroCopyBesideASocketSubscriber) {
  // Rank 1 and 2 pull by copy, rank 3 zero-copy, rank 4 cannot map (a test hook) and is served
  // over its socket.
  run_ranks(
      5,
      [](int rank, int) {
        if (rank == 0) {
          const size_t fds = open_fds();
          {
            dist::Publisher pub({.max_slots = 3});
            TensorDict td = version(0);
            for (int64_t v = 1; v <= kVersions; ++v) {
              td.get("w").tensor().fill_(static_cast<float>(v));
              td.get("step").tensor().fill_(v);
              ASSERT_EQ(pub.publish(td, 10s), v);
            }
            for (int r = 1; r <= 4; ++r) await_ready(r);
            const auto stats = pub.stats();
            for (int r = 0; r < 3; ++r) {
              EXPECT_EQ(stats[r].transport, "shm") << stats[r].peer;
              EXPECT_EQ(stats[r].version, kVersions) << stats[r].peer;
            }
            EXPECT_EQ(stats[3].transport,
                      "socket (shared memory refused: the subscriber could not open or map the "
                      "segments)");
            for (const auto& s : stats) EXPECT_FALSE(s.lost) << s.peer << ": " << s.error;
            for (int r = 1; r <= 4; ++r) ready(r);
          }
          EXPECT_EQ(open_fds(), fds);  // the segments' descriptors closed with the Publisher
          return;
        }
        if (rank == 4) ::setenv("TENSORDICT_TEST_SHM_UNMAPPABLE", "1", 1);
        const size_t fds = open_fds();
        int64_t pulls = 0, torn = 0, last = 0;
        std::string transport;
        {
          dist::Subscriber sub({.src = 0});
          const bool zero_copy = rank == 3;
          TensorDict td = version(0);
          while (last < kVersions) {
            const auto v = sub.pull(td, {.timeout = 20s, .zero_copy = zero_copy});
            ASSERT_TRUE(v.has_value()) << "after version " << last;
            ASSERT_GT(*v, last);
            torn += !whole(td, *v);
            last = *v;
            ++pulls;
          }
          transport = sub.transport();
          ready(0);
          await_ready(0);
        }
        std::printf("[shm] rank %d (%s%s): %lld pulls, %lld torn\n", rank, transport.c_str(),
                    rank == 3 ? ", zero-copy" : "", static_cast<long long>(pulls),
                    static_cast<long long>(torn));
        EXPECT_EQ(torn, 0);
        EXPECT_EQ(transport, rank == 4 ? "socket (shared memory refused: "
                                         "TENSORDICT_TEST_SHM_UNMAPPABLE is set (a test hook))"
                                       : "shm");
        EXPECT_EQ(open_fds(), fds);  // nothing of the publisher's kept open
      },
      {.watchdog = 120s});
}

}  // namespace
}  // namespace tensordict

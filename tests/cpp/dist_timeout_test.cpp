// Timeouts that keep the group (docs/reliability.md, "Timeouts"): a call whose own timeout
// passes raises TimeoutError, leaves its TensorDict unchanged, and the group goes on working on
// every pair; the late message is delivered to the next receive from that peer on its tags
// (late="deliver") or dropped (late="drop"); a send that timed out stays queued. Three ranks:
// rank 0 sends, rank 1 receives, rank 2 checks the other pairs. Readiness travels as messages
// on a tag of its own (testing::kReady), so that no step depends on timing.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "dist_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/init_remote.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/errors.h"
#include "tensordict/tensor_dict.h"
#include "wire/leaf_order.h"

namespace tensordict {
namespace {

using namespace std::chrono_literals;
using testing::await_ready;
using testing::error_of;
using testing::ready;
using testing::run_ranks;

constexpr auto kShort = 300ms;

TensorDict filled(double v, int64_t n = 4) {
  TensorDict inner({{"b", at::full({n, 3}, v, at::kDouble)}}, {n});
  return TensorDict({{"a", at::full({n}, v)},
                     {"n", inner},
                     {"c", at::full({n}, static_cast<int64_t>(v), at::kLong)}},
                    {n});
}

double value_of(const TensorDict& td) { return td.get("a").tensor()[0].item<double>(); }

bool all_equal(const TensorDict& td, double v) {
  for (const auto& [path, leaf] : wire::leaves_in_order(td)) {
    if (!leaf.eq(v).all().item<bool>()) return false;
  }
  return true;
}

// Every pair of the three ranks still moves a TensorDict, and barrier() completes.
void check_every_pair(int rank) {
  for (auto [from, to] : {std::pair{0, 1}, {1, 0}, {0, 2}, {2, 0}, {1, 2}, {2, 1}}) {
    const double v = 100 + from * 10 + to;
    if (rank == from) dist::send(filled(v), to, {.init_tag = 50});
    if (rank == to) {
      TensorDict td = filled(0);
      dist::recv(td, from, {.init_tag = 50, .timeout = 20s});
      EXPECT_TRUE(all_equal(td, v)) << from << " -> " << to;
    }
  }
  dist::default_group()->barrier()->wait();
}

struct Mode {
  bool consolidated;
  bool checked;
};

class Timeouts : public ::testing::TestWithParam<Mode> {};

std::string mode_name(const ::testing::TestParamInfo<Mode>& info) {
  return std::string(info.param.consolidated ? "Consolidated" : "PerLeaf") +
         (info.param.checked ? "Checked" : "");
}

TensorDict target(const Mode& m, double v) {
  TensorDict td = filled(v);
  return m.consolidated ? consolidate(td) : td;
}

// Three receives time out while the sender is silent; the TensorDict keeps its values; then
// five transfers arrive in order (the first one in the late receive), and every pair works.
TEST_P(Timeouts, ThreeTimedOutReceivesThenFiveTransfersAndEveryPair) {
  const Mode m = GetParam();
  run_ranks(3, [m](int rank, int) {
    if (rank == 1) {
      TensorDict td = target(m, -1);
      for (int i = 0; i < 3; ++i) {
        std::string kind;
        const std::string error = error_of(
            [&] {
              dist::recv(td, 0,
                         {.consolidated = m.consolidated, .checked = m.checked, .timeout = kShort});
            },
            &kind);
        EXPECT_EQ(kind, "TimeoutError") << error;
        EXPECT_NE(error.find("The group stays usable"), std::string::npos) << error;
        EXPECT_TRUE(all_equal(td, -1)) << "a timed-out receive wrote the TensorDict";
      }
      ready(0);
      for (int v = 1; v <= 5; ++v) {
        dist::recv(td, 0, {.consolidated = m.consolidated, .checked = m.checked, .timeout = 20s});
        EXPECT_TRUE(all_equal(td, v)) << "transfer " << v << " got " << value_of(td);
      }
    } else if (rank == 0) {
      await_ready(1);
      for (int v = 1; v <= 5; ++v) {
        dist::send(target(m, v), 1, {.consolidated = m.consolidated, .checked = m.checked});
      }
    }
    check_every_pair(rank);
  });
}

// late="drop": the late transfer is received and dropped; the next one lands.
TEST_P(Timeouts, DropSkipsTheLateTransfer) {
  const Mode m = GetParam();
  run_ranks(3, [m](int rank, int) {
    if (rank == 1) {
      TensorDict td = target(m, -1);
      EXPECT_THROW(
          dist::recv(td, 0,
                     {.consolidated = m.consolidated, .checked = m.checked, .timeout = kShort}),
          TimeoutError);
      ready(0);
      dist::recv(td, 0,
                 {.consolidated = m.consolidated,
                  .checked = m.checked,
                  .timeout = 20s,
                  .late = dist::Late::kDrop});
      EXPECT_TRUE(all_equal(td, 2)) << "got " << value_of(td);
      dist::recv(td, 0, {.consolidated = m.consolidated, .checked = m.checked});
      EXPECT_TRUE(all_equal(td, 3)) << "got " << value_of(td);
    } else if (rank == 0) {
      await_ready(1);
      for (int v = 1; v <= 3; ++v) {
        dist::send(target(m, v), 1, {.consolidated = m.consolidated, .checked = m.checked});
      }
    }
    check_every_pair(rank);
  });
}

// A send that times out stays queued: the receiver that comes later gets it, then the next.
TEST_P(Timeouts, ATimedOutSendStaysQueued) {
  const Mode m = GetParam();
  run_ranks(3, [m](int rank, int) {
    if (rank == 0) {
      std::string kind;
      const std::string error = error_of(
          [&] {
            dist::send(target(m, 7), 1,
                       {.consolidated = m.consolidated, .checked = m.checked, .timeout = kShort});
          },
          &kind);
      EXPECT_EQ(kind, "TimeoutError") << error;
      EXPECT_NE(error.find("the send stays queued"), std::string::npos) << error;
      ready(1);
      dist::send(target(m, 8), 1, {.consolidated = m.consolidated, .checked = m.checked});
    } else if (rank == 1) {
      await_ready(0);
      TensorDict td = target(m, -1);
      dist::recv(td, 0, {.consolidated = m.consolidated, .checked = m.checked});
      EXPECT_TRUE(all_equal(td, 7)) << "got " << value_of(td);
      dist::recv(td, 0, {.consolidated = m.consolidated, .checked = m.checked});
      EXPECT_TRUE(all_equal(td, 8)) << "got " << value_of(td);
    }
    check_every_pair(rank);
  });
}

INSTANTIATE_TEST_SUITE_P(Modes, Timeouts,
                         ::testing::Values(Mode{false, false}, Mode{true, false}, Mode{false, true},
                                           Mode{true, true}),
                         mode_name);

// 100 receives time out on one pair; then 100 transfers of 100 succeed on it, per leaf and
// consolidated, and the other pairs work.
TEST(TimeoutsMany, HundredTimeoutsThenHundredTransfers) {
  run_ranks(3, [](int rank, int) {
    if (rank == 1) {
      TensorDict td = filled(-1);
      int timeouts = 0;
      for (int i = 0; i < 100; ++i) {
        try {
          dist::recv(td, 0, {.timeout = 10ms});
        } catch (const TimeoutError&) {
          ++timeouts;
        }
      }
      EXPECT_EQ(timeouts, 100);
      EXPECT_TRUE(all_equal(td, -1));
      ready(0);
      int ok = 0;
      for (int v = 1; v <= 100; ++v) {
        dist::recv(td, 0, {.timeout = 20s});
        ok += all_equal(td, v) ? 1 : 0;
      }
      TensorDict c = consolidate(filled(-1));
      for (int v = 1; v <= 100; ++v) {
        dist::recv(c, 0, {.consolidated = true, .timeout = 20s});
        ok += all_equal(c, v) ? 1 : 0;
      }
      EXPECT_EQ(ok, 200);
    } else if (rank == 0) {
      await_ready(1);
      for (int v = 1; v <= 100; ++v) dist::send(filled(v), 1);
      for (int v = 1; v <= 100; ++v) dist::send(consolidate(filled(v)), 1, {.consolidated = true});
    }
    check_every_pair(rank);
  });
}

// A late message that this receive's TensorDict cannot hold is refused by name and kept; the
// receive it fits then gets it.
TEST(TimeoutsMany, ALateMessageOfAnotherLayoutIsRefusedAndKept) {
  run_ranks(3, [](int rank, int) {
    if (rank == 1) {
      TensorDict td = filled(-1);
      EXPECT_THROW(dist::recv(td, 0, {.timeout = kShort}), TimeoutError);
      TensorDict wider = filled(-1, 8);
      const std::string error = error_of([&] { dist::recv(wider, 0, {.timeout = 5s}); });
      EXPECT_NE(error.find("a late message from rank 0 on tag 0"), std::string::npos) << error;
      EXPECT_NE(error.find("late=\"drop\""), std::string::npos) << error;
      EXPECT_TRUE(all_equal(wider, -1));
      ready(0);
      dist::recv(td, 0, {.timeout = 20s});
      EXPECT_TRUE(all_equal(td, 1));
    } else if (rank == 0) {
      await_ready(1);
      dist::send(filled(1), 1);
    }
    check_every_pair(rank);
  });
}

// from_remote_init: a timed-out call leaves the transfer for the next one (deliver), or the
// next one drops it; init_remote's send that timed out stays queued.
TEST(TimeoutsMany, FromRemoteInitKeepsTheLateTransfer) {
  run_ranks(3, [](int rank, int) {
    if (rank == 1) {
      EXPECT_THROW(dist::from_remote_init(0, {.timeout = kShort}), TimeoutError);
      ready(0);
      EXPECT_TRUE(all_equal(dist::from_remote_init(0, {.timeout = 20s}), 1));
      EXPECT_THROW(dist::from_remote_init(0, {.timeout = kShort}), TimeoutError);
      ready(0);
      EXPECT_TRUE(
          all_equal(dist::from_remote_init(0, {.timeout = 20s, .late = dist::Late::kDrop}), 3));
    } else if (rank == 0) {
      await_ready(1);
      dist::init_remote(filled(1), 1);
      await_ready(1);
      dist::init_remote(filled(2), 1);
      dist::init_remote(filled(3), 1);
      // A sender whose receiver is late: its timeout passes, the transfer stays queued.
      EXPECT_THROW(dist::init_remote(filled(4), 1, {.timeout = kShort}), TimeoutError);
      ready(1);
    }
    if (rank == 1) {
      await_ready(0);
      EXPECT_TRUE(all_equal(dist::from_remote_init(0), 4));
    }
    check_every_pair(rank);
  });
}

// irecv(return_premature) works: wait(timeout) that times out raises TimeoutError and leaves
// the work posted; a later wait() completes it.
TEST(TimeoutsMany, APrematureWorkWaitsAgainAfterItsTimeout) {
  run_ranks(3, [](int rank, int) {
    if (rank == 1) {
      TensorDict td = filled(-1);
      auto works = dist::irecv_premature(td, 0);
      EXPECT_THROW(works.front()->wait(kShort), TimeoutError);
      ready(0);
      for (auto& w : works) w->wait();
      EXPECT_TRUE(all_equal(td, 5));
    } else if (rank == 0) {
      await_ready(1);
      dist::send(filled(5), 1);
    }
    check_every_pair(rank);
  });
}

}  // namespace
}  // namespace tensordict

// The process-group layer and the runner, on real processes.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include "dist_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/runner.h"
#include "tensordict/log.h"
#include "tensordict/tensor_dict.h"
#include "tensordict/transfer_stats.h"

namespace tensordict::dist {
namespace {

using testing::error_of;
using testing::run_ranks;
using Clock = std::chrono::steady_clock;

TEST(DistRunner, EveryRankRunsWithADefaultGroup) {
  run_ranks(3, [](int rank, int world_size) {
    ASSERT_TRUE(is_initialized());
    EXPECT_EQ(world_size, 3);
    EXPECT_EQ(get_rank(), rank);
    EXPECT_EQ(get_world_size(), 3);
    EXPECT_TRUE(is_run_rank());
    EXPECT_FALSE(run_scratch_dir().empty());
    // A collective proves the group is real and shared.
    std::vector<at::Tensor> t{at::full({1}, rank + 1.0)};
    default_group()->allreduce(t)->wait();
    EXPECT_EQ(t[0].item<double>(), 6.0);
  });
}

TEST(DistRunner, FailingRankFailsFastWithItsError) {
  const auto start = Clock::now();
  const std::string msg = error_of([] {
    run_ranks(2, [](int rank, int) {
      if (rank == 1) {
        throw std::runtime_error("boom from rank one");
      }
      // Rank 0 would wait for the whole group timeout; the runner must not.
      std::vector<at::Tensor> t{at::zeros({1})};
      default_group()->recv(t, 1, 0)->wait();
    });
  });
  EXPECT_NE(msg.find("rank 1 failed (exit code 1): boom from rank one"), std::string::npos) << msg;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(15));
}

// One run_ranks per test: a rank re-runs its test and stops at the first run() it meets.
TEST(DistRunner, ExitCodesAreReported) {
  const std::string msg = error_of([] {
    run_ranks(2, [](int rank, int) {
      if (rank == 0) {
        std::_Exit(3);
      }
    });
  });
  EXPECT_NE(msg.find("rank 0 failed (exit code 3)"), std::string::npos) << msg;
}

TEST(DistRunner, SignalsAreReported) {
  const std::string msg = error_of([] {
    run_ranks(2, [](int rank, int) {
      if (rank == 1) {
        std::raise(SIGKILL);
      }
    });
  });
  EXPECT_NE(msg.find("rank 1 failed (killed by signal 9"), std::string::npos) << msg;
}

TEST(DistRunner, WatchdogKillsHungRanks) {
  const auto start = Clock::now();
  const std::string msg = error_of([] {
    run_ranks(2, [](int, int) { std::this_thread::sleep_for(std::chrono::seconds(60)); },
              {.watchdog = std::chrono::seconds(2)});
  });
  EXPECT_NE(msg.find("timed out after 2000 ms; ranks still running: 0, 1"), std::string::npos)
      << msg;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

TEST(DistRunner, GtestFailureInARankFailsTheRun) {
  const std::string msg = error_of([] {
    // The rank's failure is recorded in the rank's process only; the test passes when the
    // runner turns it into an error here.
    run_ranks(1, [](int, int) {
      if (is_run_rank()) {
        ADD_FAILURE() << "expected failure inside a rank";
      }
    });
  });
  EXPECT_NE(msg.find("a gtest expectation failed on this rank"), std::string::npos) << msg;
}

TEST(DistRunner, RejectsBadWorldSize) {
  EXPECT_THROW(run([](int, int) {}, 0), c10::ValueError);
}

TEST(DistProcessGroup, NewGroupMapsGlobalAndGroupRanks) {
  run_ranks(3, [](int rank, int) {
    auto g = new_group({2, 1});
    if (rank == 0) {
      // Not a member: a handle every use refuses, not a null pointer that would mean "the
      // default group" to a transfer.
      ASSERT_EQ(g, non_group_member());
      const std::string msg = error_of([&] {
        tensordict::dist::send(TensorDict({{"a", at::ones({2})}}, {2}), 1, {.group = g});
      });
      EXPECT_NE(msg.find("send: this process is not a member of the group"), std::string::npos)
          << msg;
      EXPECT_THROW(get_rank(g), c10::ValueError);
      EXPECT_THROW(get_group_rank(g, 0), c10::ValueError);
      destroy_process_group(g);  // nothing to destroy, and no error
      return;
    }
    ASSERT_TRUE(g);
    EXPECT_EQ(get_rank(g), rank - 1);
    EXPECT_EQ(get_world_size(g), 2);
    EXPECT_EQ(get_group_rank(g, 1), 0);
    EXPECT_EQ(get_group_rank(g, 2), 1);
    EXPECT_EQ(get_global_rank(g, 0), 1);
    EXPECT_EQ(get_global_rank(g, 1), 2);
    EXPECT_EQ(get_process_group_ranks(g), (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(get_group_rank(default_group(), 2), 2);
    EXPECT_EQ(error_of([&] { get_group_rank(g, 0); }),
              "Global rank 0 is not part of group ProcessGroup '1'");
    std::vector<at::Tensor> t{at::full({1}, double(rank))};
    g->allreduce(t)->wait();
    EXPECT_EQ(t[0].item<double>(), 3.0);
    destroy_process_group(g);
    EXPECT_THROW(get_group_rank(g, 1), c10::ValueError);
  });
}

TEST(DistProcessGroup, RunRefusesEnvVariablesSetInPart) {
  // Half a launcher's environment must not make every launched process start its own ranks.
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    const char* v = std::getenv(name);
    saved[name] = v ? std::optional<std::string>(v) : std::nullopt;
    ::unsetenv(name);
  }
  ::setenv("RANK", "0", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  const std::string msg = error_of([] { run([](int, int) { std::abort(); }, 2); });
  for (const auto& [name, value] : saved) {
    if (value) {
      ::setenv(name.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  EXPECT_NE(msg.find("set only in part: WORLD_SIZE, MASTER_PORT missing"), std::string::npos)
      << msg;
}

TEST(DistProcessGroup, TransfersAreCountedAndLogged) {
  run_ranks(2, [](int rank, int) {
    std::vector<std::string> lines;
    set_log_sink([&](LogLevel, const std::string& line) { lines.push_back(line); });
    set_log_level(LogLevel::kInfo);
    reset_transfer_stats();
    TensorDict td({{"a", at::ones({4})}, {"b", at::ones({4, 3})}}, {4});
    if (rank == 0) {
      tensordict::dist::send(td, 1);
      tensordict::dist::send(td, 1, {.consolidated = true});
    } else {
      tensordict::dist::recv(td, 0);
      TensorDict into = tensordict::consolidate(td);
      tensordict::dist::recv(into, 0, {.consolidated = true});
    }
    set_log_sink({});
    set_log_level(LogLevel::kOff);
    const TransferStats s = transfer_stats(Channel::kProcessGroup);
    EXPECT_EQ(s.transfers, 2);
    // Per leaf: a (16 bytes) and b (48); consolidated: one 64-byte storage.
    EXPECT_EQ(rank == 0 ? s.messages_sent : s.messages_received, 3);
    EXPECT_EQ(rank == 0 ? s.bytes_sent : s.bytes_received, 128);
    EXPECT_EQ(rank == 0 ? s.messages_received : s.messages_sent, 0);
    EXPECT_GT(s.nanoseconds, 0);
    EXPECT_EQ(transfer_stats(Channel::kPipe).transfers, 0);
    ASSERT_EQ(lines.size(), 2u);
    const std::string peer = rank == 0 ? "send with rank 1: " : "recv with rank 0: ";
    EXPECT_EQ(lines[0].rfind(peer + "per leaf, 2 messages, tags 0-1, 64 bytes in ", 0), 0u)
        << lines[0];
    EXPECT_EQ(lines[1].rfind(peer + "consolidated, 1 message, tag 0, 64 bytes in ", 0), 0u)
        << lines[1];
  });
}

TEST(DistProcessGroup, UnregisteredGroupHasNoRankMapping) {
  auto dir = std::filesystem::temp_directory_path() / "td-unregistered-XXXXXX";
  std::string path = dir.string();
  ASSERT_NE(mkdtemp(path.data()), nullptr);
  auto store = c10::make_intrusive<c10d::FileStore>(path + "/store", 1);
  auto backend = make_gloo_backend(store, 0, 1, std::chrono::seconds(20), "127.0.0.1");
  EXPECT_EQ(get_rank(backend), 0);
  EXPECT_EQ(get_world_size(backend), 1);
  const std::string msg = error_of([&] { get_group_rank(backend, 0); });
  EXPECT_NE(msg.find("is not registered, please create group with new_group"), std::string::npos)
      << msg;
  std::filesystem::remove_all(path);
}

TEST(DistProcessGroup, WithoutInitEverythingSaysSo) {
  ASSERT_FALSE(is_initialized());
  const std::string expected =
      "Default process group has not been initialized, please make sure to call "
      "init_process_group.";
  EXPECT_EQ(error_of([] { default_group(); }), expected);
  EXPECT_EQ(error_of([] { get_rank(); }), expected);
  EXPECT_EQ(error_of([] { new_group({0}); }), expected);
  EXPECT_THROW(init_process_group({.backend = "nccl"}), c10::ValueError);
  EXPECT_THROW(init_process_group({.init_method = "bogus://x", .rank = 0, .world_size = 1}),
               c10::ValueError);
}

// tcp:// and env:// rendezvous, without fixed ports: rank 0 serves two TCPStores on port 0 and
// publishes their ports; init_process_group then shares those servers (multi-tenant, as
// torch's). Two servers, because a re-created group "0" must not meet the first one's keys.
TEST(DistProcessGroup, TcpAndEnvRendezvous) {
  run_ranks(
      2,
      [](int rank, int world_size) {
        const std::string port_file = run_scratch_dir() + "/ports";
        std::vector<c10::intrusive_ptr<c10d::TCPStore>> servers;
        int ports[2] = {0, 0};
        if (rank == 0) {
          for (int& port : ports) {
            c10d::TCPStoreOptions o;
            o.port = 0;
            o.isServer = true;
            o.multiTenant = true;
            o.waitWorkers = false;
            servers.push_back(c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o));
            port = servers.back()->getPort();
          }
          std::ofstream(port_file + ".tmp") << ports[0] << " " << ports[1];
          std::filesystem::rename(port_file + ".tmp", port_file);
        } else {
          while (!std::filesystem::exists(port_file)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          std::ifstream(port_file) >> ports[0] >> ports[1];
        }
        init_process_group({.init_method = "tcp://127.0.0.1:" + std::to_string(ports[0]),
                            .rank = rank,
                            .world_size = world_size,
                            .timeout = std::chrono::seconds(20),
                            .gloo_hostname = "127.0.0.1"});
        EXPECT_EQ(get_rank(), rank);
        std::vector<at::Tensor> t{at::ones({2})};
        default_group()->allreduce(t)->wait();
        EXPECT_EQ(t[0].sum().item<double>(), 4.0);
        destroy_process_group();

        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", std::to_string(ports[1]).c_str(), 1);
        setenv("RANK", std::to_string(rank).c_str(), 1);
        setenv("WORLD_SIZE", "2", 1);
        init_process_group({.timeout = std::chrono::seconds(20), .gloo_hostname = "127.0.0.1"});
        EXPECT_EQ(get_world_size(), 2);
        std::vector<at::Tensor> u{at::full({1}, double(rank))};
        default_group()->allreduce(u)->wait();
        EXPECT_EQ(u[0].item<double>(), 1.0);
        destroy_process_group();
      },
      {.init_process_group = false});
}

}  // namespace
}  // namespace tensordict::dist

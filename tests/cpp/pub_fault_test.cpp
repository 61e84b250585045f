// A subscriber SIGKILLed mid-pull (docs/publication.md): the publisher on rank 0 is sending it a
// 64 MB version when the kill lands. publish() never waits for it (it pins one slot at most),
// and the healthy subscriber on rank 1 goes on pulling every version. The kill is timed as in
// dist_fault_test.cpp: the publisher's killer thread watches the bytes written to its sockets
// (/proc/self/io's wchar). These kills land in the socket's data path, so both ends take
// transport "socket"; the shared-memory path's kills are in shm_publication_test.cpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <thread>

#include "fault_test_util.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/tensor_dict.h"

namespace {

using namespace fault_test;
using tensordict::TensorDict;
namespace dist = tensordict::dist;

constexpr int64_t kElems = int64_t{16} << 20;  // float32: 64 MB
constexpr int64_t kKillAfterBytes = kElems;    // a quarter of the victim's version
constexpr int kVersions = 10;

TensorDict version(float v) { return TensorDict({{"w", at::full({kElems}, v)}}); }

bool holds(const TensorDict& td, float v) { return td.get("w").tensor().eq(v).all().item<bool>(); }

void run_role(const std::string& name) {
  const int rank = name == "publisher" ? 0 : name == "healthy" ? 1 : 2;
  at::set_num_threads(1);
  dist::init_process_group({.backend = "gloo",
                            .init_method = "file://" + role_dir() + "/store",
                            .rank = rank,
                            .world_size = 3,
                            .timeout = std::chrono::milliseconds(60s),
                            .gloo_hostname = "127.0.0.1"});
  if (rank == 2) write_file(role_dir() + "/victim.pid", std::to_string(::getpid()));
  std::vector<at::Tensor> flag{at::zeros({1})};
  dist::default_group()->allreduce(flag)->wait();  // all connected, the pid written
  if (rank == 1) {
    dist::Subscriber sub({.src = 0, .transport = "socket"});
    auto first = sub.pull({.timeout = 30s});
    ASSERT_TRUE(first.has_value());
    write_file(role_dir() + "/healthy.first", "1");
    TensorDict td = first->td;
    int64_t last = first->version;
    while (last < kVersions) {
      auto v = sub.pull(td, {.timeout = 30s});
      ASSERT_TRUE(v.has_value());
      ASSERT_GT(*v, last);
      EXPECT_TRUE(holds(td, static_cast<float>(*v)));
      last = *v;
    }
    write_file(role_dir() + "/healthy.done", std::to_string(last));
    return;
  }
  if (rank == 2) {
    ASSERT_TRUE(await_file(role_dir() + "/victim.go", 30s).has_value());
    dist::Subscriber sub({.src = 0, .transport = "socket"});
    sub.pull({.timeout = 30s});  // killed in here
    write_file(role_dir() + "/victim.finished", "the pull completed before the kill");
    std::this_thread::sleep_for(30s);  // let the killer find this process
    return;
  }
  dist::Publisher pub({.max_slots = 2, .transport = "socket"});
  pub.publish(version(1));
  ASSERT_TRUE(await_file(role_dir() + "/healthy.first", 30s).has_value());
  const auto victim = static_cast<pid_t>(std::stoi(*read_file(role_dir() + "/victim.pid")));
  const int64_t base = io_counter("wchar");
  std::atomic<bool> stop{false};
  std::thread killer([&] {
    while (!stop.load() && io_counter("wchar") - base < kKillAfterBytes) {
      std::this_thread::sleep_for(100us);
    }
    write_file(role_dir() + "/victim.killed", std::to_string(now_ns()));
    ::kill(victim, SIGKILL);
  });
  write_file(role_dir() + "/victim.go", "1");
  ASSERT_TRUE(await_file(role_dir() + "/victim.killed", 30s).has_value());
  stop = true;
  killer.join();
  // Gloo may never fail the pending send to the dead subscriber, but the receive of its next
  // request fails: within a slice of the publisher's waits it is lost and its slot free.
  std::vector<tensordict::SubscriberStats> stats;
  for (int i = 0; i < 100; ++i) {
    stats = pub.stats();
    if (stats[1].lost) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(stats[1].lost) << "the victim was not recorded as lost";
  EXPECT_FALSE(stats[1].pinned.has_value())
      << "the victim still pins version " << stats[1].pinned.value_or(0);
  // publish() never waits for the dead subscriber; the healthy one gets every version.
  int64_t slowest_ms = 0;
  for (int v = 2; v <= kVersions; ++v) {
    const auto t0 = Clock::now();
    pub.publish(version(static_cast<float>(v)), 10s);
    slowest_ms = std::max<int64_t>(
        slowest_ms,
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_LT(slowest_ms, 2000);
  ASSERT_TRUE(await_file(role_dir() + "/healthy.done", 30s).has_value());
  write_file(role_dir() + "/publisher.report",
             std::to_string(slowest_ms) + " lost: " + stats[1].error);
}

// The publisher killed while its data is on the way: Gloo never fails the receive whose bytes
// it is reading, but the link's watch receive (docs/wire-format.md §9.1) is failed, so the
// subscriber's pull is a PeerLostError within a slice of its waits, not a None for ever.
void run_dead_publisher_role(const std::string& name) {
  const int rank = name == "dying_publisher" ? 0 : 1;
  at::set_num_threads(1);
  dist::init_process_group({.backend = "gloo",
                            .init_method = "file://" + role_dir() + "/store",
                            .rank = rank,
                            .world_size = 2,
                            .timeout = std::chrono::milliseconds(60s),
                            .gloo_hostname = "127.0.0.1"});
  if (rank == 1) {
    dist::Subscriber sub({.src = 0, .transport = "socket"});
    std::string error = "<no error>", kind;
    try {
      while (sub.pull({.timeout = 20s})) {  // each whole version, until the publisher dies
      }
      error = "a pull returned None";
    } catch (const tensordict::PeerLostError& e) {
      kind = "PeerLostError";
      error = e.what_without_backtrace();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    write_file(role_dir() + "/orphan.report", std::to_string(now_ns()) + " " + kind + ": " + error);
    return;
  }
  dist::Publisher pub({.max_slots = 1, .transport = "socket"});
  const int64_t base = io_counter("wchar");
  std::thread killer([&] {
    while (io_counter("wchar") - base < 3 * kKillAfterBytes) std::this_thread::sleep_for(100us);
    write_file(role_dir() + "/publisher.killed", std::to_string(now_ns()));
    ::kill(::getpid(), SIGKILL);
  });
  for (int v = 1;; ++v) pub.publish(version(static_cast<float>(v)), 30s);
}

TEST(PublicationFault, APublisherKilledMidDataIsAPeerLostErrorWithinThePull) {
  if (auto r = role()) {
    if (*r == "dying_publisher" || *r == "orphan") {
      run_dead_publisher_role(*r);
    }
    return;
  }
  TempDir dir;
  const pid_t publisher = spawn_role("dying_publisher", dir.path);
  const pid_t orphan = spawn_role("orphan", dir.path);
  const auto publisher_status = wait_child(publisher, 60s);
  const auto orphan_status = wait_child(orphan, 60s);
  EXPECT_TRUE(was_sigkilled(publisher_status)) << describe(publisher_status);
  EXPECT_TRUE(exited_cleanly(orphan_status)) << describe(orphan_status);
  const auto killed = read_file(dir.path + "/publisher.killed");
  const auto report = read_file(dir.path + "/orphan.report");
  ASSERT_TRUE(killed.has_value() && report.has_value());
  const double after_ms = ms_between(std::stoll(*killed), std::stoll(*report));
  std::printf("[fault] the subscriber of a killed publisher, %.0f ms after the kill: %s\n",
              after_ms, report->c_str());
  EXPECT_NE(report->find("PeerLostError"), std::string::npos) << *report;
  EXPECT_LT(after_ms, 2000);
}

TEST(PublicationFault, ASubscriberKilledMidPullCostsThePublisherNothing) {
  if (auto r = role()) {
    if (*r != "dying_publisher" && *r != "orphan") run_role(*r);
    return;
  }
  for (int attempt = 1;; ++attempt) {
    TempDir dir;
    const pid_t publisher = spawn_role("publisher", dir.path);
    const pid_t healthy = spawn_role("healthy", dir.path);
    const pid_t victim = spawn_role("victim", dir.path);
    const auto publisher_status = wait_child(publisher, 90s);
    const auto healthy_status = wait_child(healthy, 30s);
    const auto victim_status = wait_child(victim, 30s);
    const bool late = read_file(dir.path + "/victim.finished").has_value();
    if (late && attempt < 3) {
      std::printf("[fault] the victim's pull completed before the kill; again\n");
      continue;
    }
    EXPECT_TRUE(was_sigkilled(victim_status)) << describe(victim_status);
    EXPECT_TRUE(exited_cleanly(publisher_status)) << describe(publisher_status);
    EXPECT_TRUE(exited_cleanly(healthy_status)) << describe(healthy_status);
    const auto report = read_file(dir.path + "/publisher.report");
    ASSERT_TRUE(report.has_value());
    std::printf("[fault] slowest publish after the kill (ms), and the victim: %s\n",
                report->c_str());
    return;
  }
}

}  // namespace

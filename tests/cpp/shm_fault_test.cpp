// Publication over shared memory when its processes are stopped or killed (docs/publication.md
// "Shared memory"), real processes over Gloo on 127.0.0.1, as pub_fault_test.cpp:
// - a SIGSTOPped subscriber costs the publisher the one slot it pins (zero-copy), a subscriber
//   SIGKILLed while it copies a version out of its slot has its pin cleared within 100 ms
//   (measured), and publish goes on at its healthy pace;
// - a SIGKILLed publisher leaves its subscriber's zero-copy views readable, and the next pull
//   raises PeerLostError within its timeout;
// - nothing is left in /dev/shm (the segments are memfds), and the publisher's descriptors go
//   with it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fault_test_util.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/errors.h"
#include "tensordict/tensor_dict.h"

namespace {

using namespace fault_test;
using tensordict::TensorDict;
namespace dist = tensordict::dist;

constexpr int64_t kElems = int64_t{4} << 20;  // float32: 16 MiB, a few ms to copy

TensorDict version(float v) { return TensorDict({{"w", at::full({kElems}, v)}}); }
bool holds(const TensorDict& td, float v) { return td.get("w").tensor().eq(v).all().item<bool>(); }

// /dev/shm's entries, but Python multiprocessing's semaphores ("sem.mp-..."), which other
// programs on the machine make and remove meanwhile; ours would be anything else (there are
// none: the segments are memfds, which have no name).
std::set<std::string> dev_shm() {
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("sem.mp-", 0) != 0) names.insert(name);
  }
  return names;
}

void init(int rank, int world) {
  at::set_num_threads(1);
  dist::init_process_group({.backend = "gloo",
                            .init_method = "file://" + role_dir() + "/store",
                            .rank = rank,
                            .world_size = world,
                            .timeout = std::chrono::milliseconds(60s),
                            .gloo_hostname = "127.0.0.1"});
  write_file(role_dir() + "/" + std::to_string(rank) + ".pid", std::to_string(::getpid()));
  std::vector<at::Tensor> flag{at::zeros({1})};
  dist::default_group()->allreduce(flag)->wait();  // all connected, the pids written
}

pid_t pid_of(int rank) {
  return static_cast<pid_t>(
      std::stoi(*read_file(role_dir() + "/" + std::to_string(rank) + ".pid")));
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// ---- stopped and killed subscribers ---------------------------------------------------------

// Rank 0 publishes; rank 1 pulls every version by copy (healthy); rank 2 pulls version 1
// zero-copy and is SIGSTOPped; rank 3 pulls by copy until it is SIGKILLed with a pin held.
void run_subscribers_role(const std::string& name) {
  const int rank = name == "publisher" ? 0 : name == "healthy" ? 1 : name == "stopped" ? 2 : 3;
  init(rank, 4);
  if (rank == 1) {
    dist::Subscriber sub({.src = 0});
    TensorDict td = version(0);
    for (int64_t last = 0; !read_file(role_dir() + "/done").has_value();) {
      const auto v = sub.pull(td, {.timeout = 200ms});
      if (!v) continue;
      ASSERT_GT(*v, last);
      ASSERT_TRUE(holds(td, static_cast<float>(*v)));
      last = *v;
    }
    EXPECT_EQ(sub.transport(), "shm");
    return;
  }
  if (rank == 2) {
    dist::Subscriber sub({.src = 0});
    TensorDict td = version(0);
    const auto held = sub.pull(td, {.timeout = 30s, .zero_copy = true});
    ASSERT_TRUE(held.has_value());
    write_file(role_dir() + "/stopped.ready", std::to_string(*held));
    ASSERT_TRUE(await_file(role_dir() + "/done", 60s).has_value());  // stopped, then continued
    // Never rewritten while it pinned it, however many versions went by.
    EXPECT_TRUE(holds(td, static_cast<float>(*held)));
    const auto v = sub.pull(td, {.timeout = 10s, .zero_copy = true});
    ASSERT_TRUE(v.has_value());
    EXPECT_GT(*v, *held);
    EXPECT_TRUE(holds(td, static_cast<float>(*v)));
    return;
  }
  if (rank == 3) {
    dist::Subscriber sub({.src = 0});
    TensorDict td = version(0);
    for (;;) sub.pull(td, {.timeout = 30s});  // killed in one of these
  }
  // The publisher.
  dist::Publisher pub({.max_slots = 3});
  const auto timed_publish = [&](float v) {
    const auto t0 = Clock::now();
    pub.publish(version(v), 10s);
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  float next = 1;
  for (int i = 0; i < 6; ++i) timed_publish(next++);  // every slot's pages touched once
  std::vector<double> healthy;
  for (int i = 0; i < 40; ++i) {
    healthy.push_back(timed_publish(next++));
    std::this_thread::sleep_for(5ms);
  }
  // Rank 2 holds a version zero-copy: stopped, it pins that slot for good.
  const auto held = await_file(role_dir() + "/stopped.ready", 30s);
  ASSERT_TRUE(held.has_value());
  ::kill(pid_of(2), SIGSTOP);
  // Rank 3 killed while it copies a version out of its slot (its pin set).
  std::optional<Clock::time_point> killed;
  for (int i = 0; i < 2000 && !killed; ++i) {
    timed_publish(next++);
    for (int spin = 0; spin < 2000; ++spin) {
      if (pub.stats()[2].pinned.has_value()) {
        ::kill(pid_of(3), SIGKILL);
        killed = Clock::now();
        break;
      }
    }
  }
  ASSERT_TRUE(killed.has_value()) << "rank 3 was never seen mid-pull";
  // Its pin cleared: the publisher's serve thread sees the connection lost (the watch), or a
  // publish that needs the slot sees the process gone.
  while (pub.stats()[2].pinned.has_value() && Clock::now() - *killed < 5s) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const double freed_ms = std::chrono::duration<double, std::milli>(Clock::now() - *killed).count();
  std::vector<double> after;
  for (int i = 0; i < 40; ++i) {
    after.push_back(timed_publish(next++));
    std::this_thread::sleep_for(5ms);
  }
  const auto stats = pub.stats();
  EXPECT_EQ(stats[1].pinned, std::stoll(*held));  // the stopped one: its slot only
  EXPECT_FALSE(stats[2].pinned.has_value());
  EXPECT_LT(freed_ms, 100);
  const double p99_healthy = percentile(healthy, 0.99), p99_after = percentile(after, 0.99);
  write_file(role_dir() + "/report",
             c10::str("pin of the killed subscriber freed after ", freed_ms,
                      " ms; publish p99 healthy ", p99_healthy, " ms, with one stopped and one ",
                      "killed ", p99_after, " ms (", p99_after / p99_healthy, "x)"));
  // Not the 1.2x on a 2-core machine shared with the subscribers' copies, but bounded.
  EXPECT_LT(p99_after, 3 * p99_healthy + 5);
  ::kill(pid_of(2), SIGCONT);
  write_file(role_dir() + "/done", "1");
  std::this_thread::sleep_for(500ms);  // the continued subscriber's last pull
  pub.publish(version(next++), 10s);
  std::this_thread::sleep_for(2s);
}

TEST(SharedMemoryFault, StoppedAndKilledSubscribersCostOnlyTheirSlots) {
  if (auto r = role()) {
    run_subscribers_role(*r);
    return;
  }
  const auto before = dev_shm();
  TempDir dir;
  const pid_t publisher = spawn_role("publisher", dir.path);
  const pid_t healthy = spawn_role("healthy", dir.path);
  const pid_t stopped = spawn_role("stopped", dir.path);
  const pid_t victim = spawn_role("victim", dir.path);
  const auto publisher_status = wait_child(publisher, 90s);
  const auto victim_status = wait_child(victim, 30s);
  const auto healthy_status = wait_child(healthy, 30s);
  const auto stopped_status = wait_child(stopped, 30s);
  EXPECT_TRUE(exited_cleanly(publisher_status)) << describe(publisher_status);
  EXPECT_TRUE(was_sigkilled(victim_status)) << describe(victim_status);
  EXPECT_TRUE(exited_cleanly(healthy_status)) << describe(healthy_status);
  EXPECT_TRUE(exited_cleanly(stopped_status)) << describe(stopped_status);
  const auto report = read_file(dir.path + "/report");
  ASSERT_TRUE(report.has_value());
  std::printf("[shm fault] %s\n", report->c_str());
  EXPECT_EQ(dev_shm(), before);
}

// ---- a killed publisher ---------------------------------------------------------------------

void run_publisher_killed_role(const std::string& name) {
  const int rank = name == "publisher" ? 0 : 1;
  init(rank, 2);
  if (rank == 0) {
    dist::Publisher pub({.max_slots = 2});
    pub.publish(version(1));
    ASSERT_TRUE(await_file(role_dir() + "/viewing", 30s).has_value());
    write_file(role_dir() + "/publisher.killed", std::to_string(now_ns()));
    ::kill(::getpid(), SIGKILL);
  }
  dist::Subscriber sub({.src = 0});
  TensorDict td = version(0);
  ASSERT_EQ(sub.pull(td, {.timeout = 30s, .zero_copy = true}), 1);
  ASSERT_EQ(sub.transport(), "shm");
  write_file(role_dir() + "/viewing", "1");
  ASSERT_TRUE(await_file(role_dir() + "/publisher.killed", 30s).has_value());
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(holds(td, 1));  // the mapping outlives its publisher
  const auto t0 = Clock::now();
  std::string kind, message;
  try {
    sub.pull(td, {.timeout = 5s});
    kind = "nothing";
  } catch (const tensordict::PeerLostError& e) {
    kind = "PeerLostError";
    message = e.msg();
  } catch (const std::exception& e) {
    kind = "another error";
    message = e.what();
  }
  const double took = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_TRUE(holds(td, 1));
  write_file(role_dir() + "/report", c10::str(kind, " after ", took, " ms: ", message));
  EXPECT_EQ(kind, "PeerLostError") << message;
  EXPECT_LT(took, 5000);
}

TEST(SharedMemoryFault, AKilledPublisherLeavesViewsReadableAndThePullAPeerLostError) {
  if (auto r = role()) {
    run_publisher_killed_role(*r);
    return;
  }
  const auto before = dev_shm();
  TempDir dir;
  const pid_t publisher = spawn_role("publisher", dir.path);
  const pid_t subscriber = spawn_role("subscriber", dir.path);
  const auto publisher_status = wait_child(publisher, 60s);
  const auto subscriber_status = wait_child(subscriber, 60s);
  EXPECT_TRUE(was_sigkilled(publisher_status)) << describe(publisher_status);
  EXPECT_TRUE(exited_cleanly(subscriber_status)) << describe(subscriber_status);
  const auto report = read_file(dir.path + "/report");
  ASSERT_TRUE(report.has_value());
  std::printf("[shm fault] the subscriber of a killed publisher: %s\n", report->c_str());
  EXPECT_EQ(dev_shm(), before);
}

}  // namespace

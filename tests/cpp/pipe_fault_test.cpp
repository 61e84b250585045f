// Fault injection on the UCX pipe: a producer SIGKILLed in the middle of a 64 MB message, and a
// TensorDictServer with four clients of which one is SIGKILLed mid-message. The survivors must
// raise (or, for the other clients, carry on) within the pipe timeout, with an error naming the
// peer or the timeout, and end cleanly. Last, a consumer that starts reading late while its
// producer floods it must still receive every message in order.
#include <ATen/ATen.h>
#include <sched.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "checksum.h"
#include "fault_test_util.h"
#include "pipe_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/pipe/server.h"
#include "tensordict/tensor_dict.h"

namespace {

using namespace fault_test;
using tensordict::TensorDict;
using tensordict::pipe::Pipe;
using tensordict::pipe::PipeOptions;
using tensordict::pipe::TensorDictServer;


constexpr auto kTimeout = 10s;
constexpr auto kSlack = 3s;

PipeOptions options() {
  PipeOptions o;
  o.timeout = kTimeout;
  o.linger = 1s;
  return o;
}

// FNV-1a over 8-byte words (and the tail bytes): cheap enough for tens of MB, and any changed,
// moved or stale byte changes it.
uint64_t checksum(const at::Tensor& t) {
  return tensordict::testing::fnv(tensordict::testing::kFnvBasis, t);
}

// A message: seq, the checksum of data, data (contents depend on client and seq).
TensorDict message(int64_t client, int64_t seq, int64_t elems) {
  at::Tensor data = at::arange(elems, at::kFloat).add_(static_cast<double>(seq * 7 + client));
  const auto sum = static_cast<int64_t>(checksum(data));
  return TensorDict({{"seq", at::full({1}, seq, at::kLong)},
                     {"sum", at::full({1}, sum, at::kLong)},
                     {"data", data}});
}

int64_t leaf(const TensorDict& td, const char* key) {
  return td.get(key).tensor().item<int64_t>();
}

// ---- a producer killed mid-message ----------------------------------------------------------

constexpr int64_t kBigElems = int64_t{16} << 20;  // float32: 64 MB
constexpr int kWholeMessages = 3;                 // the 4th is cut

void consumer_role() {
  Pipe pipe = Pipe::listen(0, "127.0.0.1", options());
  write_file(role_dir() + "/port", std::to_string(pipe.port()));
  int64_t received = 0;
  std::string error = "<no error>";
  bool intact = true;
  try {
    while (true) {
      TensorDict td = pipe.recv();
      const at::Tensor x = td.get("x").tensor();
      // Message k is filled with k.
      intact = intact && x.numel() == kBigElems && x[0].item<float>() == received &&
               x[kBigElems - 1].item<float>() == received;
      ++received;
      // The producer cuts its next message once every whole one arrived: this recv is then
      // the one that the kill interrupts.
      if (received == kWholeMessages) write_file(role_dir() + "/got_whole", "");
    }
  } catch (const c10::Error& e) {
    error = e.msg();
  } catch (const std::exception& e) {
    error = std::string("(not a c10::Error) ") + e.what();
  }
  const int64_t end = now_ns();
  pipe.close();
  write_file(role_dir() + "/survivor", std::to_string(end) + " " + std::to_string(received) +
                                           " " + std::to_string(intact) + "\n" + error);
}

// Sends the first half of a same-schema message (flag 0x01, then half the storage) and dies:
// the bytes send() would have put on the wire, cut at a known point.
[[noreturn]] void die_mid_message(Pipe& pipe, const TensorDict& td) {
  const at::Tensor storage = td.consolidated_state()->storage;
  pipe.send_raw("\x01", 1);
  pipe.send_raw(storage.const_data_ptr(), storage.nbytes() / 2);
  kill_self("victim");
}

void producer_role() {
  Pipe pipe = Pipe::connect("127.0.0.1", std::stoi(*env("TD_FAULT_PORT")), options());
  TensorDict td = tensordict::consolidate(TensorDict({{"x", at::zeros({kBigElems})}}));
  at::Tensor x = td.get("x").tensor();
  for (int k = 0; k < kWholeMessages; ++k) {
    x.fill_(static_cast<float>(k));
    pipe.send(td);
  }
  if (!await_file(role_dir() + "/got_whole", 30s)) std::abort();
  x.fill_(static_cast<float>(kWholeMessages));
  die_mid_message(pipe, td);
}

TEST(PipeFault, ProducerKilledMidMessage) {
  if (auto r = role()) {
    *r == "consumer" ? consumer_role() : producer_role();
    return;
  }
  TempDir dir;
  const pid_t consumer = spawn_role("consumer", dir.path);
  const auto port = await_file(dir.path + "/port", 30s);
  ASSERT_TRUE(port.has_value()) << "the consumer did not listen";
  const pid_t producer = spawn_role("producer", dir.path, {{"TD_FAULT_PORT", *port}});
  const auto producer_status = wait_child(producer, 60s);
  const auto consumer_status = wait_child(consumer, 60s);
  EXPECT_TRUE(was_sigkilled(producer_status)) << describe(producer_status);
  EXPECT_TRUE(exited_cleanly(consumer_status)) << describe(consumer_status);

  const auto killed_at = kill_time(dir.path, "victim");
  const auto report = read_file(dir.path + "/survivor");
  ASSERT_TRUE(killed_at.has_value()) << "the producer did not record its kill";
  ASSERT_TRUE(report.has_value()) << "the consumer wrote no report";
  std::istringstream in(*report);
  int64_t end = 0, received = 0;
  int intact = 0;
  in >> end >> received >> intact;
  in.get();
  const std::string error((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(received, kWholeMessages);
  EXPECT_TRUE(intact) << "a whole message arrived corrupted";
  EXPECT_EQ(error.find("(not a c10::Error)"), std::string::npos) << error;
  EXPECT_TRUE(names_peer_or_timeout(error)) << error;
  EXPECT_EQ(error.find("the peer closed the pipe"), std::string::npos)
      << "a kill must not look like a clean close: " << error;
  const double after_kill_ms = ms_between(*killed_at, end);
  EXPECT_LT(after_kill_ms, to_ms(kTimeout + kSlack));
  std::printf("[fault] pipe producer killed mid-message %lld: consumer raised %.1f ms after the "
              "kill: %s\n",
              static_cast<long long>(received + 1), after_kill_ms, error.c_str());
}

// ---- a server with four clients, one killed mid-message ---------------------------------

constexpr int64_t kVictimElems = int64_t{8} << 20;  // 32 MB messages
constexpr int64_t kSmallElems = 16 << 10;           // 64 KB messages
constexpr int kSurvivors = 3;
constexpr int kRoundsAfterKill = 50;

void victim_client_role() {
  Pipe pipe = Pipe::connect("127.0.0.1", std::stoi(*env("TD_FAULT_PORT")), options());
  for (int64_t seq = 0;; ++seq) {
    TensorDict td = tensordict::consolidate(message(99, seq, kVictimElems));
    if (seq == 2) die_mid_message(pipe, td);  // the server has verified 2 messages
    pipe.send(td);
    TensorDict ack = pipe.recv();
    if (leaf(ack, "seq") != seq) std::abort();
  }
}

struct HandlerFailure {
  std::string peer, error;
  int64_t when_ns, verified;
};

TEST(PipeFault, ServerKeepsServingWhenAClientIsKilled) {
  if (role()) {
    victim_client_role();
    return;
  }
  TempDir dir;
  TensorDictServer server(0, "127.0.0.1", options());
  std::mutex mu;
  std::vector<HandlerFailure> failures;
  std::atomic<int64_t> bad_messages{0};
  server.serve([&](Pipe& pipe) {
    int64_t expected = 0;
    try {
      while (true) {
        TensorDict td = pipe.recv();
        const bool ok = leaf(td, "seq") == expected &&
                        static_cast<uint64_t>(leaf(td, "sum")) ==
                            checksum(td.get("data").tensor());
        if (!ok) ++bad_messages;
        pipe.send(TensorDict({{"seq", td.get("seq").tensor().clone()},
                              {"sum", td.get("sum").tensor().clone()}}));
        ++expected;
      }
    } catch (const c10::Error& e) {
      if (pipe.peer_closed()) return;  // a clean end
      std::lock_guard<std::mutex> lk(mu);
      failures.push_back({pipe.peer(), e.msg(), now_ns(), expected});
      throw;
    }
  });

  std::atomic<bool> victim_dead{false};
  std::vector<int64_t> rounds(kSurvivors, 0), rounds_after(kSurvivors, 0), bad_acks(kSurvivors, 0);
  std::vector<std::string> client_errors(kSurvivors);
  std::vector<std::thread> clients;
  for (int i = 0; i < kSurvivors; ++i) {
    clients.emplace_back([&, i] {
      try {
        Pipe pipe = Pipe::connect("127.0.0.1", server.port(), options());
        for (int64_t seq = 0; rounds_after[i] < kRoundsAfterKill; ++seq) {
          const bool after = victim_dead.load();
          TensorDict td = message(i, seq, kSmallElems);
          pipe.send(td);
          TensorDict ack = pipe.recv();
          if (leaf(ack, "seq") != seq || leaf(ack, "sum") != leaf(td, "sum")) ++bad_acks[i];
          ++rounds[i];
          if (after) ++rounds_after[i];
          if (!after) std::this_thread::sleep_for(1ms);  // leave room for the big messages
        }
        pipe.close();
      } catch (const std::exception& e) {
        client_errors[i] = e.what();
      }
    });
  }
  const pid_t victim = spawn_role("client", dir.path, {{"TD_FAULT_PORT",
                                                        std::to_string(server.port())}});
  const auto victim_status = wait_child(victim, 60s);
  victim_dead = true;
  for (auto& t : clients) t.join();
  // The victim's handler fails on its own; wait for it (bounded by the pipe timeout).
  const auto deadline = Clock::now() + kTimeout + kSlack;
  while (Clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!failures.empty()) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  const int64_t clients_served = server.clients();
  server.close();  // joins every handler: must return

  EXPECT_TRUE(was_sigkilled(victim_status)) << describe(victim_status);
  const auto killed_at = kill_time(dir.path, "victim");
  ASSERT_TRUE(killed_at.has_value()) << "the victim did not record its kill";
  EXPECT_EQ(clients_served, kSurvivors + 1);
  EXPECT_EQ(bad_messages.load(), 0);
  for (int i = 0; i < kSurvivors; ++i) {
    EXPECT_EQ(client_errors[i], "") << "client " << i;
    EXPECT_EQ(bad_acks[i], 0) << "client " << i;
    EXPECT_GE(rounds_after[i], kRoundsAfterKill) << "client " << i;
  }
  ASSERT_EQ(failures.size(), 1u) << "only the killed client's handler may fail";
  const auto& f = failures[0];
  EXPECT_TRUE(names_peer_or_timeout(f.error)) << f.error;
  EXPECT_EQ(f.verified, 2) << "the victim's third message was to be cut";
  EXPECT_EQ(server.handler_errors().size(), 1u);
  const double after_kill_ms = ms_between(*killed_at, f.when_ns);
  EXPECT_GE(after_kill_ms, 0);
  EXPECT_LT(after_kill_ms, to_ms(kTimeout + kSlack));
  std::printf("[fault] server: client %s killed mid-message 3; its handler raised %.1f ms after "
              "the kill: %s; survivors' rounds (after the kill): %lld (%lld), %lld (%lld), %lld "
              "(%lld)\n",
              f.peer.c_str(), after_kill_ms, f.error.c_str(), (long long)rounds[0],
              (long long)rounds_after[0], (long long)rounds[1], (long long)rounds_after[1],
              (long long)rounds[2], (long long)rounds_after[2]);
}

// ---- a producer that floods a consumer who reads late -----------------------------------------

// UCX reads everything the peer sends into its own queue, whether a receive is posted or not.
// A progress loop that drained UCX until it was idle never got round to posting the consumer's
// receive while the producer kept sending: the receive timed out with gigabytes queued (seen in
// CI as a flaky Python pipe test). The consumer here starts reading only once the producer has
// been flooding for a while; every receive must still complete, in order. Both processes share
// one CPU, so that the consumer's UCX thread falls behind (on idle cores it often keeps up, and
// the old loop passed by luck).
constexpr int64_t kFloodElems = int64_t{1} << 20;  // float32: 4 MB messages
constexpr int kFloodReads = 200;
constexpr auto kFloodTimeout = 3s;                   // each receive
constexpr auto kFloodLimit = 60s;  // the producer sends until the consumer is done, or this

// Pins the calling thread to the lowest CPU it may use, and so the processes it forks from now
// on (they inherit the mask); returns the old mask.
cpu_set_t pin_to_one_cpu() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return allowed;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    ::sched_setaffinity(0, sizeof(one), &one);
    break;
  }
  return allowed;
}

void flood_consumer_role() {
  PipeOptions o = options();
  o.timeout = kFloodTimeout;
  Pipe pipe = Pipe::listen(0, "127.0.0.1", o);
  write_file(role_dir() + "/port", std::to_string(pipe.port()));
  std::string report = "ok";
  try {
    pipe.accept();
    if (!await_file(role_dir() + "/flooding", 30s)) std::abort();
    for (int k = 0; k < kFloodReads; ++k) {
      TensorDict td = pipe.recv();
      const at::Tensor x = td.get("x").tensor();
      if (x[0].item<float>() != k || x[kFloodElems - 1].item<float>() != k) {
        report = "message " + std::to_string(k) + " holds " + std::to_string(x[0].item<float>());
        break;
      }
    }
  } catch (const c10::Error& e) {
    report = e.msg();
  }
  pipe.close();
  write_file(role_dir() + "/report", report);
}

void flood_producer_role() {
  PipeOptions o = options();
  o.linger = 0s;
  Pipe pipe = Pipe::connect("127.0.0.1", std::stoi(*env("TD_FAULT_PORT")), o);
  TensorDict td = tensordict::consolidate(TensorDict({{"x", at::zeros({kFloodElems})}}));
  at::Tensor x = td.get("x").tensor();
  const auto start = Clock::now();
  try {
    // Until the consumer has read what it wanted (then its close also fails a send): slow
    // builds (TSan) must not see the producer leave, and its unread bytes vanish, first.
    const std::string done = role_dir() + "/report";
    for (int k = 0; Clock::now() - start < kFloodLimit && !std::filesystem::exists(done); ++k) {
      x.fill_(static_cast<float>(k));
      pipe.send(td);
      if (k == 100) write_file(role_dir() + "/flooding", "");
    }
  } catch (const std::exception&) {  // the consumer closed: it has what it wanted
  }
}

TEST(PipeFault, LateConsumerKeepsUpWithAFloodingProducer) {
  if (auto r = role()) {
    *r == "consumer" ? flood_consumer_role() : flood_producer_role();
    return;
  }
  TempDir dir;
  const cpu_set_t all_cpus = pin_to_one_cpu();
  const pid_t consumer = spawn_role("consumer", dir.path);
  const auto port = await_file(dir.path + "/port", 30s);
  const pid_t producer =
      port ? spawn_role("producer", dir.path, {{"TD_FAULT_PORT", *port}}) : pid_t{-1};
  ::sched_setaffinity(0, sizeof(all_cpus), &all_cpus);
  ASSERT_TRUE(port.has_value()) << "the consumer did not listen";
  const auto consumer_status = wait_child(consumer, 60s);
  const auto producer_status = wait_child(producer, 60s);
  EXPECT_TRUE(exited_cleanly(consumer_status)) << describe(consumer_status);
  EXPECT_TRUE(exited_cleanly(producer_status)) << describe(producer_status);
  EXPECT_EQ(read_file(dir.path + "/report").value_or("<no report>"), "ok");
}

}  // namespace

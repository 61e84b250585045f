// Fault injection on the UCX pipe: a producer SIGKILLed while a 64 MB message is on its way, and
// a TensorDictServer with four clients of which one is SIGKILLed likewise. The survivors must
// raise (or, for the other clients, carry on) within the pipe timeout, with an error naming the
// peer or the timeout, and end cleanly. Last, a producer flooding a slow consumer: every message
// arrives in order, and the consumer's memory stays bounded.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

int64_t leaf(const TensorDict& td, const char* key) { return td.get(key).tensor().item<int64_t>(); }

// ---- a producer killed mid-message ----------------------------------------------------------

constexpr int64_t kBigElems = int64_t{16} << 20;  // float32: 64 MB
constexpr int kWholeMessages = 3;                 // the 4th is cut

void consumer_role() {
  Pipe::listen(0, "127.0.0.1", options()).close();  // UCX's process-wide state, made once
  const int fds = pipe_test::open_fds(), tasks = pipe_test::threads();
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
  // A pipe broken by a peer killed mid-message, closed, its handle alive: nothing left over.
  write_file(role_dir() + "/leaks", std::to_string(pipe_test::open_fds() - fds) + " " +
                                        std::to_string(pipe_test::threads() - tasks));
  write_file(role_dir() + "/survivor", std::to_string(end) + " " + std::to_string(received) + " " +
                                           std::to_string(intact) + "\n" + error);
}

// Sends `td` and dies while it is on its way: a thread SIGKILLs the process a moment after the
// send starts, in the middle of the storage's transfer (tens of MB: a rendezvous of many ms).
[[noreturn]] void die_mid_message(Pipe& pipe, const TensorDict& td) {
  std::thread killer([] {
    std::this_thread::sleep_for(2ms);
    kill_self("victim");
  });
  pipe.send(td);
  killer.join();  // unreachable: the kill comes first
  std::abort();
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
  const auto leaks = read_file(dir.path + "/leaks");
  ASSERT_TRUE(leaks.has_value());
  EXPECT_EQ(*leaks, "0 0") << "descriptors and threads left by the closed pipe";
  std::printf(
      "[fault] pipe producer killed mid-message %lld: consumer raised %.1f ms after the "
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
                        static_cast<uint64_t>(leaf(td, "sum")) == checksum(td.get("data").tensor());
        if (!ok) ++bad_messages;
        pipe.send(TensorDict(
            {{"seq", td.get("seq").tensor().clone()}, {"sum", td.get("sum").tensor().clone()}}));
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
  const pid_t victim =
      spawn_role("client", dir.path, {{"TD_FAULT_PORT", std::to_string(server.port())}});
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
  std::printf(
      "[fault] server: client %s killed mid-message 3; its handler raised %.1f ms after "
      "the kill: %s; survivors' rounds (after the kill): %lld (%lld), %lld (%lld), %lld "
      "(%lld)\n",
      f.peer.c_str(), after_kill_ms, f.error.c_str(), (long long)rounds[0],
      (long long)rounds_after[0], (long long)rounds[1], (long long)rounds_after[1],
      (long long)rounds[2], (long long)rounds_after[2]);
}

// ---- a producer that floods a slow consumer: bounded memory ----------------------------------

// The producer sends as fast as it can; the consumer reads one message per interval. Large
// messages wait for their receiver (UCX rendezvous) and at most max_unreceived TensorDicts may
// be outstanding (docs/pipe.md, flow control), so the producer is held back and the consumer's
// resident memory stays flat: its growth after the first message must stay under 256 MB. Every
// message must arrive, in order. Both processes share one CPU, so that the consumer's UCX thread
// competes with the producer (before the flow control, UCX queued whatever the producer sent:
// 228 MB -> 9 GB in 20 s).
struct Flood {
  int64_t elems;  // float32 elements per message
  int reads;      // messages the consumer reads
  Clock::duration interval;
  int64_t max_unreceived;
};
constexpr int64_t kFloodRssBound = int64_t{256} << 20;
constexpr auto kFloodLimit = 90s;  // the producer sends until the consumer is done, or this

Flood flood_from_env() {
  return Flood{std::stoll(*env("TD_FLOOD_ELEMS")), std::stoi(*env("TD_FLOOD_READS")),
               std::chrono::milliseconds(std::stoll(*env("TD_FLOOD_INTERVAL_MS"))),
               std::stoll(*env("TD_FLOOD_WINDOW"))};
}

int64_t resident_bytes() {
  const auto statm = read_file("/proc/self/statm");
  long pages = 0, resident = 0;
  if (!statm || std::sscanf(statm->c_str(), "%ld %ld", &pages, &resident) != 2) return -1;
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

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
  const Flood f = flood_from_env();
  Pipe pipe = Pipe::listen(0, "127.0.0.1", options());
  write_file(role_dir() + "/port", std::to_string(pipe.port()));
  std::string report = "ok";
  int64_t base = 0, peak = 0;
  try {
    for (int k = 0; k < f.reads; ++k) {
      if (k > 0) std::this_thread::sleep_for(f.interval);
      TensorDict td = pipe.recv();
      const at::Tensor x = td.get("x").tensor();
      if (x[0].item<float>() != k || x[f.elems - 1].item<float>() != k) {
        report = "message " + std::to_string(k) + " holds " + std::to_string(x[0].item<float>());
        break;
      }
      const int64_t rss = resident_bytes();
      if (k == 0) base = rss;
      peak = std::max(peak, rss);
    }
    // The producer is blocked now: let it show how far ahead it got before this end closes.
    std::this_thread::sleep_for(500ms);
  } catch (const c10::Error& e) {
    report = e.msg();
  }
  write_file(role_dir() + "/growth", std::to_string(peak - base));
  write_file(role_dir() + "/report", report);
  pipe.close();
}

void flood_producer_role() {
  const Flood f = flood_from_env();
  PipeOptions o = options();
  o.max_unreceived = f.max_unreceived;
  Pipe pipe = Pipe::connect("127.0.0.1", std::stoi(*env("TD_FAULT_PORT")), o);
  TensorDict td = tensordict::consolidate(TensorDict({{"x", at::zeros({f.elems})}}));
  at::Tensor x = td.get("x").tensor();
  const auto start = Clock::now();
  int sent = 0;
  try {
    const std::string done = role_dir() + "/report";
    for (; Clock::now() - start < kFloodLimit && !std::filesystem::exists(done); ++sent) {
      x.fill_(static_cast<float>(sent));
      pipe.send(td);
    }
  } catch (const std::exception&) {  // the consumer closed: it has what it wanted
  }
  write_file(role_dir() + "/sent", std::to_string(sent));
}

void run_flood(const Flood& f) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> vars = {
      {"TD_FLOOD_ELEMS", std::to_string(f.elems)},
      {"TD_FLOOD_READS", std::to_string(f.reads)},
      {"TD_FLOOD_INTERVAL_MS",
       std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(f.interval).count())},
      {"TD_FLOOD_WINDOW", std::to_string(f.max_unreceived)}};
  const cpu_set_t all_cpus = pin_to_one_cpu();
  const pid_t consumer = spawn_role("consumer", dir.path, vars);
  const auto port = await_file(dir.path + "/port", 30s);
  auto producer_vars = vars;
  producer_vars.emplace_back("TD_FAULT_PORT", port.value_or("0"));
  const pid_t producer = port ? spawn_role("producer", dir.path, producer_vars) : pid_t{-1};
  ::sched_setaffinity(0, sizeof(all_cpus), &all_cpus);
  ASSERT_TRUE(port.has_value()) << "the consumer did not listen";
  const auto consumer_status = wait_child(consumer, kFloodLimit + 30s);
  const auto producer_status = wait_child(producer, 60s);
  EXPECT_TRUE(exited_cleanly(consumer_status)) << describe(consumer_status);
  EXPECT_TRUE(exited_cleanly(producer_status)) << describe(producer_status);
  EXPECT_EQ(read_file(dir.path + "/report").value_or("<no report>"), "ok");
  const int64_t growth = std::stoll(read_file(dir.path + "/growth").value_or("-1"));
  const int sent = std::stoi(read_file(dir.path + "/sent").value_or("-1"));
  std::printf(
      "[fault] flood of %lld-byte messages, one read per %lld ms: consumer RSS grew "
      "%.1f MB over %d reads; the producer completed %d sends\n",
      static_cast<long long>(f.elems * 4),
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(f.interval).count()),
      growth / 1e6, f.reads, sent);
  EXPECT_GE(growth, 0);
  EXPECT_LT(growth, kFloodRssBound);
  // Held back: at most the window (plus the send in flight) beyond what was read.
  EXPECT_LE(sent, f.reads + f.max_unreceived + 1);
}

TEST(PipeFault, FloodOfLargeMessagesKeepsTheConsumerBounded) {
  if (auto r = role()) {
    *r == "consumer" ? flood_consumer_role() : flood_producer_role();
    return;
  }
  // The measurement: 1 MiB messages, one read a second, 20 s.
  run_flood({.elems = int64_t{1} << 18, .reads = 21, .interval = 1s, .max_unreceived = 16});
}

TEST(PipeFault, FloodOfSmallMessagesIsHeldBackByTheWindow) {
  if (auto r = role()) {
    *r == "consumer" ? flood_consumer_role() : flood_producer_role();
    return;
  }
  // 4 KiB messages go eagerly (no rendezvous): only the window holds the producer back.
  run_flood({.elems = 1024, .reads = 40, .interval = 50ms, .max_unreceived = 8});
}

// ---- clients that come and go cost the server nothing that lasts -----------------------------

// Each of kComers clients connects, sends one TensorDict in the uncollated framing to a server
// of the consolidated one (its handler's recv throws) and closes, from another process, four at
// a time. The server, still open, must have joined every handler thread and released every
// descriptor of theirs (it keeps the latest 1,000 handler errors at most); then it serves an
// honest client.
constexpr int kComers = 300;

void comers_role() {
  const int port = std::stoi(env("TD_FAULT_PORT").value_or("0"));
  PipeOptions o = options();
  o.consolidated = false;
  const TensorDict td = pipe_test::worked_example(1);
  constexpr int kLines = 4;  // clients at a time
  std::vector<std::thread> lines;
  for (int l = 0; l < kLines; ++l) {
    lines.emplace_back([&, l] {
      for (int i = l; i < kComers; i += kLines) {
        Pipe pipe = Pipe::connect("127.0.0.1", port, o);
        try {
          pipe.send(td);
        } catch (const c10::Error&) {  // the server may break the pipe before the last leaf
        }
        pipe.close();
      }
    });
  }
  for (auto& t : lines) t.join();
}

TEST(PipeFault, ServerForgetsClientsThatCameAndWent) {
  if (role()) return comers_role();
  pipe_test::Watchdog dog(110s);
  {  // UCX's process-wide state, made once
    TensorDictServer warm(0, "127.0.0.1", options());
    Pipe c = Pipe::connect("127.0.0.1", warm.port(), options());
  }
  TensorDictServer server(0, "127.0.0.1", options());
  std::atomic<int> ended{0};
  server.serve([&](Pipe& p) {
    struct Count {
      std::atomic<int>& n;
      ~Count() { ++n; }
    } count{ended};
    for (;;) {
      TensorDict td = p.recv();
      p.send(td);
    }
  });
  std::this_thread::sleep_for(300ms);  // the listener's first sweep opens what it keeps
  const int fds = pipe_test::open_fds(), tasks = pipe_test::threads();
  TempDir dir;
  const pid_t comers =
      spawn_role("comers", dir.path, {{"TD_FAULT_PORT", std::to_string(server.port())}});
  const auto status = wait_child(comers, 90s);
  EXPECT_TRUE(exited_cleanly(status)) << describe(status);
  // Finished handlers are joined by the accept thread within its slice (200 ms).
  const auto deadline = Clock::now() + 5s;
  while (Clock::now() < deadline &&
         (ended.load() < kComers || pipe_test::threads() > tasks || pipe_test::open_fds() > fds)) {
    std::this_thread::sleep_for(20ms);
  }
  const auto errors = server.handler_errors();
  std::printf(
      "[fault] %d clients came and went: %d handlers ended; threads %d -> %d, descriptors "
      "%d -> %d with the server open; %zu handler errors kept\n",
      kComers, ended.load(), tasks, pipe_test::threads(), fds, pipe_test::open_fds(),
      errors.size());
  EXPECT_EQ(ended.load(), kComers);
  EXPECT_LE(pipe_test::threads(), tasks);
  EXPECT_LE(pipe_test::open_fds(), fds);
  EXPECT_EQ(errors.size(), static_cast<size_t>(kComers));
  Pipe honest = Pipe::connect("127.0.0.1", server.port(), options());
  honest.send(pipe_test::worked_example(4));
  pipe_test::expect_same(pipe_test::worked_example(4), honest.recv());
  honest.close();
  server.close();
}

}  // namespace

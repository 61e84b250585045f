// Publication over the pipe (docs/publication.md): a TensorDictServer's Publisher and
// Subscribers on TensorDictPipes. Subscribers run as processes of their own (fault_test_util.h):
// versions whole and increasing, pulls in place, timeouts that return nothing and keep the
// pipe, the publisher's close seen as such; a subscriber SIGSTOPped and one SIGKILLed mid-pull
// cost the publisher their slots only. Raw peers forge the messages of docs/wire-format.md §9
// byte by byte: a forged request is refused and recorded, forged offers get named errors, and a
// server without a Publisher is named.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/testing.h"
#include "fault_test_util.h"
#include "pipe_test_util.h"
#include "publication_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/errors.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/pipe/publication.h"
#include "tensordict/pipe/server.h"
#include "tensordict/tensor_dict.h"

namespace {

using namespace fault_test;
using publication_test::get_u64;
using publication_test::message;
using tensordict::Pulled;
using tensordict::TensorDict;
using tensordict::TestKey;
using tensordict::pipe::Pipe;
using tensordict::pipe::PipeOptions;
using tensordict::pipe::Publisher;
using tensordict::pipe::Subscriber;
using tensordict::pipe::TensorDictServer;

PipeOptions options() {
  PipeOptions o;
  o.timeout = std::chrono::seconds(20);
  return o;
}

TensorDict weights(double v, int64_t elems = 24) {
  TensorDict inner({{"w", at::full({elems}, v, at::kDouble)}}, {});
  return TensorDict({{"bias", at::full({3}, v)},
                     {"layer", inner},
                     {"steps", at::full({2}, static_cast<int64_t>(v), at::kLong)}},
                    {});
}

void fill(TensorDict& td, double v) {
  td.get("bias").tensor().fill_(v);
  td.get("layer").tensordict().get("w").tensor().fill_(v);
  td.get("steps").tensor().fill_(v);
}

// Every leaf of td holds v.
bool holds(const TensorDict& td, double v) {
  return td.get("bias").tensor().eq(v).all().item<bool>() &&
         td.get("layer").tensordict().get("w").tensor().eq(v).all().item<bool>() &&
         td.get("steps").tensor().eq(v).all().item<bool>();
}

int port_of(const std::string& dir) { return std::stoi(*await_file(dir + "/port", 30s)); }

// ---- versions, in place, timeouts and the publisher's close, three subscriber processes ------

constexpr int kVersions = 40;

void subscriber_role() {
  Pipe pipe = Pipe::connect("127.0.0.1", port_of(role_dir()), options());
  Subscriber sub(pipe);
  std::string report;
  auto first = sub.pull({.timeout = 20s});
  if (!first || !holds(first->td, static_cast<double>(first->version))) std::abort();
  TensorDict td = first->td;
  const void* storage = tensordict::consolidated_storage(td).data_ptr();
  int64_t last = first->version;
  while (last < kVersions) {
    auto v = sub.pull(td, {.timeout = 20s});
    if (!v || *v <= last || !holds(td, static_cast<double>(*v))) std::abort();  // never torn
    last = *v;
  }
  const bool same_storage = tensordict::consolidated_storage(td).data_ptr() == storage;
  // Nothing newer: the timeout returns nothing, td unchanged, the pipe usable.
  const auto t0 = std::chrono::steady_clock::now();
  const bool none = !sub.pull(td, {.timeout = 300ms}).has_value();
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  write_file(role_dir() + "/done." + *env("TD_SUB"), "");
  // The publisher closes after every subscriber is done: a pull waiting then is told so.
  std::string closed = "no error";
  try {
    sub.pull(td, {.timeout = 20s});
  } catch (const tensordict::NoPublisherError& e) {
    closed = e.msg();
  }
  write_file(role_dir() + "/report." + *env("TD_SUB"),
             c10::str(same_storage, " ", none, " ", waited_ms < 3000, " ", holds(td, kVersions),
                      " ", sub.publisher_closed(), "\n", closed));
}

TEST(PipePublication, VersionsAreWholeAndTimeoutsKeepThePipe) {
  if (role()) return subscriber_role();
  pipe_test::Watchdog watchdog(120s);
  TempDir dir;
  TensorDictServer server(0, "127.0.0.1", options());
  Publisher pub(server, {.max_slots = 2});
  EXPECT_NE(pub.epoch(), 0u);
  EXPECT_EQ(pub.version(), 0);
  write_file(dir.path + "/port", std::to_string(server.port()));
  std::vector<pid_t> subs;
  for (int i = 0; i < 3; ++i)
    subs.push_back(spawn_role("sub", dir.path, {{"TD_SUB", std::to_string(i)}}));
  pub.wait_for_subscribers(30s, 3);
  TensorDict td = weights(0);
  for (int v = 1; v <= kVersions; ++v) {
    fill(td, v);
    EXPECT_EQ(pub.publish(td), v);
    std::this_thread::sleep_for(2ms);
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(await_file(dir.path + "/done." + std::to_string(i), 60s)) << "subscriber " << i;
  }
  const auto stats = pub.stats();
  ASSERT_EQ(stats.size(), 3u);
  for (const auto& s : stats) {
    EXPECT_EQ(s.version, kVersions) << s.peer;  // the acknowledgement
    EXPECT_GE(s.pulls, 2) << s.peer;
    EXPECT_FALSE(s.lost) << s.peer << ": " << s.error;
    EXPECT_FALSE(s.pinned.has_value()) << s.peer;
    EXPECT_EQ(s.rank, -1);
    EXPECT_NE(s.peer.find("127.0.0.1:"), std::string::npos) << s.peer;
  }
  pub.close();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(exited_cleanly(wait_child(subs[i], 60s))) << "subscriber " << i;
    const auto report = read_file(dir.path + "/report." + std::to_string(i));
    ASSERT_TRUE(report.has_value());
    EXPECT_EQ(report->substr(0, report->find('\n')), "1 1 1 1 1") << *report;
    EXPECT_NE(report->find("closed"), std::string::npos) << *report;
  }
}

// ---- a subscriber stopped and one killed, mid-pull ------------------------------------------

constexpr int64_t kBigElems = int64_t{4} << 20;  // float64: 32 MB a version

void puller_role() {
  Pipe pipe = Pipe::connect("127.0.0.1", port_of(role_dir()), options());
  Subscriber sub(pipe);
  auto first = sub.pull({.timeout = 30s});
  if (!first) std::abort();
  TensorDict td = first->td;
  const std::string name = *env("TD_SUB");
  int64_t last = first->version;
  while (true) {
    std::optional<int64_t> v;
    try {
      v = sub.pull(td, {.timeout = 30s});
    } catch (const tensordict::NoPublisherError&) {
      break;  // the publisher closed: the end
    }
    if (!v) continue;
    if (*v <= last || !holds(td, static_cast<double>(*v))) std::abort();
    last = *v;
    write_file(role_dir() + "/last." + name, std::to_string(last));
  }
  write_file(role_dir() + "/end." + name, std::to_string(last));
}

std::optional<int64_t> pinned_by(const Publisher& pub, const std::string& peer) {
  for (const auto& s : pub.stats()) {
    if (s.peer == peer) return s.pinned;
  }
  return std::nullopt;
}

TEST(PipePublication, StoppedAndKilledSubscribersCostOnlyTheirSlots) {
  if (role()) return puller_role();
  pipe_test::Watchdog watchdog(180s);
  TempDir dir;
  TensorDictServer server(0, "127.0.0.1", options());
  // One slot each for the stopped and the killed one, one for the healthy one, one to fill.
  Publisher pub(server, {.max_slots = 4});
  write_file(dir.path + "/port", std::to_string(server.port()));
  TensorDict td = weights(0, kBigElems);
  fill(td, 1);
  pub.publish(td);
  const char* names[] = {"healthy", "stopped", "killed"};
  std::vector<pid_t> pids;
  for (const char* n : names) {
    pids.push_back(spawn_role("sub", dir.path, {{"TD_SUB", n}}));
    pub.wait_for_subscribers(30s, pids.size());
  }
  std::vector<std::string> peers;
  for (const auto& s : pub.stats()) peers.push_back(s.peer);
  ASSERT_EQ(peers.size(), 3u);
  // Publishes until each victim is caught pinning a slot (mid-pull), then stops or kills it.
  int v = 1;
  const auto catch_pinned = [&](size_t who, int sig) {
    for (int tries = 0; tries < 2000; ++tries) {
      fill(td, ++v);
      pub.publish(td);
      for (int spin = 0; spin < 50; ++spin) {
        if (pinned_by(pub, peers[who])) {
          ::kill(pids[who], sig);
          return true;
        }
        std::this_thread::sleep_for(100us);
      }
    }
    return false;
  };
  // Which peer is which: the order of connection is the order of spawning.
  ASSERT_TRUE(catch_pinned(1, SIGSTOP)) << "the stopped subscriber never pulled";
  ASSERT_TRUE(catch_pinned(2, SIGKILL)) << "the killed subscriber never pulled";
  // Publishing goes on at full speed: the two victims pin at most their two slots.
  double slowest_ms = 0;
  for (int i = 0; i < 20; ++i) {
    fill(td, ++v);
    const auto t0 = std::chrono::steady_clock::now();
    pub.publish(td, 5s);
    slowest_ms = std::max(
        slowest_ms,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_LT(slowest_ms, 1000) << "a publish waited for a stopped or killed subscriber";
  // The healthy one keeps up.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline &&
         read_file(dir.path + "/last.healthy").value_or("0") != std::to_string(v)) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(read_file(dir.path + "/last.healthy").value_or("none"), std::to_string(v));
  // UCX reports the killed one's connection: it is lost and pins nothing.
  bool lost = false;
  for (int i = 0; i < 300 && !lost; ++i) {
    for (const auto& s : pub.stats()) lost = lost || (s.peer == peers[2] && s.lost && !s.pinned);
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(lost) << "the killed subscriber was not recorded as lost";
  EXPECT_TRUE(was_sigkilled(wait_child(pids[2], 10s)));
  // The stopped one goes on and completes its pull with a whole version.
  const auto before = read_file(dir.path + "/last.stopped");
  ::kill(pids[1], SIGCONT);
  const auto resumed = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < resumed &&
         read_file(dir.path + "/last.stopped") == before) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_NE(read_file(dir.path + "/last.stopped"), before);
  pub.close();
  EXPECT_TRUE(exited_cleanly(wait_child(pids[0], 30s)));
  EXPECT_TRUE(exited_cleanly(wait_child(pids[1], 30s)));
  std::printf(
      "[publication] pipe: slowest publish with one subscriber stopped and one killed "
      "mid-pull: %.1f ms\n",
      slowest_ms);
}

// ---- forged messages and absent publishers, raw peers in this process -----------------------

// A raw publisher's end: a listening pipe that reads each request and answers with `answer`.
struct RawPublisher {
  Pipe pipe = Pipe::listen(0, "127.0.0.1", pipe_test::fast_options());
  std::string request() { return pipe.recv_raw(TestKey{}, 64); }
  void send(const std::string& bytes) { pipe.send_raw(TestKey{}, bytes.data(), bytes.size()); }
};

// The error of a pull from `raw`'s pipe, while `serve` plays the publisher.
template <typename Serve>
std::string pull_error(Serve&& serve, std::chrono::milliseconds timeout = 10s) {
  RawPublisher raw;
  std::thread publisher([&] { serve(raw); });
  std::string error = "<no error>";
  try {
    Subscriber sub(Pipe::connect("127.0.0.1", raw.pipe.port(), pipe_test::fast_options()));
    TensorDict td = weights(0);
    for (int i = 0; i < 2; ++i) sub.pull(td, {.timeout = timeout});
  } catch (const c10::Error& e) {
    error = e.msg();
  }
  publisher.join();
  raw.pipe.close();
  return error;
}

TEST(PipePublication, ForgedOffersAndAbsentPublishersGetNamedErrors) {
  pipe_test::Watchdog watchdog(120s);
  // A server that runs no Publisher never takes the request.
  const auto t0 = std::chrono::steady_clock::now();
  std::string e = pull_error([](RawPublisher& raw) { raw.pipe.accept(); }, 400ms);
  EXPECT_NE(e.find("has taken no request"), std::string::npos) << e;
  EXPECT_NE(e.find("runs no Publisher"), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);

  const uint64_t epoch = 77;
  e = pull_error([](RawPublisher& raw) {
    raw.request();
    raw.send(message("TDPUBXXX", 1, {1, 77, 1, 8, 0, 5}));
  });
  EXPECT_NE(e.find("magic"), std::string::npos) << e;

  e = pull_error([](RawPublisher& raw) {
    raw.request();
    raw.send(message("TDPUBOFR", 1, {1, 77, 1, uint64_t{1} << 60, 0, 5}));
  });
  EXPECT_NE(e.find("max_total_bytes"), std::string::npos) << e;

  e = pull_error([](RawPublisher& raw) {
    raw.request();
    raw.send(message("TDPUBOFR", 9, {1, 77, 1, 8, 0, 5}));
  });
  EXPECT_NE(e.find("status"), std::string::npos) << e;

  // A version, then one that goes back within the same epoch.
  const TensorDict v5 = tensordict::consolidate(weights(5));
  const at::Tensor storage = tensordict::consolidated_storage(v5);
  const int64_t n = storage.numel();
  const std::string json =
      tensordict::metadata_to_json(tensordict::metadata_of(v5), false, {{"_total_bytes", n}});
  const std::string data(static_cast<const char*>(storage.data_ptr()), static_cast<size_t>(n));
  e = pull_error([&](RawPublisher& raw) {
    const std::string r = raw.request();
    EXPECT_EQ(get_u64(reinterpret_cast<const uint8_t*>(r.data()) + 16), 1u);  // seq
    raw.send(message(
        "TDPUBOFR", 1,
        {1, epoch, 5, static_cast<uint64_t>(n), json.size(), publication_test::schema_hash(json)}));
    raw.send(json);
    raw.send(data);
    raw.request();
    raw.send(
        message("TDPUBOFR", 1,
                {2, epoch, 3, static_cast<uint64_t>(n), 0, publication_test::schema_hash(json)}));
  });
  EXPECT_NE(e.find("version"), std::string::npos) << e;

  // Data shorter than its offer announced.
  e = pull_error([&](RawPublisher& raw) {
    raw.request();
    raw.send(message(
        "TDPUBOFR", 1,
        {1, epoch, 5, static_cast<uint64_t>(n), json.size(), publication_test::schema_hash(json)}));
    raw.send(json);
    raw.send(data.substr(0, data.size() / 2));
  });
  EXPECT_NE(e.find("stopped short"), std::string::npos) << e;

  // A schema that is not JSON, and no data ever: refused at once, whatever the pull's timeout
  // (the data is never waited for); a second pull raises the same refusal.
  auto t1 = std::chrono::steady_clock::now();
  e = pull_error(
      [&](RawPublisher& raw) {
        raw.request();
        const std::string bad = "{not json";
        raw.send(message("TDPUBOFR", 1,
                         {1, epoch, 5, static_cast<uint64_t>(n), bad.size(),
                          publication_test::schema_hash(bad)}));
        raw.send(bad);
      },
      3s);
  EXPECT_NE(e.find("schema"), std::string::npos) << e;
  EXPECT_NE(e.find("refused it and pulls no more"), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 2s);

  // Data longer than its offer announced.
  e = pull_error([&](RawPublisher& raw) {
    raw.request();
    raw.send(message(
        "TDPUBOFR", 1,
        {1, epoch, 5, static_cast<uint64_t>(n), json.size(), publication_test::schema_hash(json)}));
    raw.send(json);
    raw.send(data + std::string(1024, '\0'));
  });
  EXPECT_NE(e.find("longer than expected"), std::string::npos) << e;

  // The publisher's close marker where an offer was due: closed.
  e = pull_error([](RawPublisher& raw) {
    raw.request();
    raw.pipe.close();
  });
  EXPECT_NE(e.find("closed"), std::string::npos) << e;
}

TEST(PipePublication, AForgedRequestIsRefusedAndRecorded) {
  pipe_test::Watchdog watchdog(60s);
  TensorDictServer server(0, "127.0.0.1", pipe_test::fast_options());
  Publisher pub(server);
  pub.publish(weights(1));
  Pipe raw = Pipe::connect("127.0.0.1", server.port(), pipe_test::fast_options());
  const std::string forged = message("TDPUBRQX", 0, {1, 0, 0, 0, 0, 0});
  raw.send_raw(TestKey{}, forged.data(), forged.size());
  const std::string answer = raw.recv_raw(TestKey{}, 64);
  EXPECT_EQ(answer.substr(0, 8), "TDPUBOFR");
  EXPECT_EQ(static_cast<uint8_t>(answer[12]), 4) << "status 4: refused";
  bool recorded = false;
  for (int i = 0; i < 100 && !recorded; ++i) {
    for (const auto& s : pub.stats()) {
      recorded = recorded || (s.lost && s.error.find("magic") != std::string::npos);
    }
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(recorded);
  // A well-behaved subscriber is served all the same.
  Pipe pipe = Pipe::connect("127.0.0.1", server.port(), pipe_test::fast_options());
  Subscriber sub(pipe);
  auto got = sub.pull({.timeout = 10s});
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(holds(got->td, 1));
  // The pipe of a subscriber carries nothing else.
  EXPECT_THROW(pipe.send(weights(2)), c10::Error);
  EXPECT_THROW(pipe.recv(), c10::Error);
  raw.close();
}

}  // namespace

namespace {

// Clients that leave a request no version can meet and close cost the server nothing once
// gone: each client's thread sees its close within a slice of its wait for a version, and the
// stats keep the lost ones only up to a bound (docs/publication.md, "What it costs").
TEST(PipePublication, ClientsThatLeaveCostNoThreadAndAreForgotten) {
  TensorDictServer server(0, "127.0.0.1", options());
  Publisher pub(server);
  pub.publish(weights(1));
  const int threads_before = pipe_test::threads();
  for (int i = 0; i < 100; ++i) {
    Pipe pipe = Pipe::connect("127.0.0.1", server.port(), options());
    Subscriber sub(pipe);
    sub.interrupt();  // the request goes, the pull returns at once
    EXPECT_FALSE(sub.pull({.min_version = 1000}).has_value());
    pipe.close();
  }
  // Each client's thread notices its close within a slice of its wait; on a loaded machine the
  // last few take longer, so both counts are given 5 s to settle.
  int threads_after = pipe_test::threads();
  for (int i = 0; i < 100 && (threads_after > threads_before + 4 || pub.stats().size() > 65u);
       ++i) {
    std::this_thread::sleep_for(50ms);
    threads_after = pipe_test::threads();
  }
  std::printf("[pipe] threads before %d, after 100 clients left %d; stats entries %zu\n",
              threads_before, threads_after, pub.stats().size());
  EXPECT_LE(threads_after, threads_before + 4);
  EXPECT_LE(pub.stats().size(), 65u);  // 64 lost ones kept, and the last to leave
  // An honest client is still served.
  Pipe pipe = Pipe::connect("127.0.0.1", server.port(), options());
  Subscriber sub(pipe);
  const auto v = sub.pull({.timeout = 10s});
  ASSERT_TRUE(v.has_value());
  EXPECT_TRUE(holds(v->td, 1));
}

}  // namespace

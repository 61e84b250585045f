// Soak: many transfers, every one verified, and memory that stays flat.
//
// Part 1, Gloo (two ranks through dist::run): N iterations (default 10,000), each one a per-leaf
// and a consolidated transfer of a TensorDict built for that iteration (random contents seeded
// by the iteration number, a fresh TensorDict every time), the direction alternating. The
// sender stamps a checksum of the data into the TensorDict; the receiver recomputes the
// checksum of what arrived and compares it with the stamped one AND with the checksum of the
// TensorDict it builds itself for that iteration, so a corrupted, stale or misrouted transfer
// fails. Each rank samples VmRSS after a warm-up (a tenth of the iterations) and at the end and
// fails when it grew by more than 5 MB.
//
// Part 2, the UCX pipe: a TensorDictServer and 8 client threads (one pipe and UCX worker each)
// exchanging for 60 s. Each message carries its client id, a sequence number and a checksum;
// the server checks the sequence, the checksum against the data and against the message it
// builds itself for (client, seq), and echoes it; the client checks the echo. The schema
// changes every 500 messages. At the end, per client, sent == received by the server ==
// echoes received, with no bad message.
//
// Options (environment): SOAK_TRANSFERS (10000), SOAK_PIPE_SECONDS (60), SOAK_CLIENTS (8),
// SOAK_RSS_LIMIT_KB (5120); SOAK_CORRUPT_AT=i flips a received bit at iteration i (Gloo) and
// in client 0's message i (pipe), to see the checks fail. Exit code 0 when every check passed.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../cpp/checksum.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/runner.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/pipe/server.h"
#include "tensordict/tensor_dict.h"
#include "wire/leaf_order.h"

namespace {

using tensordict::TensorDict;
namespace dist = tensordict::dist;
namespace wire = tensordict::wire;
namespace tdpipe = tensordict::pipe;
using Clock = std::chrono::steady_clock;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::stoll(v) : fallback;
}

// Flips one bit of a received leaf when SOAK_CORRUPT_AT names this transfer (a self-test of
// the checks).
void maybe_corrupt(const at::Tensor& leaf, int64_t index) {
  static const int64_t at_index = env_int("SOAK_CORRUPT_AT", -1);
  if (index != at_index) return;
  auto* p = static_cast<uint8_t*>(leaf.data_ptr());
  p[leaf.nbytes() / 2] ^= 0x10;
}

int64_t rss_kb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

using tensordict::testing::fnv;
using tensordict::testing::kFnvBasis;

// Checksum of every leaf but "checksum", in wire order (key paths hashed too).
int64_t checksum(const TensorDict& td) {
  uint64_t h = kFnvBasis;
  for (const auto& [path, tensor] : wire::leaves_in_order(td)) {
    if (path.size() == 1 && path[0] == "checksum") continue;
    for (const auto& part : path) {
      for (char ch : part) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
    }
    h = fnv(h, tensor);
  }
  return static_cast<int64_t>(h);
}

// ---- part 1: Gloo ---------------------------------------------------------------------------

constexpr int64_t kBatch = 32;

// The TensorDict of iteration i (about 26 KB in 7 leaves), its checksum stamped in.
TensorDict iteration_td(int64_t i) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(i) + 1);
  TensorDict next({{"obs", at::randn({kBatch, 64}, gen)},
                   {"reward", at::randn({kBatch, 1}, gen)},
                   {"done", at::rand({kBatch}, gen).lt(0.1)}},
                  {kBatch});
  TensorDict td({{"obs", at::randn({kBatch, 64}, gen)},
                 {"action", at::randint(0, 1 << 30, {kBatch, 4}, gen, at::kLong)},
                 {"next", next},
                 {"iter", at::full({kBatch}, i, at::kLong)},
                 {"checksum", at::zeros({kBatch}, at::kLong)}},
                {kBatch});
  td.get("checksum").tensor().fill_(checksum(td));
  return td;
}

void verify(const TensorDict& got, int64_t i, const char* mode) {
  const int64_t stamped = got.get("checksum").tensor()[0].item<int64_t>();
  const int64_t actual = checksum(got);
  const int64_t expected = iteration_td(i).get("checksum").tensor()[0].item<int64_t>();
  TORCH_CHECK(actual == stamped && actual == expected, "soak: ", mode, " transfer ", i,
              ": checksum of the data ", actual, ", stamped by the sender ", stamped,
              ", expected for this iteration ", expected);
  TORCH_CHECK(got.get("iter").tensor().eq(i).all().item<bool>(), "soak: ", mode, " transfer ", i,
              ": wrong iteration number");
}

void dist_soak(int rank, int /*world_size*/) {
  at::set_num_threads(1);
  const int64_t n = env_int("SOAK_TRANSFERS", 10000);
  const int64_t warmup = n / 10;
  const int64_t limit_kb = env_int("SOAK_RSS_LIMIT_KB", 5120);
  const int peer = 1 - rank;
  TensorDict recv_td = iteration_td(-1);
  TensorDict recv_ctd = tensordict::consolidate(iteration_td(-1));
  int64_t sent = 0, received = 0, rss_warm = 0, rss_mid = 0;
  const auto start = Clock::now();
  auto warm_time = start;
  for (int64_t i = 0; i < n; ++i) {
    if (i == warmup) {
      rss_warm = rss_kb();
      warm_time = Clock::now();
    }
    if (i == (n + warmup) / 2) rss_mid = rss_kb();
    // Per-leaf tags never use 0, the consolidated message's tag.
    const int64_t init_tag = 1 + (i % 100) * 8;
    if (i % 2 == rank) {
      TensorDict td = iteration_td(i);
      dist::send(td, peer, {.init_tag = init_tag});
      dist::send(td, peer, {.consolidated = true});  // consolidates a copy each time
      sent += 2;
    } else {
      recv_td.get("checksum").tensor().zero_();
      dist::recv(recv_td, peer, {.init_tag = init_tag});
      maybe_corrupt(recv_td.get(std::vector<std::string>{"next", "obs"}).tensor(), i);
      verify(recv_td, i, "per-leaf");
      recv_ctd.get("checksum").tensor().zero_();
      dist::recv(recv_ctd, peer, {.consolidated = true});
      verify(recv_ctd, i, "consolidated");
      received += 2;
    }
  }
  const int64_t rss_end = rss_kb();
  const double total_s = seconds_since(start);
  std::printf(
      "[soak] gloo rank %d: %lld per-leaf + %lld consolidated transfers (sent %lld, "
      "received and verified %lld) in %.1f s (%.0f us per iteration after warm-up); "
      "VmRSS after %lld warm-up iterations %lld kB, mid-run %lld kB, end %lld kB, "
      "growth %+lld kB (limit %lld kB)\n",
      rank, static_cast<long long>(n), static_cast<long long>(n), static_cast<long long>(sent),
      static_cast<long long>(received), total_s,
      1e6 * seconds_since(warm_time) / static_cast<double>(n - warmup),
      static_cast<long long>(warmup), static_cast<long long>(rss_warm),
      static_cast<long long>(rss_mid), static_cast<long long>(rss_end),
      static_cast<long long>(rss_end - rss_warm), static_cast<long long>(limit_kb));
  std::fflush(stdout);
  TORCH_CHECK(sent + received == 2 * n, "soak: rank ", rank, " moved ", sent + received,
              " TensorDicts, expected ", 2 * n);
  TORCH_CHECK(rss_end - rss_warm <= limit_kb, "soak: rank ", rank, " VmRSS grew by ",
              rss_end - rss_warm, " kB after the warm-up (limit ", limit_kb, " kB)");
}

// ---- part 2: the pipe -----------------------------------------------------------------------

// Message seq of client c: 1024 or 4096 floats (the schema changes every 500 messages).
TensorDict pipe_message(int64_t client, int64_t seq) {
  const int64_t elems = (seq / 500) % 2 == 0 ? 1024 : 4096;
  at::Tensor data = at::arange(elems, at::kFloat)
                        .mul_(static_cast<double>(client + 1))
                        .add_(static_cast<double>(seq));
  TensorDict td({{"client", at::full({1}, client, at::kLong)},
                 {"seq", at::full({1}, seq, at::kLong)},
                 {"data", data},
                 {"checksum", at::zeros({1}, at::kLong)}});
  td.get("checksum").tensor().fill_(checksum(td));
  return td;
}

int64_t scalar(const TensorDict& td, const char* key) {
  return td.get(key).tensor().item<int64_t>();
}

// Checks a received message against (client, seq): its stamped checksum against its data
// and against the message built here.
bool message_ok(const TensorDict& td, int64_t client, int64_t seq) {
  if (scalar(td, "client") != client || scalar(td, "seq") != seq) return false;
  const int64_t stamped = scalar(td, "checksum");
  return checksum(td) == stamped && stamped == scalar(pipe_message(client, seq), "checksum");
}

struct ClientCounts {
  int64_t sent = 0, echoed = 0, bad_echoes = 0;
  std::string error;
};
struct ServerCounts {
  std::atomic<int64_t> received{0}, bad{0};
};

bool pipe_soak() {
  const int64_t seconds = env_int("SOAK_PIPE_SECONDS", 60);
  const int clients = static_cast<int>(env_int("SOAK_CLIENTS", 8));
  tdpipe::PipeOptions options;
  options.timeout = std::chrono::seconds(30);
  std::vector<ServerCounts> server_counts(clients);
  std::mutex mu;
  std::vector<std::string> handler_errors;
  tdpipe::TensorDictServer server(0, "127.0.0.1", options);
  server.serve([&](tdpipe::Pipe& pipe) {
    int64_t client = -1, expected = 0;
    try {
      while (true) {
        TensorDict td = pipe.recv();
        if (client < 0) client = scalar(td, "client");
        TORCH_CHECK(client >= 0 && client < clients, "soak: bad client id ", client);
        if (client == 0) maybe_corrupt(td.get("data").tensor(), expected);
        if (!message_ok(td, client, expected)) ++server_counts[client].bad;
        ++server_counts[client].received;
        ++expected;
        pipe.send(td);
      }
    } catch (const std::exception& e) {
      if (pipe.peer_closed()) return;
      std::lock_guard<std::mutex> lk(mu);
      handler_errors.push_back(e.what());
    }
  });
  const int64_t rss_start = rss_kb();
  int64_t rss_warm = 0;
  std::vector<ClientCounts> counts(clients);
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::seconds(seconds);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      try {
        tdpipe::Pipe pipe = tdpipe::Pipe::connect("127.0.0.1", server.port(), options);
        for (int64_t seq = 0; Clock::now() < deadline; ++seq) {
          pipe.send(pipe_message(c, seq));
          ++counts[c].sent;
          TensorDict echo = pipe.recv();
          ++counts[c].echoed;
          if (!message_ok(echo, c, seq)) ++counts[c].bad_echoes;
        }
        pipe.close();  // the close marker: the server's handler ends cleanly
      } catch (const std::exception& e) {
        counts[c].error = e.what();
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(std::min<int64_t>(seconds / 6, 10)));
  rss_warm = rss_kb();
  for (auto& t : threads) t.join();
  const double elapsed = seconds_since(start);
  // Handlers end on the clients' close markers; give them a moment, then close the server.
  for (int i = 0; i < 200; ++i) {
    int64_t got = 0, sent = 0;
    for (int c = 0; c < clients; ++c) {
      got += server_counts[c].received;
      sent += counts[c].sent;
    }
    if (got >= sent) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t rss_end = rss_kb();
  const int64_t accepted = server.clients();
  server.close();

  bool ok = accepted == clients && handler_errors.empty();
  int64_t total = 0;
  for (int c = 0; c < clients; ++c) {
    const auto& k = counts[c];
    const int64_t got = server_counts[c].received, bad = server_counts[c].bad;
    const bool client_ok = k.error.empty() && k.sent > 0 && k.sent == got && k.echoed == k.sent &&
                           bad == 0 && k.bad_echoes == 0;
    ok = ok && client_ok;
    total += k.sent;
    std::printf(
        "[soak] pipe client %d: sent %lld, server received %lld (bad %lld), echoes "
        "received %lld (bad %lld)%s%s\n",
        c, static_cast<long long>(k.sent), static_cast<long long>(got), static_cast<long long>(bad),
        static_cast<long long>(k.echoed), static_cast<long long>(k.bad_echoes),
        k.error.empty() ? "" : ": ", k.error.c_str());
  }
  for (const auto& e : handler_errors) std::printf("[soak] pipe handler error: %s\n", e.c_str());
  std::printf(
      "[soak] pipe: %d clients, %lld messages each way in %.1f s (%.0f round trips/s); "
      "accepted %lld; process VmRSS at start %lld kB, after %lld s %lld kB, end %lld kB "
      "(growth after warm-up %+lld kB): %s\n",
      clients, static_cast<long long>(total), elapsed, total / elapsed,
      static_cast<long long>(accepted), static_cast<long long>(rss_start),
      static_cast<long long>(std::min<int64_t>(seconds / 6, 10)), static_cast<long long>(rss_warm),
      static_cast<long long>(rss_end), static_cast<long long>(rss_end - rss_warm),
      ok ? "OK" : "FAILED");
  std::fflush(stdout);
  return ok;
}

}  // namespace

int main() {
  const auto start = Clock::now();
  // The ranks re-run main() up to here and end inside run(): keep nothing before it.
  try {
    dist::run(dist_soak, 2,
              {.timeout = std::chrono::minutes(10), .group_timeout = std::chrono::seconds(30)});
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::printf("[soak] gloo part FAILED: %s\n", c10_error ? c10_error->msg().c_str() : e.what());
    return 1;
  }
  std::printf("[soak] gloo part OK in %.1f s\n", seconds_since(start));
  std::fflush(stdout);
  const auto pipe_start = Clock::now();
  const bool ok = pipe_soak();
  std::printf("[soak] pipe part %s in %.1f s; total %.1f s\n", ok ? "OK" : "FAILED",
              seconds_since(pipe_start), seconds_since(start));
  return ok ? 0 : 1;
}

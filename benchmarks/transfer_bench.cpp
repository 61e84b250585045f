// The C++ arms of benchmarks/run: our transfers called from C++, against floors measured in the
// same run, on two ranks (dist::run: Gloo over 127.0.0.1, a FileStore). benchmarks/run passes
// the cases, reads the JSON this writes, and adds the Python arms and ucx_perftest.
//
//   transfer_bench --case NAME:LEAVES:BYTES_PER_LEAF:NESTED ... --json PATH
//                  [--cap SECONDS] [--min-reps N] [--max-reps N] [--warmup N]
//                  [--arms ID,ID,...]   (only these arms and floor.raw_one: to profile one)
//
// Arms (JSON ids): floor.raw_one (one raw c10d send of the consolidated storage's bytes),
// floor.raw_n (one raw message per leaf, all posted then waited; only with several leaves),
// floor.memcpy (rank 0 alone: memcpy of the same bytes into a warm buffer), cpp.per_leaf,
// cpp.consolidated (a consolidated TensorDict, one message), cpp.per_leaf_timeout and
// cpp.consolidated_timeout (the same receives with a timeout), cpp.per_leaf_checked and
// cpp.consolidated_checked (the same with checked = true), cpp.init_remote (init_remote /
// from_remote_init of the plain TensorDict: a cold start), cpp.pipe (when built with the UCX
// pipe: TensorDictPipe in consolidated mode, the schema sent once in the warm-up).
//
// A timed transfer is sender start -> data received -> a small ack back, so it measures
// delivery, not the hand-off to the transport. Within a round every arm runs once, in a new
// random order each round, so drift on a shared machine hits all arms alike. Rank 0
// stops a case once the median of every arm is known to within kTightCi (distribution-free
// 95% interval), or at the time cap, never before --min-reps rounds. After timing, rank 1
// checks every value it received against the pattern the sender wrote.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tensordict/consolidate.h"
#include "tensordict/distributed/collectives.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/runner.h"
#include "wire/leaf_order.h"
#if __has_include("tensordict/distributed/init_remote.h")
#include "tensordict/distributed/init_remote.h"
#define TENSORDICT_BENCH_INIT_REMOTE
#endif
#ifdef TENSORDICT_BENCH_PIPE
#include "core/testing.h"
#include "tensordict/pipe/pipe.h"
#endif

using tensordict::TensorDict;
namespace dist = tensordict::dist;
namespace wire = tensordict::wire;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kAckTag = 1 << 30;  // far above the transfers' tags
constexpr int kCtrlTag = kAckTag + 1;
constexpr double kTightCi = 0.03;  // stop when the median's 95% interval is within +-1.5%
constexpr int kCiMinReps = 30;     // ... but only trust that interval from this many rounds

struct CaseSpec {
  std::string name;
  int64_t leaves = 1;
  int64_t bytes = 1024;  // per leaf, a multiple of 4 (float32 leaves)
  bool nested = false;   // leaves at a{i}/b{j}/c{k}/x: three nested levels
};

struct Config {
  std::vector<CaseSpec> cases;
  std::string json_path;
  double cap_s = 20;
  int min_reps = 5;
  int max_reps = 2000;
  int warmup = 3;
  std::string arms;  // comma-separated ids; empty: all
};

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--case") {
      CaseSpec s;
      char name[128];
      int nested = 0;
      long long leaves = 0, bytes = 0;
      TORCH_CHECK_VALUE(
          std::sscanf(v.c_str(), "%127[^:]:%lld:%lld:%d", name, &leaves, &bytes, &nested) == 4 &&
              leaves > 0 && bytes > 0 && bytes % 4 == 0,
          "--case wants NAME:LEAVES:BYTES_PER_LEAF:NESTED, got ", v);
      s.name = name, s.leaves = leaves, s.bytes = bytes, s.nested = nested != 0;
      c.cases.push_back(s);
    } else if (k == "--json") {
      c.json_path = v;
    } else if (k == "--cap") {
      c.cap_s = std::atof(v.c_str());
    } else if (k == "--min-reps") {
      c.min_reps = std::atoi(v.c_str());
    } else if (k == "--max-reps") {
      c.max_reps = std::atoi(v.c_str());
    } else if (k == "--warmup") {
      c.warmup = std::atoi(v.c_str());
    } else if (k == "--arms") {
      c.arms = "," + v + ",";
    } else {
      TORCH_CHECK_VALUE(false, "unknown option ", k);
    }
  }
  TORCH_CHECK_VALUE(!c.cases.empty() && !c.json_path.empty(), "need --case and --json");
  return c;
}

// Leaf i's values; benchmarks/run's Python ranks write the same ones.
at::Tensor pattern(int64_t i, int64_t floats) {
  return at::arange(floats, at::kFloat).fmod_(1000).add_(static_cast<double>(i));
}

TensorDict make_td(const CaseSpec& s, bool filled) {
  int64_t per_level = 1;
  while (per_level * per_level * per_level < s.leaves) ++per_level;
  TensorDict td;
  for (int64_t i = 0; i < s.leaves; ++i) {
    at::Tensor v = filled ? pattern(i, s.bytes / 4) : at::zeros({s.bytes / 4});
    if (s.nested) {
      const auto a = i / (per_level * per_level), b = (i / per_level) % per_level,
                 c = i % per_level;
      td.set({"a" + std::to_string(a), "b" + std::to_string(b), "c" + std::to_string(c), "x"}, v);
    } else {
      td.set(c10::str("leaf", 1000 + i), v);  // fixed width: insertion and sorted order agree
    }
  }
  return td;
}

std::vector<at::Tensor> leaves_of(const TensorDict& td) {
  std::vector<at::Tensor> out;
  for (auto& [path, t] : wire::leaves_in_order(td)) out.push_back(t);
  return out;
}

bool equal_leaves(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

struct Arm {
  std::string id;
  bool local = false;                            // rank 0 only, no transfer and no ack
  std::function<void()> send{};                  // rank 0 (a local arm's work)
  std::function<void()> recv{};                  // rank 1
  std::function<void()> ack_send{}, ack_recv{};  // empty: the process group carries the ack
  std::function<bool()> verify{};                // after timing, on rank 1 (rank 0 for a local arm)
};

struct Peers {
  dist::ProcessGroupPtr pg;
#ifdef TENSORDICT_BENCH_PIPE
  std::optional<tensordict::pipe::Pipe> pipe{};
#endif
};

// The arms of one case, holding this rank's buffers. Sender buffers are shared between arms
// (the same bytes leave from the same memory); each receiving arm has its own, so that each
// arm's data is checked on its own.
std::vector<Arm> make_arms(const CaseSpec& s, int rank, Peers& peers) {
  const bool sender = rank == 0;
  auto pg = peers.pg;
  std::vector<Arm> arms;
  auto expected_td = [s] { return make_td(s, true); };

  auto td = std::make_shared<TensorDict>(make_td(s, sender));
  auto cons = std::make_shared<TensorDict>(tensordict::consolidate(make_td(s, sender)));
  auto storage = std::make_shared<std::vector<at::Tensor>>(
      std::vector<at::Tensor>{tensordict::consolidated_storage(*cons)});
  if (!sender) {
    (*storage)[0] = at::zeros_like((*storage)[0]);  // its own receive buffer
  }
  arms.push_back({.id = "floor.raw_one",
                  .send = [pg, storage] { pg->send(*storage, 1, 0)->wait(); },
                  .recv = [pg, storage] { pg->recv(*storage, 0, 0)->wait(); },
                  .verify =
                      [storage, expected_td] {
                        auto want = tensordict::consolidated_storage(
                            tensordict::consolidate(expected_td()));
                        return at::equal((*storage)[0], want);
                      }});
  if (s.leaves > 1) {
    auto raw =
        std::make_shared<std::vector<at::Tensor>>(leaves_of(sender ? *td : make_td(s, false)));
    auto post = [pg, raw](bool sending) {
      std::vector<dist::WorkPtr> works;
      works.reserve(raw->size());
      for (size_t i = 0; i < raw->size(); ++i) {
        std::vector<at::Tensor> one{(*raw)[i]};
        works.push_back(sending ? pg->send(one, 1, static_cast<int>(i))
                                : pg->recv(one, 0, static_cast<int>(i)));
      }
      for (auto& w : works) w->wait();
    };
    arms.push_back(
        {.id = "floor.raw_n",
         .send = [post] { post(true); },
         .recv = [post] { post(false); },
         .verify = [raw, expected_td] { return equal_leaves(*raw, leaves_of(expected_td())); }});
  }
  {
    auto src = tensordict::consolidated_storage(*cons);
    auto dst = std::make_shared<at::Tensor>(at::empty_like(src));
    arms.push_back(
        {.id = "floor.memcpy",
         .local = true,
         .send = [src, dst] { std::memcpy(dst->data_ptr(), src.const_data_ptr(), src.nbytes()); },
         .verify = [src, dst] { return at::equal(src, *dst); }});
  }
  arms.push_back({.id = "cpp.per_leaf",
                  .send = [td] { dist::send(*td, 1); },
                  .recv = [td] { dist::recv(*td, 0); },
                  .verify = [td, expected_td] { return (*td == expected_td()).all(); }});
  arms.push_back({.id = "cpp.consolidated",
                  .send = [cons] { dist::send(*cons, 1, {.consolidated = true}); },
                  .recv = [cons] { dist::recv(*cons, 0, {.consolidated = true}); },
                  .verify = [cons, expected_td] { return (*cons == expected_td()).all(); }});
  // Receives with a timeout: they land in the library's buffers, then are copied in
  // (docs/reliability.md, "A point-to-point timeout keeps the group").
  arms.push_back({.id = "cpp.per_leaf_timeout",
                  .send = [td] { dist::send(*td, 1); },
                  .recv = [td] { dist::recv(*td, 0, {.timeout = std::chrono::seconds(60)}); },
                  .verify = [td, expected_td] { return (*td == expected_td()).all(); }});
  arms.push_back({.id = "cpp.consolidated_timeout",
                  .send = [cons] { dist::send(*cons, 1, {.consolidated = true}); },
                  .recv =
                      [cons] {
                        dist::recv(*cons, 0,
                                   {.consolidated = true, .timeout = std::chrono::seconds(60)});
                      },
                  .verify = [cons, expected_td] { return (*cons == expected_td()).all(); }});
  // Checked transfers: a header and the schema before the same payload.
  arms.push_back({.id = "cpp.per_leaf_checked",
                  .send = [td] { dist::send(*td, 1, {.checked = true}); },
                  .recv = [td] { dist::recv(*td, 0, {.checked = true}); },
                  .verify = [td, expected_td] { return (*td == expected_td()).all(); }});
  arms.push_back({.id = "cpp.consolidated_checked",
                  .send = [cons] { dist::send(*cons, 1, {.consolidated = true, .checked = true}); },
                  .recv = [cons] { dist::recv(*cons, 0, {.consolidated = true, .checked = true}); },
                  .verify = [cons, expected_td] { return (*cons == expected_td()).all(); }});
  if (s.leaves >= 100 && s.leaves * s.bytes <= (1 << 20)) {
    // all_reduce with MAX, which leaves the values as they are on every round (the sender's
    // pattern, the receiver's zeros), per leaf and in buckets (bucket_bytes), beside raw c10d
    // all_reduces of the same bytes: one of all of them, and one per leaf.
    c10d::AllreduceOptions max_opts;
    max_opts.reduceOp = c10d::ReduceOp::MAX;
    auto flat = std::make_shared<std::vector<at::Tensor>>(std::vector<at::Tensor>{
        sender ? at::cat(leaves_of(*td)) : at::zeros({s.leaves * s.bytes / 4})});
    arms.push_back({.id = "floor.allreduce_one",
                    .send = [pg, flat, max_opts] { pg->allreduce(*flat, max_opts)->wait(); },
                    .recv = [pg, flat, max_opts] { pg->allreduce(*flat, max_opts)->wait(); },
                    .verify =
                        [flat, expected_td] {
                          return at::equal((*flat)[0], at::cat(leaves_of(expected_td())));
                        }});
    auto each = std::make_shared<std::vector<at::Tensor>>(leaves_of(make_td(s, sender)));
    auto reduce_each = [pg, each, max_opts] {
      std::vector<dist::WorkPtr> works;
      for (auto& t : *each) {
        std::vector<at::Tensor> one{t};
        works.push_back(pg->allreduce(one, max_opts));
      }
      for (auto& w : works) w->wait();
    };
    arms.push_back(
        {.id = "floor.allreduce_n",
         .send = reduce_each,
         .recv = reduce_each,
         .verify = [each, expected_td] { return equal_leaves(*each, leaves_of(expected_td())); }});
    for (const bool buckets : {false, true}) {
      auto mine = std::make_shared<TensorDict>(make_td(s, sender));
      dist::AllReduceOptions o{.op = c10d::ReduceOp::MAX};
      if (buckets) o.bucket_bytes = int64_t{1} << 20;
      auto run = [mine, o] { dist::all_reduce(*mine, o); };
      arms.push_back({.id = buckets ? "cpp.all_reduce_buckets" : "cpp.all_reduce",
                      .send = run,
                      .recv = run,
                      .verify = [mine, expected_td] { return (*mine == expected_td()).all(); }});
    }
  }
#ifdef TENSORDICT_BENCH_INIT_REMOTE
  {
    // A cold start each time: consolidate, metadata pickle, storage; a new TensorDict arrives.
    auto got = std::make_shared<TensorDict>();
    arms.push_back({.id = "cpp.init_remote",
                    .send = [td] { dist::init_remote(*td, 1); },
                    .recv = [got] { *got = dist::from_remote_init(0); },
                    .verify = [got, expected_td] { return (*got == expected_td()).all(); }});
  }
#endif
#ifdef TENSORDICT_BENCH_PIPE
  {
    auto& pipe = *peers.pipe;
    auto got = std::make_shared<TensorDict>();
    arms.push_back({.id = "cpp.pipe",
                    .send = [&pipe, cons] { pipe.send(*cons); },
                    .recv = [&pipe, got] { *got = pipe.recv(); },
                    // A one-byte ack on the pipe itself: the arm uses one transport only.
                    .ack_send = [&pipe] { pipe.send_raw(tensordict::TestKey{}, "k", 1); },
                    .ack_recv = [&pipe] { pipe.recv_raw(tensordict::TestKey{}, 1); },
                    .verify = [got, expected_td] { return (*got == expected_td()).all(); }});
  }
#endif
  return arms;
}

struct Stats {
  double median = 0, p25 = 0, p75 = 0, ci_lo = 0, ci_hi = 0;
  size_t n = 0;
};

// Percentiles by the nearest rank; the median's 95% interval from the order statistics
// (binomial, normal approximation), which assumes nothing about the bimodal distribution.
Stats stats(std::vector<double> v) {
  Stats st;
  st.n = v.size();
  if (v.empty()) return st;
  std::sort(v.begin(), v.end());
  const auto n = static_cast<double>(v.size());
  auto at_rank = [&](double q) {
    return v[std::min(v.size() - 1, static_cast<size_t>(std::max(0.0, std::ceil(q * n) - 1)))];
  };
  st.median = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  st.p25 = at_rank(0.25);
  st.p75 = at_rank(0.75);
  const double half = 0.98 * std::sqrt(n);
  st.ci_lo = v[static_cast<size_t>(std::max(0.0, std::floor(n / 2 - half)))];
  st.ci_hi = v[std::min(v.size() - 1, static_cast<size_t>(std::ceil(n / 2 + half)))];
  return st;
}

nlohmann::json run_case(const Config& cfg, const CaseSpec& s, int rank, Peers& peers) {
  auto& pg = peers.pg;
  auto arms = make_arms(s, rank, peers);
  if (!cfg.arms.empty()) {
    std::erase_if(arms, [&](const Arm& a) {
      return a.id != "floor.raw_one" && cfg.arms.find("," + a.id + ",") == std::string::npos;
    });
  }
  std::vector<std::vector<double>> times(arms.size());
  std::vector<at::Tensor> ack{at::zeros({1})}, ctrl{at::zeros({1}, at::kInt)};
  const auto start = Clock::now();
  for (int round = -cfg.warmup;; ++round) {
    if (rank == 0) {
      bool go = round < cfg.min_reps;
      if (!go) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
        bool tight = round >= kCiMinReps;
        for (auto& t : times) {
          const auto st = stats(t);
          tight = tight && (st.ci_hi - st.ci_lo) <= kTightCi * st.median;
        }
        go = round < cfg.max_reps && elapsed < cfg.cap_s && !tight;
      }
      ctrl[0].fill_(go ? 1 : 0);
      pg->send(ctrl, 1, kCtrlTag)->wait();
      if (!go) break;
    } else {
      pg->recv(ctrl, 0, kCtrlTag)->wait();
      if (ctrl[0].item<int>() == 0) break;
    }
    // A fresh order every round, the same on both ranks (seeded by the round): a rotation
    // would keep each arm behind the same predecessor, whose after-effects (a burst of 1000
    // messages, a large allocation) would then always land on it.
    std::vector<size_t> order(arms.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(round + 1000)));
    for (const size_t a : order) {
      Arm& arm = arms[a];
      if (rank == 0) {
        const auto t0 = Clock::now();
        arm.send();
        if (!arm.local) {
          if (arm.ack_recv) {
            arm.ack_recv();
          } else {
            pg->recv(ack, 1, kAckTag)->wait();
          }
        }
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (round >= 0) times[a].push_back(us);
      } else if (!arm.local) {
        arm.recv();
        if (arm.ack_send) {
          arm.ack_send();
        } else {
          pg->send(ack, 0, kAckTag)->wait();
        }
      }
    }
  }
  // Verification, after timing: rank 1 checks what it received and reports to rank 0.
  at::Tensor ok = at::ones({static_cast<int64_t>(arms.size())}, at::kInt);
  for (size_t a = 0; a < arms.size(); ++a) {
    if (arms[a].local == (rank == 0)) ok[a] = arms[a].verify() ? 1 : 0;
  }
  std::vector<at::Tensor> okv{ok};
  if (rank == 1) {
    pg->send(okv, 0, kCtrlTag)->wait();
    return {};
  }
  at::Tensor remote = at::empty_like(ok);
  std::vector<at::Tensor> rv{remote};
  pg->recv(rv, 1, kCtrlTag)->wait();
  nlohmann::json out = {{"name", s.name},
                        {"leaves", s.leaves},
                        {"bytes", s.leaves * s.bytes},
                        {"seconds", std::chrono::duration<double>(Clock::now() - start).count()}};
  for (size_t a = 0; a < arms.size(); ++a) {
    const auto st = stats(times[a]);
    const bool verified = (arms[a].local ? ok[a] : remote[a]).item<int>() == 1;
    out["arms"][arms[a].id] = {{"median_us", st.median}, {"p25_us", st.p25},     {"p75_us", st.p75},
                               {"ci_lo_us", st.ci_lo},   {"ci_hi_us", st.ci_hi}, {"n", st.n},
                               {"verified", verified}};
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const Config cfg = parse(argc, argv);
  // UCX over loopback TCP (as the pipe tests run it: docs/pipe.md); the caller's settings win.
  setenv("UCX_TLS", "tcp", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
  dist::run(
      [&cfg](int rank, int) {
        at::set_num_threads(1);
        Peers peers{dist::default_group()};
#ifdef TENSORDICT_BENCH_PIPE
        // Rank 1 listens on a free port and tells rank 0 through the process group.
        namespace tp = tensordict::pipe;
        std::vector<at::Tensor> port{at::zeros({1}, at::kLong)};
        if (rank == 1) {
          peers.pipe = tp::Pipe::listen(0, "127.0.0.1", {.timeout = std::chrono::seconds(120)});
          port[0].fill_(peers.pipe->port());
          peers.pg->send(port, 0, kCtrlTag)->wait();
          peers.pipe->accept();
        } else {
          peers.pg->recv(port, 1, kCtrlTag)->wait();
          peers.pipe = tp::Pipe::connect("127.0.0.1", static_cast<int>(port[0].item<int64_t>()),
                                         {.timeout = std::chrono::seconds(120)});
        }
#endif
        nlohmann::json result = {{"cases", nlohmann::json::array()}};
        for (const auto& s : cfg.cases) result["cases"].push_back(run_case(cfg, s, rank, peers));
#ifdef TENSORDICT_BENCH_PIPE
        // Close after both sides are done, so no unread bytes are dropped (docs/pipe.md).
        std::vector<at::Tensor> done{at::zeros({1})};
        if (rank == 0) {
          peers.pg->recv(done, 1, kCtrlTag)->wait();
        } else {
          peers.pg->send(done, 0, kCtrlTag)->wait();
        }
        peers.pipe->close();
#endif
        if (rank == 0) std::ofstream(cfg.json_path) << result.dump(1) << "\n";
      },
      2, {.timeout = std::chrono::minutes(20), .group_timeout = std::chrono::seconds(120)});
  return 0;
}

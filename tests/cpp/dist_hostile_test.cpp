// A hostile or broken peer, played by a raw Gloo rank sending crafted bytes, against our
// receiver: every case ends in a named error, and the receiver's memory stays bounded (peak
// growth under 100 MB, checked where no sanitizer inflates it). docs/reliability.md lists the
// limits these cases run into.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <malloc.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include "dist_test_util.h"
#include "peak_growth.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/init_remote.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "wire/metadata_pickle.h"
#include "wire/pickle.h"

namespace tensordict::dist {
namespace {

using namespace ::tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

using testing::bytes_of;
using testing::error_of;
using testing::fnv1a;
using testing::run_ranks;

constexpr int64_t kMB = 1000 * 1000;
constexpr int64_t kMiB = int64_t{1} << 20;

int64_t status_kb(const char* field, const char* file = "/proc/self/status") {
  std::ifstream in(file);
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0) return std::stoll(line.substr(n));
  }
  return 0;
}

// The receiver's peak memory growth over fn(): VmHWM (reset first through clear_refs), and the
// peak proportional set size sampled every 5 ms, which counts memory mapped several times
// once (what the drain buffer does; VmHWM counts each mapping).
struct Growth {
  int64_t hwm_bytes = 0;
  int64_t pss_bytes = 0;
};

Growth measure(const std::function<void()>& fn) {
  malloc_trim(0);  // what earlier cases freed must not hide this case's growth
  {
    std::ofstream("/proc/self/clear_refs") << "5";
  }
  const int64_t hwm0 = status_kb("VmHWM:");
  const int64_t pss0 = status_kb("Pss:", "/proc/self/smaps_rollup");
  std::atomic<bool> done{false};
  std::atomic<int64_t> pss_peak{pss0};
  std::thread sampler([&] {
    while (!done) {
      pss_peak = std::max<int64_t>(pss_peak, status_kb("Pss:", "/proc/self/smaps_rollup"));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  try {
    fn();
  } catch (...) {
    done = true;
    sampler.join();
    throw;
  }
  done = true;
  sampler.join();
  return {(status_kb("VmHWM:") - hwm0) * 1024, (pss_peak - pss0) * 1024};
}

// ---- crafting what the peer sends ----

void put(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

// A checked-transfer schema of one per-leaf float32 leaf "a" (docs/reliability.md).
std::string schema_of_a(uint64_t numel) {
  std::string s;
  put(s, 1, 8);  // leaf count
  put(s, 1, 4);  // depth
  put(s, 1, 4);
  s += "a";
  put(s, 13, 4);
  s += "torch.float32";
  put(s, 1, 4);  // one dimension
  put(s, numel, 8);
  return s;
}

std::string checked_header(uint64_t payload, const std::string& schema, uint64_t chunk) {
  std::string h = "TDCHECKD";
  put(h, 1, 4);  // version
  put(h, 0, 4);  // per leaf
  put(h, payload, 8);
  put(h, schema.size(), 8);
  put(h, fnv1a(schema.data(), schema.size()), 8);
  put(h, chunk, 8);
  put(h, 1, 8);  // leaves
  put(h, fnv1a(h.data(), h.size()), 8);
  return h;
}

std::string metadata_pickle_of(const TensorDict& td, const TransportFields& fields) {
  return pickle::dumps(metadata_to_pickle(*consolidated_metadata(consolidate(td)), fields));
}

// PROTO 4, then `body`, then STOP.
std::string raw_pickle(const std::string& body) { return std::string("\x80\x04", 2) + body + "."; }

struct Case {
  const char* name;
  std::function<std::vector<at::Tensor>()> messages;  // what the raw peer sends, in order
  std::function<void(const Group&)> receive;          // what our receiver does
  const char* error;                                  // substring of the receiver's error
  bool use_pss = false;                               // memory mapped over and over: judge by Pss
};

// torch's object framing (the pickle's length, the pickle), then a storage of zeros.
std::function<std::vector<at::Tensor>()> framed(std::string pickle, int64_t storage_bytes = -1) {
  return [pickle = std::move(pickle), storage_bytes] {
    std::vector<at::Tensor> m{at::full({1}, int64_t(pickle.size()), at::kLong), bytes_of(pickle)};
    if (storage_bytes >= 0) m.push_back(at::zeros({storage_bytes}, at::kByte));
    return m;
  };
}

void from_peer(const Group& g) { from_remote_init({}, {.group = g, .group_src = 0}); }

std::vector<Case> cases() {
  std::vector<Case> out;
  const auto recv_checked = [](TensorDict td, bool consolidated) {
    return [td, consolidated](const Group& g) {
      recv(td, {}, {.group = g, .group_src = 0, .consolidated = consolidated, .checked = true});
    };
  };
  const TensorDict one_mib({{"a", at::zeros({kMiB / 4})}}, {});

  // 1. checked=True: a chunk size of 1 byte would cost one posted receive per byte.
  {
    const std::string schema = schema_of_a(kMiB / 4);
    out.push_back(
        {"checked_chunk_of_one_byte",
         [=] { return std::vector{bytes_of(checked_header(kMiB, schema, 1)), bytes_of(schema)}; },
         recv_checked(one_mib, false), "the header's chunk size 1 is not in [1048576, 67108864]"});
  }
  out.push_back({"checked_short_header", [] { return std::vector{bytes_of("TDCHECKD")}; },
                 recv_checked(one_mib, false),
                 "the peer's first message is shorter than a checked-transfer header (64 bytes)"});
  {
    // A mismatching schema announcing 128 MiB, all of it sent: drained through one chunk.
    const std::string schema = schema_of_a(32 * kMiB);
    auto m = [=] {
      std::vector<at::Tensor> m{bytes_of(checked_header(128 * kMiB, schema, kMiB)),
                                bytes_of(schema)};
      for (int i = 0; i < 128; ++i) m.push_back(at::zeros({kMiB}, at::kByte));
      return m;
    };
    out.push_back({"checked_mismatch_drains_128_mib", m, recv_checked(one_mib, false),
                   "key 'a' has shape [33554432] on the sender and [262144] here"});
  }
  {
    // 2^40 bytes announced, 4 MiB sent: the drain waits for the rest until the group timeout
    // with one chunk of scratch, where it used to build an entry per message.
    const std::string schema = schema_of_a(uint64_t{1} << 38);
    auto m = [=] {
      std::vector<at::Tensor> m{bytes_of(checked_header(uint64_t{1} << 40, schema, kMiB)),
                                bytes_of(schema)};
      for (int i = 0; i < 4; ++i) m.push_back(at::zeros({kMiB}, at::kByte));
      return m;
    };
    out.push_back(
        {"checked_mismatch_announcing_a_tebibyte", m, recv_checked(one_mib, false), "Timed out"});
  }

  // 2. Memo amplification: one 8 MiB string read back 400 times.
  {
    std::string body = "X";
    put(body, 8 * kMiB, 4);
    body += std::string(8 * kMiB, 's');
    body += "\x94]";  // MEMOIZE, EMPTY_LIST
    body += "(";
    for (int i = 0; i < 400; ++i) body += std::string("h\x00", 2);
    body += "e";
    out.push_back({"pickle_memo_string_400_times", framed(raw_pickle(body)), from_peer,
                   "the values read would take more than"});
  }
  out.push_back({"pickle_8m_nones_in_a_list",
                 framed(raw_pickle("](" + std::string(8'000'000, 'N') + "e")), from_peer,
                 "pickle: "});
  out.push_back({"pickle_values_left_on_the_stack", framed(raw_pickle(std::string(8'400'000, 'N'))),
                 from_peer, "pickle: "});

  // 3. A storage message shorter than "_total_bytes".
  const TensorDict td4k({{"a", at::ones({1024})}}, {});
  out.push_back({"storage_shorter_than_announced",
                 framed(metadata_pickle_of(td4k, {{"_total_bytes", int64_t{4096}}}), 8), from_peer,
                 "from_remote_init: the sender's storage message is shorter than the 4096 bytes "
                 "it announced"});

  // 5. A storage beyond what this machine holds, and a refused pickle's drain.
  out.push_back({"announces_32_gib",
                 framed(metadata_pickle_of(td4k, {{"_total_bytes", int64_t{32} << 30}})), from_peer,
                 "bytes; this receiver accepts 0 to"});
  {
    auto v = metadata_to_pickle(*consolidated_metadata(consolidate(td4k)),
                                {{"_total_bytes", int64_t{1} << 30}});
    pickle::Value leaves = *v.find("leaves");
    leaves.set("a", pickle::Value::from_str("x"));  // a leaf entry must be a tuple
    v.set("leaves", std::move(leaves));
    out.push_back({"refused_pickle_drains_1_gib_in_place", framed(pickle::dumps(v), 1 << 30),
                   from_peer, "the metadata from the sender is refused", /*use_pss=*/true});
  }

  // 7. A pickle nested 100 levels deep is refused, yet its "_total_bytes" is still read (the
  // salvage reads under the same bounds as the metadata), so the sender completes.
  {
    pickle::Value deep = pickle::Value::dict();
    for (int i = 0; i < 100; ++i) {
      pickle::Value up = pickle::Value::dict();
      up.set("x", std::move(deep));
      deep = std::move(up);
    }
    deep.set("_total_bytes", pickle::Value::from_int(8));
    out.push_back({"deep_pickle_still_drained", framed(pickle::dumps(deep), 8), from_peer,
                   "the metadata from the sender is refused"});
  }
  return out;
}

TEST(DistHostile, EveryCaseIsANamedErrorWithBoundedMemory) {
  run_ranks(
      2,
      [](int rank, int) {
        auto store = c10::make_intrusive<c10d::FileStore>(run_scratch_dir() + "/hostile", 2);
        // Groups stay alive to the end: one that timed out may still hold a pending message.
        static auto* keep = new std::vector<BackendPtr>();
        for (auto& c : cases()) {
          SCOPED_TRACE(c.name);
          auto group = make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>(c.name, store),
                                         rank, 2, std::chrono::seconds(3), "127.0.0.1");
          keep->push_back(group);
          if (rank == 0) {
            // Built before the receiver starts its clock: a 1 GiB payload takes seconds under ASan
            // on a busy machine, longer than the 3 s the receiver waits for the first message.
            const std::vector<at::Tensor> messages = c.messages();
            store->set(std::string(c.name) + "/ready", {1});
            std::vector<WorkPtr> works;
            for (auto& m : messages) {
              std::vector<at::Tensor> one{m};
              works.push_back(group->send(one, 1, 0));
            }
            for (auto& w : works) {
              try {
                w->wait();
              } catch (const std::exception&) {  // a receiver that stopped early: Gloo's timeout
              }
            }
            // The next case's group connects within its 3 s timeout: wait until the receiver is
            // done with this one (it may itself be waiting out a 3 s timeout, by design).
            store->wait({std::string(c.name) + "/done"}, std::chrono::seconds(120));
          } else {
            store->wait({std::string(c.name) + "/ready"}, std::chrono::seconds(120));
            std::string error, kind;
            const Growth g = measure([&] { error = error_of([&] { c.receive(group); }, &kind); });
            EXPECT_NE(error.find(c.error), std::string::npos) << error;
            // A peer that stops sending mid-transfer times out, a well-formed other TensorDict is
            // a mismatch; everything else is the peer's bad data.
            const bool timeout = error.find("timed out") != std::string::npos;
            const bool mismatch = error.find("does not match this one") != std::string::npos;
            EXPECT_EQ(kind, timeout    ? "TimeoutError"
                            : mismatch ? "SchemaMismatchError"
                                       : "MalformedPeerDataError")
                << error;
            std::printf(
                "[hostile] %-40s peak growth: VmHWM %+.1f MB, Pss %+.1f MB; error: %.160s\n",
                c.name, g.hwm_bytes / 1e6, g.pss_bytes / 1e6, error.c_str());
            if (kMeasureMemory) {
              EXPECT_LT(c.use_pss ? g.pss_bytes : g.hwm_bytes, 100 * kMB);
            }
            store->set(std::string(c.name) + "/done", {1});
          }
        }
      },
      {.watchdog = std::chrono::seconds(150)});
}

// 4. Leaves without plain storage are refused by key before anything is posted, on both sides.
TEST(DistHostile, StoragelessLeavesAreRefusedByKey) {
  run_ranks(2, [](int rank, int) {
    const int peer = 1 - rank;
    const auto sparse = at::eye(2).to_sparse();
    const auto quantized = at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQUInt8);
    const std::vector<std::pair<at::Tensor, std::string>> leaves = {
        {at::empty({2, 3}, at::TensorOptions().device(at::kMeta)), "is on the meta device"},
        {sparse, "is a sparse tensor"},
        {quantized, "has the quantized dtype torch.quint8"},
    };
    for (const auto& [leaf, why] : leaves) {
      TensorDict td({{"x", TensorDict({{"m", leaf}, {"ok", at::zeros({2})}}, {})}}, {});
      for (bool checked : {false, true}) {
        const std::string want = "send: leaf ('x', 'm') " + why;
        const std::string got = error_of([&] { send(td, peer, {.checked = checked}); });
        EXPECT_EQ(got.rfind(want, 0), 0u) << got;
        const std::string got_recv = error_of([&] { recv(td, peer, {.checked = checked}); });
        EXPECT_NE(got_recv.find(": leaf ('x', 'm') " + why), std::string::npos) << got_recv;
      }
      EXPECT_NE(error_of([&] { send(td, peer, {.consolidated = true}); }).find("leaf ('x', 'm')"),
                std::string::npos);
      EXPECT_NE(error_of([&] { init_remote(td, peer); }).find("leaf ('x', 'm')"),
                std::string::npos);
    }
  });
}

// 6. A peer that never sends: the per-call timeout ends the wait, and so does the group's, each
// with an error that names the call, the peer, what was in flight and the time waited.
TEST(DistHostile, TimeoutsNameTheCallThePeerAndWhatWasInFlight) {
  run_ranks(
      2,
      [](int rank, int) {
        // Gloo closes every connection of a group whose wait timed out: one group per step.
        auto store = c10::make_intrusive<c10d::FileStore>(run_scratch_dir() + "/timeouts", 2);
        static auto* groups = new std::vector<BackendPtr>();
        for (const char* name : {"call", "init", "group"}) {
          groups->push_back(make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>(name, store),
                                              rank, 2, std::chrono::seconds(1), "127.0.0.1"));
        }
        if (rank == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // sends nothing
          return;
        }
        TensorDict td({{"b", at::zeros({2})}, {"a", at::zeros({2})}}, {});
        using std::chrono::milliseconds;
        std::string kind;
        const auto timed = [&kind](const std::function<void()>& fn, std::string& error) {
          const auto start = std::chrono::steady_clock::now();
          error = error_of(fn, &kind);
          return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        };
        std::string error;
        double s = timed(
            [&] {
              recv(td, {},
                   {.group = (*groups)[0],
                    .group_src = 0,
                    .init_tag = 5,
                    .timeout = milliseconds(400)});
            },
            error);
        EXPECT_LT(s, 0.9);  // the call's timeout, not the group's 1 s
        EXPECT_EQ(error.rfind("recv: timed out after 0.", 0), 0u) << error;
        EXPECT_EQ(kind, "TimeoutError");
        EXPECT_NE(
            error.find("s (the call's timeout of 400 ms) waiting for rank 0: tag 5 (key 'a')"),
            std::string::npos)
            << error;
        s = timed(
            [&] {
              from_remote_init(
                  {}, {.group = (*groups)[1], .group_src = 0, .timeout = milliseconds(300)});
            },
            error);
        EXPECT_LT(s, 0.9);
        EXPECT_NE(error.find("from_remote_init: timed out after"), std::string::npos) << error;
        EXPECT_NE(error.find("waiting for rank 0: the metadata pickle's length (tag 0)"),
                  std::string::npos)
            << error;
        // No per-call timeout: the group's (1 s) ends the wait, and Gloo's text is kept.
        s = timed([&] { recv(td, {}, {.group = (*groups)[2], .group_src = 0, .init_tag = 9}); },
                  error);
        EXPECT_LT(s, 3.0);
        EXPECT_NE(error.find("recv: timed out after"), std::string::npos) << error;
        EXPECT_NE(error.find("(the group's timeout) waiting for rank 0: tag 9 (key 'a')"),
                  std::string::npos)
            << error;
        EXPECT_NE(error.find("Timed out waiting 1000ms for recv operation"), std::string::npos)
            << error;
        EXPECT_EQ(kind, "TimeoutError");
        EXPECT_EQ(error_of([&] { recv(td, 0, {.timeout = milliseconds(0)}); }),
                  "recv: timeout must be positive, got 0 ms");
      },
      {.watchdog = std::chrono::seconds(60)});
}

// 7. Argument faults are refused before any message moves.
TEST(DistHostile, ArgumentFaultsBeforeAnyMessage) {
  run_ranks(2, [](int rank, int) {
    const std::string self =
        "Invalid source rank: source rank should not be the same as the "
        "rank of the current process.";
    EXPECT_EQ(error_of([&] { from_remote_init(rank); }), self);
    TensorDict td({{"a", at::zeros({2})}}, {});
    EXPECT_EQ(error_of([&] { recv(td, rank); }), self);
    EXPECT_EQ(error_of([&] { from_remote_init(1 - rank, {.max_total_bytes = -1}); }),
              "from_remote_init: max_total_bytes must be non-negative, got -1");
    EXPECT_GT(default_max_total_bytes(), 0);
  });
}

}  // namespace
}  // namespace tensordict::dist

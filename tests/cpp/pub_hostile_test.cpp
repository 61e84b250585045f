// Publication and the group-keeping timeouts under hostile or unlucky peers, on real processes
// over Gloo (docs/publication.md, docs/reliability.md): every wait of a pull bounded by its
// deadline and its interrupt; messages longer than their receives named instead of Gloo's
// abort; a refused offer that frees its slot; parked messages that end with their group;
// answers out of step refused; and a bound on the receives timed-out calls leave.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "dist_test_util.h"
#include "peak_growth.h"
#include "publication_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/errors.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using dist::Late;
using testing::await_ready;
using testing::error_of;
using testing::ready;
using testing::run_ranks;

constexpr int kRequestTag = 0x7E000000;
int tag(int channel, int kind) { return kRequestTag + 8 * channel + kind; }

TensorDict weights(float v, int64_t n = 16) {
  return TensorDict({{"a", at::full({n}, v)}, {"b", at::full({2, 3}, v)}}, {});
}
bool holds(const TensorDict& td, float v) {
  for (const char* k : {"a", "b"}) {
    if (!td.get(k).tensor().eq(v).all().item<bool>()) return false;
  }
  return true;
}

at::Tensor message(const char* magic, uint32_t word, std::initializer_list<uint64_t> fields) {
  return testing::bytes_of(publication_test::message(magic, word, fields));
}
at::Tensor recv_raw(int src, int t, int64_t n) {
  std::vector<at::Tensor> v{at::zeros({n}, at::kByte)};
  dist::default_group()->recv(v, src, t)->wait();
  return v[0];
}
void send_raw(at::Tensor t, int dst, int tg) {
  std::vector<at::Tensor> v{std::move(t)};
  dist::default_group()->send(v, dst, tg)->wait();
}
uint64_t u64(const at::Tensor& m, int at) {
  return publication_test::get_u64(m.data_ptr<uint8_t>() + at);
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A TensorDict still moves between ranks 0 and 1, both ways: the group lives.
void check_pair(int rank) {
  for (auto [from, to] : {std::pair{0, 1}, {1, 0}}) {
    if (rank == from) dist::send(weights(70 + from), to, {.init_tag = 40});
    if (rank == to) {
      TensorDict td = weights(0);
      dist::recv(td, from, {.init_tag = 40, .timeout = 20s});
      EXPECT_TRUE(holds(td, 70 + from));
    }
  }
}

// The consolidated form of td as a publisher sends it: (schema JSON, storage).
std::pair<std::string, at::Tensor> version_of(const TensorDict& td) {
  const TensorDict c = consolidate(td);
  const at::Tensor storage = consolidated_storage(c);
  return {metadata_to_json(*consolidated_metadata(c), false, {{"_total_bytes", storage.numel()}}),
          storage};
}

// The peak memory growth of fn() in this process (VmHWM, reset first through clear_refs, over
// VmRSS before), in MB: every hostile case stays under 100 MB beyond the honest data.
int64_t status_kb(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field)));
  }
  return 0;
}
int64_t rss_kb() { return status_kb("VmRSS:"); }
template <typename Fn>
double peak_growth_mb(Fn&& fn) {
  std::ofstream("/proc/self/clear_refs") << "5";
  const int64_t before = status_kb("VmRSS:");
  fn();
  return static_cast<double>(status_kb("VmHWM:") - before) / 1024;
}

// A pull's waits end at its deadline or its interrupt whatever the publisher leaves undone: a
// schema refused with no data after it is refused at once (not drained for ever); a version
// whose data never comes returns None at the timeout, and at an interrupt; when the data comes
// at last, the next pull takes it, the messages in step.
TEST(PublicationHostile, EveryWaitOfAPullEndsAtItsDeadlineOrItsInterrupt) {
  run_ranks(2, [](int rank, int) {
    const auto [json, storage] = version_of(weights(5));
    const uint64_t n = static_cast<uint64_t>(storage.numel());
    if (rank == 0) {
      // Channel 1: an offer, a schema that is not JSON, and no data ever.
      const std::string bad = "{not json";
      const at::Tensor r = recv_raw(1, tag(1, 0), 64);
      send_raw(message("TDPUBOFR", 1,
                       {u64(r, 16), 9, 1, n, bad.size(), publication_test::schema_hash(bad)}),
               1, tag(1, 1));
      send_raw(testing::bytes_of(bad), 1, tag(1, 2));
      EXPECT_EQ(recv_raw(1, tag(1, 0), 64).data_ptr<uint8_t>()[12], 3);  // refused: the schema
      // Channel 2: a whole offer and schema, the data held back until rank 1 has given up twice.
      const at::Tensor r2 = recv_raw(1, tag(2, 0), 64);
      send_raw(message("TDPUBOFR", 1,
                       {u64(r2, 16), 9, 1, n, json.size(), publication_test::schema_hash(json)}),
               1, tag(2, 1));
      send_raw(testing::bytes_of(json), 1, tag(2, 2));
      await_ready(1);
      send_raw(storage.clone(), 1, tag(2, 3));
      ready(1);
    } else {
      const double grew = peak_growth_mb([&] {
        dist::Subscriber sub({.src = 0, .channel = 1});
        TensorDict td = weights(0);
        const auto t0 = Clock::now();
        std::string kind;
        const std::string e = error_of([&] { sub.pull(td, {.timeout = 3s}); }, &kind);
        EXPECT_EQ(kind, "MalformedPeerDataError") << e;
        EXPECT_NE(e.find("schema"), std::string::npos) << e;
        EXPECT_LT(ms_since(t0), 1000) << e;
        EXPECT_TRUE(holds(td, 0));
      });
      EXPECT_LT(grew, 100);
      dist::Subscriber sub({.src = 0, .channel = 2});
      TensorDict td = weights(0);
      auto t0 = Clock::now();
      EXPECT_FALSE(sub.pull(td, {.timeout = 1s}).has_value());
      EXPECT_GE(ms_since(t0), 990);
      EXPECT_LT(ms_since(t0), 1500);
      // No timeout: an interrupt from another thread ends it (a cancelled apull).
      std::thread interrupter([&] {
        std::this_thread::sleep_for(300ms);
        sub.interrupt();
      });
      t0 = Clock::now();
      EXPECT_FALSE(sub.pull(td).has_value());
      interrupter.join();
      EXPECT_LT(ms_since(t0), 800);
      sub.interrupt(false);
      EXPECT_TRUE(holds(td, 0));
      ready(0);
      await_ready(0);
      EXPECT_EQ(sub.pull(td, {.timeout = 10s}), 1);
      EXPECT_TRUE(holds(td, 5));
    }
    check_pair(rank);
  });
}

// Gloo ends a process whose posted receive meets a longer message; publication's receives are
// posted with room, so a longer request, offer or data is a named error and both processes live.
TEST(PublicationHostile, LongerMessagesAreNamedErrorsNotAborts) {
  run_ranks(2, [](int rank, int) {
    const auto [json, storage] = version_of(weights(5));
    const uint64_t n = static_cast<uint64_t>(storage.numel());
    if (rank == 0) {
      const double grew = peak_growth_mb([&] {
        // A real publisher: a 65-byte "request" and a 128-byte one, on channels 0 and 3.
        dist::Publisher pub0({.channel = 0});
        dist::Publisher pub3({.channel = 3});
        ready(1);
        await_ready(1);
        for (auto* pub : {&pub0, &pub3}) {
          for (int i = 0; i < 200 && !pub->stats()[0].lost; ++i) std::this_thread::sleep_for(10ms);
          const auto s = pub->stats()[0];
          EXPECT_TRUE(s.lost);
          EXPECT_NE(s.error.find("longer than the 64 bytes"), std::string::npos) << s.error;
        }
        EXPECT_EQ(pub0.publish(weights(1)), 1);  // and it goes on
      });
      EXPECT_LT(grew, 100);
      // A fake publisher: a 100-byte offer (channel 4); data 1 KiB longer than announced
      // (channel 5).
      at::Tensor r = recv_raw(1, tag(4, 0), 64);
      at::Tensor offer = at::zeros({100}, at::kByte);
      offer.narrow(0, 0, 64).copy_(message("TDPUBOFR", 2, {u64(r, 16), 9, 0, 0, 0, 0}));
      send_raw(offer, 1, tag(4, 1));
      r = recv_raw(1, tag(5, 0), 64);
      send_raw(message("TDPUBOFR", 1,
                       {u64(r, 16), 9, 1, n, json.size(), publication_test::schema_hash(json)}),
               1, tag(5, 1));
      send_raw(testing::bytes_of(json), 1, tag(5, 2));
      send_raw(at::cat({storage, at::zeros({1024}, at::kByte)}), 1, tag(5, 3));
      ready(1);
    } else {
      await_ready(0);
      send_raw(at::zeros({65}, at::kByte), 0, tag(0, 0));
      send_raw(at::zeros({128}, at::kByte), 0, tag(3, 0));
      ready(0);
      const double grew = peak_growth_mb([&] {
        for (int channel : {4, 5}) {
          dist::Subscriber sub({.src = 0, .channel = channel});
          TensorDict td = weights(0);
          std::string kind;
          const std::string e = error_of([&] { sub.pull(td, {.timeout = 10s}); }, &kind);
          EXPECT_EQ(kind, "MalformedPeerDataError") << e;
          EXPECT_NE(
              e.find(channel == 4 ? "offer longer than the 64 bytes" : "data longer than the "),
              std::string::npos)
              << e;
          EXPECT_TRUE(holds(td, 0));
        }
      });
      EXPECT_LT(grew, 100);
      await_ready(0);
    }
    check_pair(rank);
  });
}

// A receive that timed out stays posted; when the peer's next message on its tag comes from a
// TensorDict whose layout grew, it lands in the room kept after the receive: the next receive
// names it (deliver) or drops it (drop) instead of Gloo aborting the process.
TEST(PublicationHostile, ALateMessageOfAGrownLayoutIsNamedOrDropped) {
  run_ranks(2, [](int rank, int) {
    for (bool consolidated : {false, true}) {
      for (Late late : {Late::kDeliver, Late::kDrop}) {
        if (rank == 0) {
          TensorDict td = consolidated ? consolidate(weights(0)) : weights(0);
          const std::string first = error_of(
              [&] { dist::recv(td, 1, {.consolidated = consolidated, .timeout = 200ms}); });
          EXPECT_NE(first.find("timed out"), std::string::npos) << first;
          ready(1);  // rank 1 sends one of a grown layout, then the proper one
          std::string kind;
          const std::string e = error_of(
              [&] {
                dist::recv(td, 1, {.consolidated = consolidated, .timeout = 10s, .late = late});
              },
              &kind);
          if (late == Late::kDeliver) {
            EXPECT_EQ(kind, "MalformedPeerDataError") << e;
            EXPECT_NE(e.find("is longer than the"), std::string::npos) << e;
            EXPECT_TRUE(holds(td, 0));
            dist::recv(td, 1, {.consolidated = consolidated, .timeout = 10s});
          } else {
            EXPECT_EQ(e, "<no error>");
          }
          EXPECT_TRUE(holds(td, 8));
        } else {
          await_ready(0);
          dist::send(weights(3, 20), 0, {.consolidated = consolidated});  // 16 floats grew to 20
          dist::send(weights(8), 0, {.consolidated = consolidated});
        }
      }
    }
    check_pair(rank);
  });
}

// An honest subscriber whose max_total_bytes is below the version refuses the offer: the
// publisher is told, records it lost with the reason and frees its slot, so with one slot the
// other subscriber still gets every version.
TEST(PublicationHostile, ARefusedOfferFreesItsSlot) {
  run_ranks(3, [](int rank, int) {
    if (rank == 0) {
      dist::Publisher pub({.max_slots = 1});
      pub.publish(weights(1));
      for (int i = 0; i < 300 && !pub.stats()[0].lost; ++i) std::this_thread::sleep_for(10ms);
      const auto s = pub.stats()[0];
      EXPECT_TRUE(s.lost);
      EXPECT_FALSE(s.pinned.has_value());
      EXPECT_NE(s.error.find("max_total_bytes"), std::string::npos) << s.error;
      for (int v = 2; v <= 9; ++v) {
        EXPECT_EQ(error_of([&] { pub.publish(weights(v), 2s); }), "<no error>") << v;
        std::this_thread::sleep_for(20ms);
      }
      await_ready(2);
    } else if (rank == 1) {
      dist::Subscriber sub({.src = 0, .max_total_bytes = 64});
      TensorDict td = weights(0);
      std::string kind, e;
      EXPECT_LT(
          peak_growth_mb([&] { e = error_of([&] { sub.pull(td, {.timeout = 10s}); }, &kind); }),
          100);
      EXPECT_EQ(kind, "MalformedPeerDataError") << e;
      EXPECT_NE(e.find("max_total_bytes"), std::string::npos) << e;
    } else {
      dist::Subscriber sub({.src = 0});
      TensorDict td = weights(0);
      int64_t last = 0;
      while (last < 9) {
        const auto v = sub.pull(td, {.timeout = 10s});
        ASSERT_TRUE(v.has_value());
        EXPECT_TRUE(holds(td, static_cast<float>(*v)));
        last = *v;
      }
      ready(0);
    }
  });
}

// A "none" sooner than the request's wait would make a pull loop spin: refused, by name.
TEST(PublicationHostile, AnAnswerBeforeItsWaitIsRefused) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      const at::Tensor r = recv_raw(1, tag(0, 0), 64);
      EXPECT_EQ(static_cast<int64_t>(u64(r, 48)), 5000);  // the request waits 5 s
      send_raw(message("TDPUBOFR", 2, {u64(r, 16), 9, 0, 0, 0, 0}), 1, tag(0, 1));
      EXPECT_EQ(recv_raw(1, tag(0, 0), 64).data_ptr<uint8_t>()[12], 5);
    } else {
      dist::Subscriber sub({.src = 0});
      TensorDict td = weights(0);
      std::string kind;
      const std::string e = error_of([&] { sub.pull(td, {.timeout = 5s}); }, &kind);
      EXPECT_EQ(kind, "MalformedPeerDataError") << e;
      EXPECT_NE(e.find("answered \"none\" after"), std::string::npos) << e;
    }
    check_pair(rank);
  });
}

// The messages timed-out calls leave belong to their group: a group that ends releases them
// (its timed-out sends' tensors too), and the next group never meets them. Per peer, at most
// LateMessages::kMaxParked receives are kept; a call that would post more refuses first.
TEST(PublicationHostile, LateMessagesEndWithTheirGroupAndAreBounded) {
  run_ranks(2, [](int rank, int) {
    dist::ProcessGroupPtr a = dist::new_group({0, 1});
    if (rank == 0) {
      TensorDict td = weights(0);
      EXPECT_NE(error_of([&] { dist::recv(td, 1, {.group = a, .timeout = 200ms}); }), "<no error>");
      ready(1);
      // Ten 64 MiB sends nobody receives, each timed out and kept.
      const int64_t before = rss_kb();
      for (int i = 0; i < 10; ++i) {
        TensorDict big({{"x", at::full({int64_t{16} << 20}, 1.0f)}}, {});
        EXPECT_NE(
            error_of([&] { dist::send(big, 1, {.group = a, .init_tag = 100, .timeout = 50ms}); }),
            "<no error>");
      }
      const int64_t kept = rss_kb() - before;
      await_ready(1);  // rank 1 sent 9 on group a, late
      dist::destroy_process_group(a);
      a.reset();
      int64_t after = rss_kb() - before;
      for (int i = 0; i < 50 && after > 100 * 1024; ++i) {
        std::this_thread::sleep_for(100ms);
        after = rss_kb() - before;
      }
      std::printf("[late] ten timed-out 64 MiB sends kept %lld MB; %lld MB once the group ended\n",
                  static_cast<long long>(kept / 1024), static_cast<long long>(after / 1024));
      EXPECT_GT(kept, 500 * 1024);
      if (kMeasureMemory) {
        EXPECT_LT(after, 100 * 1024);
      }
      dist::ProcessGroupPtr b = dist::new_group({0, 1});
      TensorDict got = weights(0);
      dist::recv(got, 1, {.group = b, .timeout = 10s});
      EXPECT_TRUE(holds(got, 11));  // the new group's message, not the old group's 9
      // The bound on parked receives: 1024 timed-out receives on as many tags, then a refusal.
      for (int64_t i = 0; i < 1024; ++i) {  // LateMessages::kMaxParked (src/distributed/late.h)
        TensorDict one({{"a", at::zeros({1})}}, {});
        error_of([&] { dist::recv(one, 1, {.group = b, .init_tag = 1000 + i, .timeout = 1ms}); });
      }
      TensorDict one({{"a", at::zeros({1})}}, {});
      std::string kind;
      const std::string e = error_of(
          [&] { dist::recv(one, 1, {.group = b, .init_tag = 5000, .timeout = 1ms}); }, &kind);
      EXPECT_NE(e.find("receives from rank 1 left by calls that timed out"), std::string::npos)
          << e;
      dist::destroy_process_group(b);
      ready(1);
    } else {
      await_ready(0);
      dist::send(weights(9), 0, {.group = a});  // lands in rank 0's parked receive
      ready(0);
      dist::destroy_process_group(a);
      a.reset();
      dist::ProcessGroupPtr b = dist::new_group({0, 1});
      dist::send(weights(11), 0, {.group = b});
      await_ready(0);
      dist::destroy_process_group(b);
    }
    check_pair(rank);
  });
}

}  // namespace
}  // namespace tensordict

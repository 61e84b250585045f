// Publication (docs/publication.md): a Publisher on rank 0, Subscribers on the other ranks, on
// real processes over Gloo. Versions are whole and increasing, pulls in place allocate nothing,
// timeouts return nothing and keep the group, pinned slots are named, a restarted publisher
// is a new epoch, and forged requests, offers and absent publishers get named errors. Raw
// peers forge the messages of docs/wire-format.md §9 byte by byte.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "dist_test_util.h"
#include "publication_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/errors.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/tensor_dict.h"
#include "wire/leaf_order.h"

namespace tensordict {
namespace {

using namespace std::chrono_literals;
using publication_test::get_u64;
using testing::await_ready;
using testing::error_of;
using testing::ready;
using testing::run_ranks;

// The publication tags of channel 0 (docs/wire-format.md §9).
constexpr int kRequestTag = 0x7E000000;
constexpr int kOfferTag = kRequestTag + 1;
constexpr int kDataTag = kRequestTag + 3;

TensorDict weights(double v) {
  TensorDict inner({{"w", at::full({8, 3}, v, at::kDouble)}}, {});
  return TensorDict({{"bias", at::full({3}, v)},
                     {"layer", inner},
                     {"steps", at::full({2}, static_cast<int64_t>(v), at::kLong)}},
                    {});
}

// Every leaf of td holds v.
bool holds(const TensorDict& td, double v) {
  for (const auto& [path, leaf] : wire::leaves_in_order(td)) {
    if (!leaf.eq(v).all().item<bool>()) return false;
  }
  return true;
}

// A TensorDict still moves between a and b, both ways.
void check_pair(int rank, int a, int b) {
  for (auto [from, to] : {std::pair{a, b}, {b, a}}) {
    if (rank == from) dist::send(weights(70 + from), to, {.init_tag = 40});
    if (rank == to) {
      TensorDict td = weights(0);
      dist::recv(td, from, {.init_tag = 40, .timeout = 20s});
      EXPECT_TRUE(holds(td, 70 + from));
    }
  }
}

// A forged message as a tensor to send.
at::Tensor message(const char* magic, uint32_t word, std::initializer_list<uint64_t> fields) {
  const std::string m = publication_test::message(magic, word, fields);
  at::Tensor t = at::empty({static_cast<int64_t>(m.size())}, at::kByte);
  std::memcpy(t.data_ptr(), m.data(), m.size());
  return t;
}

at::Tensor recv_raw(int src, int tag, int64_t n) {
  std::vector<at::Tensor> t{at::empty({n}, at::kByte)};
  dist::default_group()->recv(t, src, tag)->wait();
  return t[0];
}
void send_raw(at::Tensor t, int dst, int tag) {
  std::vector<at::Tensor> v{std::move(t)};
  dist::default_group()->send(v, dst, tag)->wait();
}

TEST(Publication, VersionsAreWholeAndPullsInPlaceAllocateNothing) {
  run_ranks(3, [](int rank, int) {
    if (rank == 0) {
      dist::Publisher pub;
      EXPECT_NE(pub.epoch(), 0u);
      EXPECT_EQ(pub.version(), 0);
      TensorDict td = weights(0);
      for (int v = 1; v <= 40; ++v) {
        td.get("bias").tensor().fill_(v);
        td.get("layer").tensordict().get("w").tensor().fill_(v);
        td.get("steps").tensor().fill_(v);
        EXPECT_EQ(pub.publish(td), v);
        std::this_thread::sleep_for(2ms);
      }
      await_ready(1);
      await_ready(2);
      for (const auto& s : pub.stats()) {
        EXPECT_EQ(s.version, 40) << s.rank;
        EXPECT_GE(s.pulls, 2) << s.rank;
        EXPECT_FALSE(s.lost) << s.rank;
        EXPECT_FALSE(s.pinned.has_value());
      }
      ready(1);
      ready(2);
    } else {
      dist::Subscriber sub({.src = 0});
      auto first = sub.pull({.timeout = 20s});
      ASSERT_TRUE(first.has_value());
      TensorDict td = first->td;
      EXPECT_TRUE(holds(td, static_cast<double>(first->version)));
      EXPECT_EQ(sub.version(), first->version);
      const void* storage = consolidated_storage(td).data_ptr();
      const void* leaf = td.get("layer").tensordict().get("w").tensor().data_ptr();
      int64_t last = first->version;
      while (last < 40) {
        auto v = sub.pull(td, {.timeout = 20s});
        ASSERT_TRUE(v.has_value());
        EXPECT_GT(*v, last);  // newer, skipping versions it was too slow for
        EXPECT_TRUE(holds(td, static_cast<double>(*v))) << *v;  // never torn
        last = *v;
      }
      // In place: the same storage and leaves.
      EXPECT_EQ(consolidated_storage(td).data_ptr(), storage);
      EXPECT_EQ(td.get("layer").tensordict().get("w").tensor().data_ptr(), leaf);
      // Nothing newer: the timeout returns nothing, td unchanged, and the group lives.
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_FALSE(sub.pull(td, {.timeout = 300ms}).has_value());
      EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
      EXPECT_TRUE(holds(td, 40));
      ready(0);
      await_ready(0);
    }
    check_pair(rank, 1, 2);
    check_pair(rank, 0, 1);
    check_pair(rank, 0, 2);
  });
}

TEST(Publication, PollsMinVersionAndLateAnswers) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      dist::Publisher pub;
      await_ready(1);  // the subscriber polled with nothing published
      for (int v = 1; v <= 5; ++v) pub.publish(weights(v));
      ready(1);
      await_ready(1);  // it waits for version 8
      std::this_thread::sleep_for(200ms);
      for (int v = 6; v <= 8; ++v) pub.publish(weights(v));
      await_ready(1);
    } else {
      dist::Subscriber sub({.src = 0});
      TensorDict td = weights(0);
      EXPECT_FALSE(sub.pull(td, {.timeout = 0ms}).has_value());
      EXPECT_TRUE(holds(td, 0));
      ready(0);
      await_ready(0);
      // Polls: the first may only send the request; later ones take its answer.
      std::optional<int64_t> got;
      for (int i = 0; i < 2000 && !got; ++i) {
        got = sub.pull(td, {.timeout = 0ms});
        if (!got) std::this_thread::sleep_for(1ms);
      }
      ASSERT_TRUE(got.has_value());
      EXPECT_EQ(*got, 5);
      EXPECT_TRUE(holds(td, 5));
      ready(0);
      auto v = sub.pull(td, {.timeout = 20s, .min_version = 8});
      ASSERT_TRUE(v.has_value());
      EXPECT_EQ(*v, 8);
      EXPECT_TRUE(holds(td, 8));
      ready(0);
    }
  });
}

TEST(Publication, AStalledSubscriberPinsOneSlotAndIsNamed) {
  // Rank 2 is a raw subscriber that asks for a version and never takes its data: with one slot,
  // the next publish waits, then names rank 2; with two, publish never waits. The real
  // subscriber on rank 1 goes on pulling meanwhile.
  run_ranks(3, [](int rank, int) {
    if (rank == 0) {
      {
        dist::Publisher pub({.max_slots = 1});
        pub.publish(weights(1));
        ready(2);
        await_ready(2);  // its request is in and answered: the slot is pinned
        std::this_thread::sleep_for(200ms);
        std::string kind;
        const std::string e = error_of([&] { pub.publish(weights(2), 300ms); }, &kind);
        EXPECT_EQ(kind, "TimeoutError");
        EXPECT_NE(e.find("pinned"), std::string::npos) << e;
        EXPECT_NE(e.find("rank 2 (version 1)"), std::string::npos) << e;
        const auto stats = pub.stats();
        EXPECT_EQ(stats[1].pinned, 1);
        ready(2);
        await_ready(2);  // it took its data: the slot is free again
        EXPECT_EQ(pub.publish(weights(2), 5s), 2);
        ready(1);
        await_ready(1);
      }
      {
        dist::Publisher pub({.max_slots = 2});
        pub.publish(weights(10));
        ready(2);
        await_ready(2);
        const auto t0 = std::chrono::steady_clock::now();
        for (int v = 11; v <= 30; ++v) pub.publish(weights(v), 5s);
        EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
        ready(1);
        await_ready(1);
        ready(2);
        await_ready(2);
      }
    } else if (rank == 1) {
      for (int round = 0; round < 2; ++round) {
        await_ready(0);
        dist::Subscriber sub({.src = 0});
        auto got = sub.pull({.timeout = 20s});
        ASSERT_TRUE(got.has_value());
        EXPECT_EQ(got->version, round == 0 ? 2 : 21);
        EXPECT_TRUE(holds(got->td, round == 0 ? 2 : 30));
        ready(0);
      }
    } else {
      for (int round = 0; round < 2; ++round) {
        await_ready(0);
        at::Tensor offer = at::empty({64}, at::kByte);
        std::vector<at::Tensor> o{offer};
        auto offer_work = dist::default_group()->recv(o, 0, kOfferTag);
        send_raw(message("TDPUBREQ", 0, {1, 0, 0, 0, 0, 0}), 0, kRequestTag);
        offer_work->wait();
        const auto* p = offer.data_ptr<uint8_t>();
        EXPECT_EQ(std::string(reinterpret_cast<const char*>(p), 8), "TDPUBOFR");
        EXPECT_EQ(p[12], 1);  // kNew
        const int64_t data_bytes = static_cast<int64_t>(get_u64(p + 40));
        const int64_t schema_bytes = static_cast<int64_t>(get_u64(p + 48));
        EXPECT_GT(schema_bytes, 0);
        const std::string json = [&] {
          at::Tensor s = recv_raw(0, kRequestTag + 2, schema_bytes);
          return std::string(reinterpret_cast<const char*>(s.data_ptr<uint8_t>()),
                             static_cast<size_t>(schema_bytes));
        }();
        EXPECT_NE(json.find("\"_total_bytes\": " + std::to_string(data_bytes)), std::string::npos)
            << json;
        ready(0);
        await_ready(0);  // hold the data back until rank 0 has seen the pinned slot
        recv_raw(0, kDataTag, data_bytes);
        ready(0);
      }
    }
  });
}

TEST(Publication, ARestartedPublisherIsANewEpochAndANewSchemaIsRead) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      uint64_t first_epoch = 0;
      {
        dist::Publisher pub;
        first_epoch = pub.epoch();
        for (int v = 1; v <= 3; ++v) pub.publish(weights(v));
        await_ready(1);
      }
      dist::Publisher pub;
      EXPECT_NE(pub.epoch(), first_epoch);
      TensorDict other = weights(7);
      other.set("extra", at::full({5}, 7.0));
      other.set_non_tensor("note", "seven");
      EXPECT_EQ(pub.publish(other), 1);
      ready(1);
      await_ready(1);
      EXPECT_EQ(pub.publish(lazy_stack({weights(9), weights(9)}, 0)), 2);
      await_ready(1);
    } else {
      dist::Subscriber sub({.src = 0});
      auto got = sub.pull({.timeout = 20s, .min_version = 3});
      ASSERT_TRUE(got.has_value());
      EXPECT_EQ(got->version, 3);
      TensorDict td = got->td;
      const uint64_t epoch = sub.epoch();
      ready(0);
      await_ready(0);
      // The new publisher's version 1 is newer (another epoch), and its schema differs: td
      // is left as it was, naming the key.
      std::string kind;
      const std::string e = error_of([&] { sub.pull(td, {.timeout = 20s}); }, &kind);
      EXPECT_EQ(kind, "SchemaMismatchError") << e;
      EXPECT_NE(e.find("extra"), std::string::npos) << e;
      EXPECT_TRUE(holds(td, 3));
      EXPECT_EQ(sub.epoch(), epoch);
      auto fresh = sub.pull({.timeout = 20s});
      ASSERT_TRUE(fresh.has_value());
      EXPECT_EQ(fresh->version, 1);
      EXPECT_NE(sub.epoch(), epoch);
      EXPECT_TRUE(fresh->td.get("extra").tensor().eq(7).all().item<bool>());
      EXPECT_EQ(fresh->td.get_non_tensor("note"), JsonValue("seven"));
      ready(0);
      auto stack = sub.pull({.timeout = 20s});
      ASSERT_TRUE(stack.has_value());
      EXPECT_EQ(stack->version, 2);
      EXPECT_TRUE(stack->td.is_lazy_stack());
      EXPECT_TRUE(holds(stack->td, 9));
      ready(0);
    }
  });
}

TEST(Publication, NoPublisherIsNamedAndTheGroupLives) {
  run_ranks(2, [](int rank, int) {
    if (rank == 1) {
      dist::Subscriber sub({.src = 0, .channel = 3});
      TensorDict td = weights(0);
      std::string kind;
      const auto t0 = std::chrono::steady_clock::now();
      const std::string e = error_of([&] { sub.pull(td, {.timeout = 400ms}); }, &kind);
      EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
      EXPECT_EQ(kind, "NoPublisherError") << e;
      EXPECT_NE(e.find("rank 0"), std::string::npos) << e;
      EXPECT_NE(e.find("reference tensordict"), std::string::npos) << e;
      EXPECT_TRUE(holds(td, 0));
      ready(0);
      check_pair(rank, 0, 1);
      // A publisher that starts later answers the request left queued.
      auto v = sub.pull(td, {.timeout = 20s});
      ASSERT_TRUE(v.has_value());
      EXPECT_TRUE(holds(td, 5));
      ready(0);
    } else {
      await_ready(1);
      check_pair(rank, 0, 1);
      dist::Publisher pub({.channel = 3});
      pub.publish(weights(5));
      await_ready(1);
    }
    check_pair(rank, 0, 1);
  });
}

// Each forged answer on a channel of its own: a refusal ends that subscriber's link (docs/
// publication.md, "Which peer is which"): the publisher is told by a refusal request, and the
// subscriber's later pulls raise the same error without a message.
TEST(Publication, ForgedMessagesGetNamedErrors) {
  struct Case {
    const char* words;
    uint32_t refusal;  // what the subscriber's refusal says (docs/wire-format.md §9.2)
  };
  const std::vector<Case> cases = {
      {"magic", 1},         {"1152921504606846976 bytes", 2}, {"status 9", 1},
      {"does not hold", 1}, {"answers request 7", 1},         {"stopped short", 4}};
  run_ranks(2, [&](int rank, int) {
    const auto tag = [](int channel, int kind) { return kRequestTag + 8 * channel + kind; };
    if (rank == 0) {
      // A fake publisher: answers each channel's request with a forged offer.
      const std::vector<at::Tensor> offers = {
          message("TDPUBXXX", 1, {1, 5, 1, 16, 0, 0}),                 // wrong magic
          message("TDPUBOFR", 1, {1, 5, 1, uint64_t{1} << 60, 8, 1}),  // lying size
          message("TDPUBOFR", 9, {1, 5, 1, 16, 8, 1}),                 // unknown status
          message("TDPUBOFR", 1, {1, 5, 1, 16, 0, 77}),                // a schema it never sent
          message("TDPUBOFR", 2, {7, 5, 0, 0, 0, 0}),                  // "none" to another seq
      };
      for (size_t i = 0; i < offers.size(); ++i) {
        const int channel = 10 + static_cast<int>(i);
        recv_raw(1, tag(channel, 0), 64);
        send_raw(offers[i], 1, tag(channel, 1));
        const at::Tensor refusal = recv_raw(1, tag(channel, 0), 64);
        EXPECT_EQ(refusal.data_ptr<uint8_t>()[12], cases[i].refusal) << cases[i].words;
      }
      // A whole schema, then data 16 bytes shorter than announced.
      const int channel = 10 + static_cast<int>(offers.size());
      const TensorDict c = consolidate(weights(3));
      const int64_t n = consolidated_storage(c).numel();
      const std::string json =
          metadata_to_json(*consolidated_metadata(c), false, {{"_total_bytes", n}});
      recv_raw(1, tag(channel, 0), 64);
      send_raw(message("TDPUBOFR", 1,
                       {1, 5, 1, static_cast<uint64_t>(n), json.size(),
                        testing::fnv1a(json.data(), json.size())}),
               1, tag(channel, 1));
      send_raw(testing::bytes_of(json), 1, tag(channel, 2));
      send_raw(consolidated_storage(c).narrow(0, 0, n - 16).clone(), 1, tag(channel, 3));
      EXPECT_EQ(recv_raw(1, tag(channel, 0), 64).data_ptr<uint8_t>()[12], 4);
      // A publisher facing a forged request: the subscriber is lost, named, and refused.
      dist::Publisher pub({.channel = 1});
      await_ready(1);
      for (int i = 0; i < 100 && !pub.stats()[0].lost; ++i) std::this_thread::sleep_for(10ms);
      const auto stats = pub.stats();
      EXPECT_TRUE(stats[0].lost);
      EXPECT_NE(stats[0].error.find("magic"), std::string::npos) << stats[0].error;
      EXPECT_EQ(stats[0].error.find("frame #"), std::string::npos) << stats[0].error;
      ready(1);
    } else {
      for (size_t i = 0; i < cases.size(); ++i) {
        dist::Subscriber sub(
            {.src = 0, .channel = 10 + static_cast<int64_t>(i), .max_total_bytes = 1 << 20});
        TensorDict td = weights(0);
        std::string kind;
        const std::string e = error_of([&] { sub.pull(td, {.timeout = 10s}); }, &kind);
        EXPECT_EQ(kind, "MalformedPeerDataError") << e;
        EXPECT_NE(e.find(cases[i].words), std::string::npos) << e;
        EXPECT_TRUE(holds(td, 0));
        // The link ended: the same error at once, whatever the timeout.
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_EQ(error_of([&] { sub.pull(td, {.timeout = 10s}); }, &kind), e);
        EXPECT_EQ(kind, "MalformedPeerDataError");
        EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
      }
      at::Tensor offer = at::empty({64}, at::kByte);
      std::vector<at::Tensor> o{offer};
      auto w = dist::default_group()->recv(o, 0, kOfferTag + 8);
      send_raw(message("NOTAREQ!", 0, {1, 0, 0, 0, 0, 0}), 0, kRequestTag + 8);
      w->wait();
      EXPECT_EQ(offer.data_ptr<uint8_t>()[12], 4);  // kRefused
      ready(0);
      await_ready(0);
    }
    check_pair(rank, 0, 1);
  });
}

}  // namespace
}  // namespace tensordict

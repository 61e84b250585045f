// Checked transfers (checked=true on both sides): matching TensorDicts move as usual; a
// mismatch is an error naming the difference, on real Gloo ranks, with neither side aborted
// and the pair still usable afterwards.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "dist_test_util.h"
#include "expect_throw.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/tags.h"
#include "wire/leaf_order.h"

namespace tensordict::dist {
namespace {

using testing::error_of;
using testing::fnv1a;
using testing::run_ranks;

TensorDict sample(double base) {
  TensorDict inner({{"b", at::full({2}, base + 2)}, {"a2", at::full({2, 2}, base + 1)}}, {2});
  return TensorDict(
      {{"c", at::full({2, 3}, base + 3)}, {"a", inner}, {"_", at::full({2, 1, 5}, base)}}, {2});
}

bool all_equal(const TensorDict& td, double base) {
  const std::map<std::string, double> want = {{"_", 0}, {"a2", 1}, {"b", 2}, {"c", 3}};
  for (const auto& [path, leaf] : wire::leaves_in_order(td)) {
    if (!leaf.eq(base + want.at(path.back())).all().item<bool>()) return false;
  }
  return true;
}

void wait_each(const std::vector<WorkPtr>& works) {
  for (const auto& w : works) w->wait();
}

// A round that must go through after a mismatch: the pair is still in step.
void round_trip_after(int rank) {
  if (rank == 0) {
    send(sample(50), 1, {.init_tag = 3, .checked = true});
  } else {
    TensorDict td = sample(0);
    recv(td, 0, {.init_tag = 3, .checked = true});
    EXPECT_TRUE(all_equal(td, 50));
  }
}

// What recv returns: the last leaf's tag, as without checked.
std::optional<int64_t> recv_tag(const SendOptions& o) {
  int64_t tag = o.init_tag - 1;
  for (int i = 0; i < 4; ++i) tag = o.pseudo_rand ? int_generator(tag + 1) : tag + 1;
  return tag;
}

TEST(DistChecked, EveryFlavourPerLeafAndConsolidated) {
  run_ranks(2, [](int rank, int) {
    int round = 0;
    for (bool consolidated : {false, true}) {
      for (int s = 0; s < 3; ++s) {
        for (int r = 0; r < 3; ++r, ++round) {
          const SendOptions so{.init_tag = 10,
                               .pseudo_rand = round % 2 == 1,
                               .consolidated = consolidated,
                               .checked = true};
          const RecvOptions ro{.init_tag = 10,
                               .pseudo_rand = round % 2 == 1,
                               .consolidated = consolidated,
                               .checked = true};
          if (rank == 0) {
            TensorDict td = sample(round * 10.0);
            if (s == 0) send(td, 1, so);
            if (s == 1) {
              EXPECT_EQ(isend(td, 1, so), consolidated ? std::nullopt : recv_tag(so));
            }
            if (s == 2) wait_each(isend_early(td, 1, so));
          } else {
            TensorDict td = consolidated ? consolidate(sample(-1)) : sample(-1);
            if (r == 0) {
              EXPECT_EQ(recv(td, 0, ro), consolidated ? std::nullopt : recv_tag(so));
            }
            if (r == 1) irecv(td, 0, ro);
            if (r == 2) wait_each(irecv_premature(td, 0, ro));
            EXPECT_TRUE(all_equal(td, round * 10.0)) << "round " << round;
          }
        }
      }
    }
  });
}

// Leaves larger than one payload chunk (4 MiB), a non-contiguous receiver, empty leaves.
TEST(DistChecked, ChunkedNonContiguousAndEmpty) {
  run_ranks(2, [](int rank, int) {
    const auto big = at::arange(3 * (1 << 20), at::kFloat);  // 12 MiB: three chunks
    if (rank == 0) {
      TensorDict td(
          {{"big", big}, {"t", at::arange(12, at::kLong).view({3, 4})}, {"e", at::zeros({0, 3})}},
          {});
      send(td, 1, {.checked = true});
      send(TensorDict({{"big", big}}, {}), 1, {.consolidated = true, .checked = true});
      send(TensorDict({}, {}), 1, {.init_tag = 7, .checked = true});
    } else {
      auto t = at::zeros({4, 3}, at::kLong).t();
      ASSERT_FALSE(t.is_contiguous());
      TensorDict td({{"big", at::zeros_like(big)}, {"t", t}, {"e", at::ones({0, 3})}}, {});
      recv(td, 0, {.checked = true});
      EXPECT_TRUE(at::equal(td.get("big").tensor(), big));
      EXPECT_TRUE(at::equal(t, at::arange(12, at::kLong).view({3, 4})));
      TensorDict c = consolidate(TensorDict({{"big", at::zeros_like(big)}}, {}));
      recv(c, 0, {.consolidated = true, .checked = true});
      EXPECT_TRUE(at::equal(c.get("big").tensor(), big));
      TensorDict empty({}, {});
      EXPECT_EQ(recv(empty, 0, {.init_tag = 7, .checked = true}), 6);
    }
  });
}

struct Mismatch {
  const char* name;
  TensorDict sent;
  TensorDict mine;
  const char* needle;
};

std::vector<Mismatch> mismatches() {
  auto f = [](at::IntArrayRef s) { return at::ones(s); };
  return {
      {"dtype", TensorDict({{"x", f({4})}, {"y", f({2})}}, {}),
       TensorDict({{"x", at::ones({4}, at::kLong)}, {"y", f({2})}}, {}),
       "key 'x' has dtype torch.float32 on the sender and torch.int64 here"},
      {"shape", TensorDict({{"n", TensorDict({{"x", f({3, 4})}}, {})}}, {}),
       TensorDict({{"n", TensorDict({{"x", f({3, 5})}}, {})}}, {}),
       "key ('n', 'x') has shape [3, 4] on the sender and [3, 5] here"},
      {"extra on sender", TensorDict({{"a", f({1})}, {"b", f({1})}}, {}),
       TensorDict({{"b", f({1})}}, {}),
       "key 'a' is in the sender's TensorDict but not in this one"},
      {"extra here", TensorDict({{"a", f({1})}}, {}),
       TensorDict({{"a", f({1})}, {"z", f({1})}}, {}),
       "key 'z' is in this TensorDict but not in the sender's"},
      {"tensor vs nested", TensorDict({{"a", f({1})}}, {}),
       TensorDict({{"a", TensorDict({{"b", f({1})}}, {})}}, {}),
       "key 'a' is a tensor on the sender and a nested TensorDict here"},
      // Gloo would abort this receiver unchecked: 64 MiB sent where 4 bytes were posted.
      {"much larger", TensorDict({{"x", at::ones({16 << 20})}}, {}),
       TensorDict({{"x", f({1})}}, {}), "key 'x' has shape [16777216] on the sender and [1] here"},
      // And fill only a prefix of this one.
      {"smaller", TensorDict({{"x", f({2})}}, {}), TensorDict({{"x", f({100})}}, {}),
       "key 'x' has shape [2] on the sender and [100] here"},
  };
}

TEST(DistChecked, MismatchesAreNamedAndTheReceiverKeepsItsValues) {
  run_ranks(2, [](int rank, int) {
    for (auto& m : mismatches()) {
      if (rank == 0) {
        send(m.sent.apply([](const at::Tensor& t) { return t * 7; }), 1, {.checked = true});
      } else {
        TensorDict before = m.mine.clone();
        std::string kind;
        const std::string err = error_of([&] { recv(m.mine, 0, {.checked = true}); }, &kind);
        EXPECT_NE(err.find(m.needle), std::string::npos) << m.name << ": " << err;
        EXPECT_EQ(kind, "SchemaMismatchError") << err;
        EXPECT_NE(err.find("this TensorDict is unchanged"), std::string::npos) << err;
        for (const auto& [path, leaf] : wire::leaves_in_order(before)) {
          EXPECT_TRUE(at::equal(leaf, m.mine.get(NestedKey(path)).tensor())) << m.name;
        }
      }
      round_trip_after(rank);
    }
  });
}

TEST(DistChecked, ConsolidatedMismatches) {
  run_ranks(2, [](int rank, int) {
    TensorDict ab({{"a", at::ones({3})}, {"b", at::ones({5}, at::kDouble)}}, {});
    if (rank == 0) {
      send(ab, 1, {.consolidated = true, .checked = true});
      send(ab, 1, {.consolidated = true, .checked = true});
      send(ab, 1, {.consolidated = true, .checked = true});
      send(ab, 1, {.consolidated = false, .checked = true});
    } else {
      // Same keys, dtypes and shapes, another layout: b first in the storage.
      TensorDict ba =
          consolidate(TensorDict({{"b", at::zeros({5}, at::kDouble)}, {"a", at::zeros({3})}}, {}));
      std::string err = error_of([&] { recv(ba, 0, {.consolidated = true, .checked = true}); });
      EXPECT_NE(err.find("key 'a' lies at byte 0 with strides [1] in the sender's consolidated "
                         "storage and at byte 40 with strides [1] here"),
                std::string::npos)
          << err;
      TensorDict mine =
          consolidate(TensorDict({{"a", at::zeros({3})}, {"b", at::zeros({6}, at::kDouble)}}, {}));
      err = error_of([&] { recv(mine, 0, {.consolidated = true, .checked = true}); });
      EXPECT_NE(err.find("key 'b' has shape [5] on the sender and [6] here"), std::string::npos)
          << err;
      EXPECT_TRUE(mine.get("a").tensor().eq(0).all().item<bool>());
      TensorDict other = consolidate(TensorDict({{"a", at::zeros({3})}}, {}));
      err = error_of([&] { recv(other, 0, {.consolidated = true, .checked = true}); });
      EXPECT_NE(err.find("key 'b' is in the sender's TensorDict but not in this one"),
                std::string::npos)
          << err;
      TensorDict per_leaf = consolidate(ab.clone());
      err = error_of([&] { recv(per_leaf, 0, {.consolidated = true, .checked = true}); });
      EXPECT_NE(err.find("the sender passed consolidated=False and this receiver "
                         "consolidated=True"),
                std::string::npos)
          << err;
    }
    round_trip_after(rank);
  });
}

// A checked receiver facing a sender that did not pass checked, or a forged header from a raw
// c10d peer: a clear error, no abort, no allocation of what the header claims.
at::Tensor forged_header(uint32_t version, uint32_t mode, uint64_t schema_bytes, bool good_hash) {
  at::Tensor h = at::zeros({64}, at::kByte);
  auto* p = h.data_ptr<uint8_t>();
  std::memcpy(p, "TDCHECKD", 8);
  std::memcpy(p + 8, &version, 4);
  std::memcpy(p + 12, &mode, 4);
  const uint64_t fields[5] = {0, schema_bytes, 0, 4 << 20, 0};
  std::memcpy(p + 16, fields, sizeof(fields));
  const uint64_t hash = good_hash ? fnv1a(p, 56) : 1;
  std::memcpy(p + 56, &hash, 8);
  return h;
}

TEST(DistChecked, UncheckedSenderAndForgedHeaders) {
  run_ranks(2, [](int rank, int) {
    auto pg = default_group();
    const std::vector<std::pair<at::Tensor, const char*>> cases = {
        {at::ones({16}), "not a checked-transfer header; the sender must pass checked=True"},
        {at::ones({4}),
         "shorter than a checked-transfer header (64 bytes); the sender must "
         "pass checked=True"},
        {forged_header(2, 0, 0, true), "version 2"},
        {forged_header(1, 0, 0, false), "header is corrupt"},
        {forged_header(1, 7, 0, true), "unknown mode 7"},
        {forged_header(1, 0, uint64_t{1} << 40, true), "above the limit"},
    };
    for (const auto& [message, needle] : cases) {
      if (rank == 0) {
        std::vector<at::Tensor> one{message};
        pg->send(one, 1, 0)->wait();
      } else {
        TensorDict td({{"x", at::zeros({100})}}, {});
        std::string kind;
        const std::string err = error_of([&] { recv(td, 0, {.checked = true}); }, &kind);
        EXPECT_NE(err.find(needle), std::string::npos) << err;
        EXPECT_EQ(kind, "MalformedPeerDataError") << err;  // not a checked sender's bytes
        EXPECT_TRUE(td.get("x").tensor().eq(0).all().item<bool>());
      }
    }
    round_trip_after(rank);
  });
}

// A header announcing the receiver's own schema (size and hash) lets it post the payload's
// receives with the schema's. A schema that then differs has written the payload, and the
// error says so. Rank 1 takes two genuine checked sends apart (of 'k' and of 'j', schemas of
// one size) and sends back the header of 'k' with the schema and payload of 'j'.
TEST(DistChecked, HeaderAnnouncingTheReceiversSchema) {
  run_ranks(2, [](int rank, int) {
    auto pg = default_group();
    TensorDict mine({{"k", at::zeros({3}, at::kShort)}}, {});
    if (rank == 0) {
      send(mine, 1, {.checked = true});
      send(TensorDict({{"j", at::ones({3}, at::kShort)}}, {}), 1, {.checked = true});
      std::string kind;
      const std::string err = error_of([&] { recv(mine, 1, {.checked = true}); }, &kind);
      EXPECT_NE(err.find("does not match the header's hash"), std::string::npos) << err;
      EXPECT_EQ(kind, "MalformedPeerDataError") << err;
      EXPECT_TRUE(mine.get("k").tensor().eq(1).all().item<bool>());  // the payload landed
    } else {
      const auto take = [&](int64_t n) {
        std::vector<at::Tensor> one{at::zeros({n}, at::kByte)};
        pg->recv(one, 0, 0)->wait();
        return one[0];
      };
      std::vector<std::vector<at::Tensor>> parts;  // header, schema, payload of each send
      for (int i = 0; i < 2; ++i) {
        at::Tensor header = take(64);
        int64_t schema_bytes = 0;
        std::memcpy(&schema_bytes, header.data_ptr<uint8_t>() + 24, 8);
        at::Tensor schema = take(schema_bytes);
        parts.push_back({header, schema, take(6)});
      }
      ASSERT_EQ(parts[0][1].numel(), parts[1][1].numel());
      for (const at::Tensor& m : {parts[0][0], parts[1][1], parts[1][2]}) {
        std::vector<at::Tensor> one{m};
        pg->send(one, 0, 0)->wait();
      }
    }
    round_trip_after(rank);
  });
}

// A quantized leaf's storage is not numel * element size bytes: refused before any message.
TEST(DistChecked, QuantizedLeavesAreRefused) {
  run_ranks(2, [](int rank, int) {
    TensorDict td({{"q", at::quantize_per_tensor(at::ones({4}), 0.1, 0, at::kQUInt8)}}, {});
    const std::string err = error_of([&] {
      if (rank == 0) send(td, 1, {.checked = true});
      if (rank == 1) recv(td, 0, {.checked = true});
    });
    EXPECT_NE(err.find(": leaf 'q' has the quantized dtype torch.quint8"), std::string::npos)
        << err;
    round_trip_after(rank);
  });
}

// The header's bytes as docs/reliability.md gives them.
TEST(DistChecked, HeaderLayout) {
  run_ranks(2, [](int rank, int) {
    auto pg = default_group();
    if (rank == 0) {
      send(TensorDict({{"k", at::ones({3}, at::kShort)}}, {}), 1, {.init_tag = 4, .checked = true});
    } else {
      std::vector<at::Tensor> header{at::zeros({64}, at::kByte)};
      pg->recv(header, 0, 4)->wait();
      const auto* p = header[0].data_ptr<uint8_t>();
      auto u64 = [&](int at) {
        uint64_t v;
        std::memcpy(&v, p + at, 8);
        return v;
      };
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(p), 8), "TDCHECKD");
      EXPECT_EQ(u64(8), 1u);   // version 1, mode 0 (per leaf)
      EXPECT_EQ(u64(16), 6u);  // payload bytes
      EXPECT_EQ(u64(40), 4u << 20);
      EXPECT_EQ(u64(48), 1u);  // leaves
      EXPECT_EQ(u64(56), fnv1a(p, 56));
      std::vector<at::Tensor> schema{at::zeros({static_cast<int64_t>(u64(24))}, at::kByte)};
      pg->recv(schema, 0, 4)->wait();
      EXPECT_EQ(u64(32), fnv1a(schema[0].data_ptr<uint8_t>(), schema[0].numel()));
      std::vector<at::Tensor> payload{at::zeros({3}, at::kShort)};
      pg->recv(payload, 0, 4)->wait();
      EXPECT_TRUE(payload[0].eq(1).all().item<bool>());
    }
  });
}

}  // namespace
}  // namespace tensordict::dist

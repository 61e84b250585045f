// send / recv / isend / irecv over Gloo, on real processes (127.0.0.1, FileStore rendezvous).
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <filesystem>
#include <limits>
#include <map>

#include "dist_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/collectives.h"
#include "tensordict/distributed/init_remote.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/tags.h"
#include "tensordict/lazy_stack.h"
#include "wire/leaf_order.h"

namespace tensordict::dist {
namespace {

using testing::error_of;
using testing::run_ranks;

// Leaf i of the wire order holds base + i, so a leaf received in another leaf's place shows.
// Receivers insert keys in the opposite order: only the sorted wire order lines them up.
TensorDict sample(double base, bool reversed = false) {
  auto leaf = [&](int i, at::IntArrayRef shape) { return at::full(shape, base + i); };
  if (!reversed) {
    TensorDict inner({{"b", leaf(2, {2})}, {"a2", leaf(1, {2, 2})}}, {2});
    return TensorDict({{"c", leaf(3, {2, 3})}, {"a", inner}, {"_", leaf(0, {2, 1, 5})}}, {2});
  }
  TensorDict inner({{"a2", leaf(1, {2, 2})}, {"b", leaf(2, {2})}}, {2});
  return TensorDict({{"_", leaf(0, {2, 1, 5})}, {"a", inner}, {"c", leaf(3, {2, 3})}}, {2});
}

void expect_values(const TensorDict& td, double base) {
  for (const auto& [path, leaf] : wire::leaves_in_order(td)) {
    static const std::vector<std::vector<std::string>> order = {
        {"_"}, {"a", "a2"}, {"a", "b"}, {"c"}};
    const auto i = std::find(order.begin(), order.end(), path) - order.begin();
    ASSERT_LT(i, 4);
    EXPECT_TRUE(leaf.eq(base + static_cast<double>(i)).all().item<bool>())
        << "leaf " << path.back() << " holds " << leaf.flatten()[0].item<double>();
  }
}

int64_t last_tag(int64_t init_tag, int leaves, bool pseudo_rand) {
  int64_t tag = init_tag - 1;
  for (int i = 0; i < leaves; ++i) {
    tag = next_tag(tag, pseudo_rand);
  }
  return tag;
}

void wait_all(const std::vector<WorkPtr>& works) {
  for (const auto& w : works) {
    w->wait();
  }
}

enum class SendKind { kSend, kIsend, kIsendEarly };
enum class RecvKind { kRecv, kIrecv, kIrecvPremature };

// Every send flavour against every receive flavour; returns the tag each side reports.
std::optional<int64_t> do_send(SendKind kind, const TensorDict& td, std::optional<int64_t> dst,
                               const SendOptions& o, size_t leaves = 4) {
  switch (kind) {
    case SendKind::kSend: send(td, dst, o); return std::nullopt;
    case SendKind::kIsend: return isend(td, dst, o);
    case SendKind::kIsendEarly: {
      auto works = isend_early(td, dst, o);
      EXPECT_EQ(works.size(), o.consolidated ? 1u : leaves);
      wait_all(works);
      return std::nullopt;
    }
  }
  return std::nullopt;
}

std::optional<int64_t> do_recv(RecvKind kind, const TensorDict& td, std::optional<int64_t> src,
                               const RecvOptions& o, size_t leaves = 4) {
  switch (kind) {
    case RecvKind::kRecv: return recv(td, src, o);
    case RecvKind::kIrecv: irecv(td, src, o); return std::nullopt;
    case RecvKind::kIrecvPremature: {
      auto works = irecv_premature(td, src, o);
      EXPECT_EQ(works.size(), o.consolidated ? 1u : leaves);
      wait_all(works);
      return std::nullopt;
    }
  }
  return std::nullopt;
}

// How the peer is named: a global rank (default group or a new_group), or a group rank (in
// the default group, a new_group, or a standalone group never registered).
enum class PeerKind { kGlobalDefault, kGlobalNewGroup, kGroupDefault, kGroupNewGroup, kGroupRaw };

struct PeerSetup {
  Group group;
  bool by_group_rank = false;
};

PeerSetup make_peer(PeerKind kind, int rank) {
  switch (kind) {
    case PeerKind::kGlobalDefault: return {{}, false};
    case PeerKind::kGlobalNewGroup: return {new_group({0, 1}), false};
    case PeerKind::kGroupDefault: return {default_group(), true};
    case PeerKind::kGroupNewGroup: return {new_group({0, 1}), true};
    case PeerKind::kGroupRaw: {
      auto store = c10::make_intrusive<c10d::PrefixStore>(
          "raw_pair", c10::make_intrusive<c10d::FileStore>(run_scratch_dir() + "/raw", 2));
      return {make_gloo_backend(store, rank, 2, std::chrono::seconds(20), "127.0.0.1"), true};
    }
  }
  return {};
}

class DistP2PCombos : public ::testing::TestWithParam<PeerKind> {};

TEST_P(DistP2PCombos, EveryFlavourAndOption) {
  const PeerKind kind = GetParam();
  run_ranks(2, [kind](int rank, int) {
    PeerSetup peer = make_peer(kind, rank);
    const int other = 1 - rank;
    int round = 0;
    for (auto sk : {SendKind::kSend, SendKind::kIsend, SendKind::kIsendEarly}) {
      for (auto rk : {RecvKind::kRecv, RecvKind::kIrecv, RecvKind::kIrecvPremature}) {
        for (bool consolidated : {false, true}) {
          for (bool pseudo_rand : {false, true}) {
            for (int64_t init_tag : {int64_t{0}, int64_t{1000}}) {
              SCOPED_TRACE(c10::str("send kind ", int(sk), ", recv kind ", int(rk),
                                    ", consolidated ", consolidated, ", pseudo_rand ", pseudo_rand,
                                    ", init_tag ", init_tag));
              // Alternate the direction; the sender's TensorDict is consolidated every other
              // round (send must use its storage as is, or consolidate a copy).
              const bool sending = (round % 2 == 0) == (rank == 0);
              const double base = 10.0 * (round + 1);
              const std::optional<int64_t> global =
                  peer.by_group_rank ? std::nullopt : std::optional<int64_t>(other);
              const std::optional<int64_t> in_group =
                  peer.by_group_rank ? std::optional<int64_t>(other) : std::nullopt;
              if (sending) {
                TensorDict td = sample(base);
                if (consolidated && round % 3 == 0) {
                  td = consolidate(td);
                }
                auto tag = do_send(sk, td, global,
                                   {.group = peer.group,
                                    .group_dst = in_group,
                                    .init_tag = init_tag,
                                    .pseudo_rand = pseudo_rand,
                                    .consolidated = consolidated});
                if (sk == SendKind::kIsend && !consolidated) {
                  EXPECT_EQ(tag, last_tag(init_tag, 4, pseudo_rand));
                }
              } else {
                TensorDict td = consolidated ? consolidate(sample(0.0)) : sample(0.0, true);
                auto tag = do_recv(rk, td, global,
                                   {.group = peer.group,
                                    .group_src = in_group,
                                    .init_tag = init_tag,
                                    .pseudo_rand = pseudo_rand,
                                    .consolidated = consolidated});
                if (rk == RecvKind::kRecv) {
                  EXPECT_EQ(tag, consolidated
                                     ? std::nullopt
                                     : std::optional<int64_t>(last_tag(init_tag, 4, pseudo_rand)));
                }
                expect_values(td, base);
              }
              ++round;
            }
          }
        }
      }
    }
  });
}

std::string peer_name(const ::testing::TestParamInfo<PeerKind>& info) {
  static const char* names[] = {"GlobalDefault", "GlobalNewGroup", "GroupDefault", "GroupNewGroup",
                                "GroupRaw"};
  return names[static_cast<int>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Peers, DistP2PCombos,
                         ::testing::Values(PeerKind::kGlobalDefault, PeerKind::kGlobalNewGroup,
                                           PeerKind::kGroupDefault, PeerKind::kGroupNewGroup,
                                           PeerKind::kGroupRaw),
                         peer_name);

// Keys sorted by code point at every level ("A" < "_" < "b" < "c" < "cls"), three levels deep,
// every leaf the same shape so that a wrong order would silently swap values.
TensorDict deep(bool reversed, bool zeros) {
  std::vector<std::string> keys = {"b", "cls", "A", "c", "_"};  // sorted: A _ b c cls
  if (reversed) {
    std::reverse(keys.begin(), keys.end());
  }
  int counter = 0;
  std::map<std::vector<std::string>, double> value;
  std::function<void(int, std::vector<std::string>)> number = [&](int depth,
                                                                  std::vector<std::string> p) {
    std::vector<std::string> sorted = {"A", "_", "b", "c", "cls"};
    for (const auto& k : sorted) {
      p.push_back(k);
      if (depth < 3 && k == "c") {
        number(depth + 1, p);
      } else {
        value[p] = counter++;
      }
      p.pop_back();
    }
  };
  number(1, {});
  std::function<TensorDict(int, std::vector<std::string>)> build = [&](int depth,
                                                                       std::vector<std::string> p) {
    std::vector<TensorDict::Entry> entries;
    for (const auto& k : keys) {
      p.push_back(k);
      if (depth < 3 && k == "c") {
        entries.emplace_back(k, build(depth + 1, p));
      } else {
        entries.emplace_back(k, at::full({3}, zeros ? -1.0 : value[p]));
      }
      p.pop_back();
    }
    return TensorDict(entries, {3});
  };
  return build(1, {});
}

TEST(DistP2P, WireOrderIsSortedDepthFirst) {
  auto order = wire::leaves_in_order(deep(true, false));
  ASSERT_EQ(order.size(), 13u);
  const std::vector<std::vector<std::string>> head = {
      {"A"}, {"_"}, {"b"}, {"c", "A"}, {"c", "_"}, {"c", "b"}, {"c", "c", "A"}};
  for (size_t i = 0; i < head.size(); ++i) {
    EXPECT_EQ(order[i].first, head[i]);
  }
  EXPECT_EQ(order.back().first, (std::vector<std::string>{"cls"}));
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(order[i].second[0].item<double>(), double(i));
  }
}

TEST(DistP2P, NestedThreeDeep) {
  run_ranks(2, [](int rank, int) {
    for (bool pseudo_rand : {false, true}) {
      if (rank == 0) {
        send(deep(false, false), 1, {.init_tag = 3, .pseudo_rand = pseudo_rand});
      } else {
        TensorDict td = deep(true, true);
        EXPECT_EQ(recv(td, 0, {.init_tag = 3, .pseudo_rand = pseudo_rand}),
                  last_tag(3, 13, pseudo_rand));
        EXPECT_TRUE((td == deep(true, false)).all());
      }
    }
  });
}

// A heterogeneous lazy stack (member 1's leaf y is wider, member 0 alone has e) inside a
// TensorDict, every leaf holding `fill`.
TensorDict lazy_sample(double fill) {
  TensorDict a({{"x", at::full({3}, fill)},
                {"e", at::full({3, 2}, fill)},
                {{"n", "y"}, at::full({3, 2}, fill)}},
               {3});
  TensorDict b({{"x", at::full({3}, fill)}, {{"n", "y"}, at::full({3, 4}, fill)}}, {3});
  return TensorDict({{"z", at::full({2, 3}, fill)}, {"s", LazyStackedTensorDict({a, b}, 0)}},
                    {2, 3});
}

bool all_equal(const TensorDict& td, double fill) {
  for (const auto& [path, leaf] : wire::leaves_in_order(td)) {
    if (!leaf.eq(fill).all().item<bool>()) return false;
  }
  return !wire::leaves_in_order(td).empty();
}

TEST(DistP2P, LazyStacksPerLeafInitRemoteAndAllReduce) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      send(lazy_sample(1), 1);
      init_remote(lazy_sample(2), 1);
    } else {
      TensorDict td = lazy_sample(0);
      const at::Tensor wide = LazyStackedTensorDict::of(td.get("s").tensordict())
                                  .tensordicts()[1]
                                  .get({"n", "y"})
                                  .tensor();
      EXPECT_EQ(recv(td, 0), 5);  // 6 leaves: z, then member 0's 3 and member 1's 2
      EXPECT_TRUE(all_equal(td, 1));
      EXPECT_TRUE(wide.eq(1).all().item<bool>());  // received in place
      const TensorDict got = from_remote_init(0);
      ASSERT_TRUE(got.get("s").tensordict().is_lazy_stack());
      EXPECT_EQ(LazyStackedTensorDict::of(got.get("s").tensordict())
                    .tensordicts()[1]
                    .get({"n", "y"})
                    .tensor()
                    .sizes(),
                at::IntArrayRef({3, 4}));
      EXPECT_TRUE(all_equal(got, 2));
    }
    TensorDict mine = lazy_sample(rank + 1.0);
    all_reduce(mine);
    EXPECT_TRUE(all_equal(mine, 3));
  });
}

std::vector<at::ScalarType> all_dtypes() {
  return {at::kByte,          at::kChar,        at::kShort,           at::kInt,
          at::kLong,          at::kUInt16,      at::kUInt32,          at::kUInt64,
          at::kHalf,          at::kBFloat16,    at::kFloat,           at::kDouble,
          at::kBool,          at::kComplexHalf, at::kComplexFloat,    at::kComplexDouble,
          at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz};
}

// Random bytes viewed as each dtype (bool: 0 or 1), compared byte for byte (NaNs included).
TensorDict every_dtype(bool zeros, bool nameable_only) {
  at::manual_seed(1234);
  std::vector<TensorDict::Entry> entries;
  for (auto dtype : all_dtypes()) {
    if (nameable_only && at::isFloat8Type(dtype)) {
      continue;  // consolidate() refuses dtypes the reference cannot name
    }
    at::Tensor bytes = at::randint(0, 256, {2, 16}, at::kByte);
    if (dtype == at::kBool) {
      bytes = bytes.remainder(2);
    }
    at::Tensor leaf = bytes.view(dtype);
    entries.emplace_back(std::string("k_") + c10::toString(dtype),
                         zeros ? at::zeros_like(bytes).view(dtype) : leaf);
  }
  return TensorDict(entries, {2});
}

void expect_same_bytes(const TensorDict& a, const TensorDict& b) {
  auto x = wire::leaves_in_order(a);
  auto y = wire::leaves_in_order(b);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].second.scalar_type(), y[i].second.scalar_type());
    EXPECT_TRUE(at::equal(x[i].second.reshape({-1}).view(at::kByte),
                          y[i].second.reshape({-1}).view(at::kByte)))
        << x[i].first.back();
  }
}

TEST(DistP2P, EveryDtype) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      send(every_dtype(false, false), 1);
      send(every_dtype(false, true), 1, {.consolidated = true});
    } else {
      TensorDict td = every_dtype(true, false);
      recv(td, 0);
      expect_same_bytes(td, every_dtype(false, false));
      TensorDict tc = consolidate(every_dtype(true, true));
      recv(tc, 0, {.consolidated = true});
      expect_same_bytes(tc, every_dtype(false, true));
    }
  });
}

// 0-dim and numel-0 leaves still take a tag each (an empty message), so the leaves after them
// keep their tags.
TensorDict odd_shapes(bool zeros) {
  auto v = [&](at::Tensor t) { return zeros ? at::zeros_like(t) : t; };
  return TensorDict({{"a_scalar", v(at::scalar_tensor(3.5))},
                     {"b_empty", v(at::ones({0}))},
                     {"c_empty2d", v(at::ones({0, 4}, at::kLong))},
                     {"d_after", v(at::arange(5, at::kInt))},
                     {"e_nested", TensorDict({{"f_scalar", v(at::scalar_tensor(7, at::kLong))}})}},
                    {});
}

TEST(DistP2P, ZeroDimAndEmptyLeaves) {
  run_ranks(2, [](int rank, int) {
    for (bool consolidated : {false, true}) {
      if (rank == 0) {
        send(odd_shapes(false), 1, {.init_tag = 2, .consolidated = consolidated});
      } else {
        TensorDict td = consolidated ? consolidate(odd_shapes(true)) : odd_shapes(true);
        auto tag = recv(td, 0, {.init_tag = 2, .consolidated = consolidated});
        if (!consolidated) {
          EXPECT_EQ(tag, 2 + 5 - 1);
        }
        expect_same_bytes(td, odd_shapes(false));
      }
    }
  });
}

TEST(DistP2P, EmptyTensorDict) {
  run_ranks(2, [](int rank, int) {
    TensorDict empty;
    TensorDict empty_nested({{"x", TensorDict()}, {"y", TensorDict({{"z", TensorDict()}})}}, {});
    if (rank == 0) {
      send(empty, 1, {.init_tag = 7});
      EXPECT_EQ(isend(empty_nested, 1, {.init_tag = 7}), 6);
      EXPECT_TRUE(isend_early(empty, 1).empty());
      send(sample(5.0), 1);  // nothing stray may precede it
    } else {
      EXPECT_EQ(recv(empty, 0, {.init_tag = 7}), 6);
      EXPECT_EQ(recv(empty_nested, 0, {.init_tag = 7, .pseudo_rand = true}), 6);
      EXPECT_TRUE(irecv_premature(empty, 0).empty());
      TensorDict td = sample(0.0, true);
      recv(td, 0);
      expect_values(td, 5.0);
    }
  });
}

TensorDict many_leaves(int n, bool zeros) {
  std::vector<TensorDict::Entry> entries;
  for (int i = 0; i < n; ++i) {
    entries.emplace_back(c10::str("k", 10000 + i), at::full({2}, zeros ? -1.0 : double(i)));
  }
  return TensorDict(entries, {2});
}

// With pseudo_rand, 1000 leaves reuse tags (the chain cycles after 107): same-tag messages
// must still pair in posting order.
TEST(DistP2P, ThousandLeaves) {
  run_ranks(2, [](int rank, int) {
    for (bool pseudo_rand : {false, true}) {
      for (bool async : {false, true}) {
        if (rank == 0) {
          auto td = many_leaves(1000, false);
          if (async) {
            auto works = isend_early(td, 1, {.pseudo_rand = pseudo_rand});
            EXPECT_EQ(works.size(), 1000u);
            wait_all(works);
          } else {
            send(td, 1, {.pseudo_rand = pseudo_rand});
          }
        } else {
          auto td = many_leaves(1000, true);
          if (async) {
            wait_all(irecv_premature(td, 0, {.pseudo_rand = pseudo_rand}));
          } else {
            recv(td, 0, {.pseudo_rand = pseudo_rand});
          }
          EXPECT_TRUE((td == many_leaves(1000, false)).all());
        }
      }
    }
  });
}

TEST(DistP2P, OneHundredMegabyteLeaf) {
  run_ranks(2, [](int rank, int) {
    constexpr int64_t kNumel = 25 * 1000 * 1000;  // 100 MB of float32
    auto expected = [] { return at::arange(kNumel, at::kInt).remainder(65521).to(at::kFloat); };
    for (bool consolidated : {false, true}) {
      if (rank == 0) {
        send(TensorDict({{"big", expected()}}, {}), 1, {.consolidated = consolidated});
      } else {
        TensorDict td({{"big", at::zeros({kNumel})}}, {});
        if (consolidated) {
          td = consolidate(td);
        }
        recv(td, 0, {.consolidated = consolidated});
        EXPECT_TRUE(at::equal(td.get("big").tensor(), expected()));
      }
    }
  });
}

// Two transfers in flight with disjoint tag ranges; the receiver takes the second one first.
TEST(DistP2P, ConcurrentTransfersReceivedInOppositeOrder) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      auto first = isend_early(sample(100.0), 1, {.init_tag = 0});
      auto second = isend_early(sample(200.0), 1, {.init_tag = 4});
      wait_all(second);
      wait_all(first);
    } else {
      TensorDict second = sample(0.0, true);
      TensorDict first = sample(0.0, true);
      recv(second, 0, {.init_tag = 4});
      recv(first, 0, {.init_tag = 0});
      expect_values(second, 200.0);
      expect_values(first, 100.0);
    }
  });
}

// group_dst / group_src on standalone groups whose ranks differ from the global ones: global
// rank 2 is group rank 0 and global rank 1 is group rank 1. Once as a bare Gloo backend (what
// Python's ProcessGroupGloo(...) is), once wrapped in a c10d::ProcessGroup built by hand.
TEST(DistP2P, GroupDstOnStandaloneGroups) {
  run_ranks(3, [](int rank, int) {
    if (rank == 0) {
      return;
    }
    const int group_rank = rank == 2 ? 0 : 1;
    auto file_store = c10::make_intrusive<c10d::FileStore>(run_scratch_dir() + "/pair", 2);
    auto backend = make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("raw", file_store),
                                     group_rank, 2, std::chrono::seconds(20), "127.0.0.1");
    auto wrapped = c10::make_intrusive<c10d::ProcessGroup>(
        c10::make_intrusive<c10d::PrefixStore>("wrapped", file_store), group_rank, 2);
    wrapped->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                        make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("w", file_store),
                                          group_rank, 2, std::chrono::seconds(20), "127.0.0.1"));
    wrapped->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    for (Group g : {Group(backend), Group(wrapped)}) {
      if (rank == 2) {
        send(sample(42.0), {}, {.group = g, .group_dst = 1, .pseudo_rand = true});
      } else {
        TensorDict td = sample(0.0, true);
        recv(td, {}, {.group = g, .group_src = 0, .pseudo_rand = true});
        expect_values(td, 42.0);
      }
      // A global rank needs a registered group.
      EXPECT_NE(error_of([&] {
                  send(sample(1.0), 1, {.group = g});
                }).find("is not registered, please create group with new_group"),
                std::string::npos);
    }
  });
}

// new_group({1, 2}) in a world of 3: peers named by global rank, translated for the group.
TEST(DistP2P, NewGroupAddressedByGlobalRank) {
  run_ranks(3, [](int rank, int) {
    auto g = new_group({1, 2});
    if (rank == 0) {
      return;
    }
    const int64_t other = rank == 1 ? 2 : 1;
    for (bool pseudo_rand : {false, true}) {
      if (rank == 1) {
        send(sample(7.0), other, {.group = g, .pseudo_rand = pseudo_rand});
        TensorDict back = sample(0.0, true);
        irecv(back, other, {.group = g, .init_tag = 50, .pseudo_rand = pseudo_rand});
        expect_values(back, 8.0);
      } else {
        TensorDict td = sample(0.0, true);
        recv(td, other, {.group = g, .pseudo_rand = pseudo_rand});
        expect_values(td, 7.0);
        isend(sample(8.0), other, {.group = g, .init_tag = 50, .pseudo_rand = pseudo_rand});
      }
    }
    EXPECT_EQ(error_of([&] { send(sample(1.0), 0, {.group = g}); }),
              "Global rank 0 is not part of group ProcessGroup '1'");
  });
}

// A peer that speaks raw c10d: the tags and the leaf order are written out by hand here.
TEST(DistP2P, RawC10dPeerSeesTheWireFormat) {
  run_ranks(2, [](int rank, int) {
    auto pg = default_group();
    if (rank == 0) {
      send(sample(1.0), 1, {.init_tag = 5});
      TensorDict td = sample(0.0, true);
      recv(td, 1, {.pseudo_rand = true});
      expect_values(td, 2.0);
      // docs/wire-format.md §3.4: a f32[4], b f32[4,3], c/d i64[4] -> 96 bytes; and the padding
      // example x f32[3], y bool[5], z f64[] -> 32 bytes with zero pads.
      TensorDict example({{"a", at::arange(4, at::kFloat)},
                          {"b", at::arange(12, at::kFloat).view({4, 3}) + 100},
                          {"c", TensorDict({{"d", at::arange(4, at::kLong) + 1000}}, {4})}},
                         {4});
      send(example, 1, {.consolidated = true});
      TensorDict padded({{"x", at::full({3}, 1.5f)},
                         {"y", at::ones({5}, at::kBool)},
                         {"z", at::scalar_tensor(2.25, at::kDouble)}},
                        {});
      send(padded, 1, {.init_tag = 99, .consolidated = true});  // init_tag ignored
    } else {
      // Receives posted in reverse: Gloo pairs by tag, and the tags say which leaf is which.
      const std::vector<std::pair<int, std::vector<int64_t>>> expected = {
          {5, {2, 1, 5}}, {6, {2, 2}}, {7, {2}}, {8, {2, 3}}};  // "_", a/a2, a/b, c
      std::vector<std::vector<at::Tensor>> bufs;
      std::vector<WorkPtr> works;
      for (auto it = expected.rbegin(); it != expected.rend(); ++it) {
        bufs.push_back({at::zeros(it->second)});
        works.push_back(pg->recv(bufs.back(), 0, it->first));
      }
      wait_all(works);
      for (size_t i = 0; i < bufs.size(); ++i) {
        const double want = 1.0 + double(expected.size() - 1 - i);
        EXPECT_TRUE(bufs[i][0].eq(want).all().item<bool>()) << "tag " << expected.rbegin()[i].first;
      }
      // Now raw sends with the pseudo-random tags of docs/wire-format.md §2.7, init_tag 0.
      const std::vector<int> tags = {9651, 3450, 3834, 3840};
      const std::vector<std::vector<int64_t>> shapes = {{2, 1, 5}, {2, 2}, {2}, {2, 3}};
      std::vector<WorkPtr> sends;
      std::vector<std::vector<at::Tensor>> out;
      for (size_t i = 0; i < tags.size(); ++i) {
        out.push_back({at::full(shapes[i], 2.0 + double(i))});
        sends.push_back(pg->send(out.back(), 0, tags[i]));
      }
      wait_all(sends);
      // Consolidated: one uint8 message with tag 0.
      std::vector<at::Tensor> storage{at::zeros({96}, at::kByte)};
      pg->recv(storage, 0, 0)->wait();
      EXPECT_TRUE(
          at::equal(storage[0].slice(0, 0, 16).view(at::kFloat), at::arange(4, at::kFloat)));
      EXPECT_TRUE(at::equal(storage[0].slice(0, 16, 64).view(at::kFloat),
                            at::arange(12, at::kFloat) + 100));
      EXPECT_TRUE(
          at::equal(storage[0].slice(0, 64, 96).view(at::kLong), at::arange(4, at::kLong) + 1000));
      std::vector<at::Tensor> padded{at::full({32}, 0xAB, at::kByte)};
      pg->recv(padded, 0, 0)->wait();
      const auto& p = padded[0];
      EXPECT_TRUE(at::equal(p.slice(0, 0, 12).view(at::kFloat), at::full({3}, 1.5f)));
      EXPECT_TRUE(at::equal(p.slice(0, 12, 16), at::zeros({4}, at::kByte)));
      EXPECT_TRUE(at::equal(p.slice(0, 16, 21), at::ones({5}, at::kByte)));
      EXPECT_TRUE(at::equal(p.slice(0, 21, 24), at::zeros({3}, at::kByte)));
      EXPECT_EQ(p.slice(0, 24, 32).view(at::kDouble).item<double>(), 2.25);
    }
  });
}

// Non-contiguous leaves: sent from a contiguous copy, received through one.
TEST(DistP2P, NonContiguousLeaves) {
  run_ranks(2, [](int rank, int) {
    auto expected_t = at::arange(12, at::kFloat).view({3, 4}).t().contiguous();
    auto expected_s = at::arange(10, at::kDouble) * 3;
    for (auto rk : {RecvKind::kRecv, RecvKind::kIrecv, RecvKind::kIrecvPremature}) {
      if (rank == 0) {
        TensorDict td({{"t", at::arange(12, at::kFloat).view({3, 4}).t()},
                       {"s", (at::arange(20, at::kDouble) * 1.5).slice(0, 0, 20, 2)},
                       {"o", at::arange(8, at::kLong).slice(0, 3, 6)}},  // storage offset
                      {});
        send(td, 1);
      } else {
        auto t = at::zeros({3, 4}).t();
        auto s_base = at::zeros({20}, at::kDouble);
        auto s = s_base.slice(0, 1, 20, 2);
        auto o = at::zeros({9}, at::kLong).slice(0, 4, 7);
        ASSERT_FALSE(t.is_contiguous());
        ASSERT_FALSE(s.is_contiguous());
        TensorDict td({{"t", t}, {"s", s}, {"o", o}}, {});
        do_recv(rk, td, 0, {}, 3);
        EXPECT_TRUE(at::equal(t, expected_t));
        EXPECT_TRUE(at::equal(s, expected_s));
        EXPECT_TRUE(at::equal(o, at::arange(3, 6, at::kLong)));
        EXPECT_TRUE(s_base.slice(0, 0, 20, 2).eq(0).all().item<bool>());  // untouched
      }
    }
  });
}

// Validation needs no peer: every error is raised before any message is posted.
TEST(DistP2PValidation, PeerArguments) {
  auto dir = std::filesystem::temp_directory_path() / "td-validate-XXXXXX";
  std::string path = dir.string();
  ASSERT_NE(mkdtemp(path.data()), nullptr);
  auto solo = make_gloo_backend(c10::make_intrusive<c10d::FileStore>(path + "/store", 1), 0, 1,
                                std::chrono::seconds(10), "127.0.0.1");
  TensorDict td = sample(1.0);
  const std::vector<std::pair<
      std::string, std::function<void(std::optional<int64_t>, Group, std::optional<int64_t>)>>>
      senders = {
          {"send", [&](auto p, Group g, auto gp) { send(td, p, {.group = g, .group_dst = gp}); }},
          {"isend", [&](auto p, Group g, auto gp) { isend(td, p, {.group = g, .group_dst = gp}); }},
          {"isend_early",
           [&](auto p, Group g, auto gp) { isend_early(td, p, {.group = g, .group_dst = gp}); }}};
  const std::vector<std::pair<
      std::string, std::function<void(std::optional<int64_t>, Group, std::optional<int64_t>)>>>
      receivers = {
          {"recv", [&](auto p, Group g, auto gp) { recv(td, p, {.group = g, .group_src = gp}); }},
          {"irecv", [&](auto p, Group g, auto gp) { irecv(td, p, {.group = g, .group_src = gp}); }},
          {"irecv_premature", [&](auto p, Group g, auto gp) {
             irecv_premature(td, p, {.group = g, .group_src = gp});
           }}};
  for (const auto& [names, calls] : {std::pair{std::pair{"dst", "group_dst"}, senders},
                                     std::pair{std::pair{"src", "group_src"}, receivers}}) {
    const std::string peer = names.first;
    const std::string group_peer = names.second;
    for (const auto& [name, call] : calls) {
      SCOPED_TRACE(name);
      // No process group exists in this process at all.
      EXPECT_EQ(error_of([&] { call(std::nullopt, {}, 0); }),
                "`" + group_peer + "` requires `group` to be passed.");
      EXPECT_EQ(error_of([&] { call(0, solo, 0); }),
                "`" + peer + "` and `" + group_peer + "` are mutually exclusive.");
      EXPECT_EQ(error_of([&] { call(std::nullopt, solo, std::nullopt); }),
                "Exactly one of `" + peer + "` and `" + group_peer + "` must be provided.");
      EXPECT_EQ(error_of([&] { call(std::nullopt, {}, std::nullopt); }),
                "Exactly one of `" + peer + "` and `" + group_peer + "` must be provided.");
      EXPECT_THROW(call(std::nullopt, {}, 0), c10::ValueError);
      // A global rank with no default group: torch's text.
      EXPECT_EQ(error_of([&] { call(1, {}, std::nullopt); }),
                "Default process group has not been initialized, please make sure to call "
                "init_process_group.");
      EXPECT_NE(error_of([&] { call(std::nullopt, solo, 3); }).find("is not a rank of the group"),
                std::string::npos);
    }
  }
  std::filesystem::remove_all(path);
}

TEST(DistP2PValidation, TagsAndConsolidation) {
  auto dir = std::filesystem::temp_directory_path() / "td-validate-XXXXXX";
  std::string path = dir.string();
  ASSERT_NE(mkdtemp(path.data()), nullptr);
  Group solo = make_gloo_backend(c10::make_intrusive<c10d::FileStore>(path + "/store", 1), 0, 1,
                                 std::chrono::seconds(10), "127.0.0.1");
  TensorDict td = sample(1.0);  // 4 leaves
  EXPECT_EQ(error_of([&] { send(td, {}, {.group = solo, .group_dst = 0, .init_tag = -1}); }),
            "send: init_tag must be non-negative, got -1");
  EXPECT_THROW(recv(td, {}, {.group = solo, .group_src = 0, .init_tag = -3, .pseudo_rand = true}),
               c10::ValueError);
  EXPECT_THROW(irecv_premature(td, {}, {.group = solo, .group_src = 0, .init_tag = -3}),
               c10::ValueError);
  const int64_t max = std::numeric_limits<int32_t>::max();
  EXPECT_EQ(error_of([&] { isend(td, {}, {.group = solo, .group_dst = 0, .init_tag = max - 2}); }),
            "isend: init_tag 2147483645 and 4 leaves give a last tag of 2147483645 + 3, above "
            "the largest c10d tag (2147483647)");
  EXPECT_THROW(irecv(td, {}, {.group = solo, .group_src = 0, .init_tag = int64_t{1} << 40}),
               c10::ValueError);
  const std::string msg =
      error_of([&] { recv(td, {}, {.group = solo, .group_src = 0, .consolidated = true}); });
  EXPECT_EQ(msg,
            "recv(consolidated=True): the TensorDict is not consolidated. Receive into a "
            "consolidated TensorDict with the sender's layout (consolidate() it first)");
  TensorDict expanded({{"e", at::zeros({1, 3}).expand({2, 3})}}, {2});
  EXPECT_NE(error_of([&] {
              recv(expanded, {}, {.group = solo, .group_src = 0});
            }).find("cannot receive into a leaf whose elements share memory"),
            std::string::npos);
  std::filesystem::remove_all(path);
}

// The largest tags that fit in int32 go through; a blocking send to oneself is refused.
TEST(DistP2PValidation, Int32BoundaryAndSelf) {
  run_ranks(2, [](int rank, int) {
    const int64_t max = std::numeric_limits<int32_t>::max();
    if (rank == 0) {
      send(sample(3.0), 1, {.init_tag = max - 3});
      EXPECT_EQ(error_of([] { send(sample(1.0), 0); }),
                "Invalid destination rank: destination rank should not be the same as the rank "
                "of the current process.");
      EXPECT_NE(error_of([] { send(sample(1.0), 2); }).find("dst = 2 is not a rank of the group"),
                std::string::npos);
    } else {
      TensorDict td = sample(0.0, true);
      EXPECT_EQ(recv(td, 0, {.init_tag = max - 3}), max);
      expect_values(td, 3.0);
    }
  });
}

}  // namespace
}  // namespace tensordict::dist

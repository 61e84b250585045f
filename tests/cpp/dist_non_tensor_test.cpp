// Non-tensor entries over Gloo, on real processes (127.0.0.1, FileStore rendezvous): per-leaf
// transfers and reductions skip them without consuming a tag (the receiver keeps its own);
// init_remote, broadcast, all_gather and scatter deliver them through the metadata; a peer's
// malformed non-tensor entries are refused with a ValueError.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cmath>
#include <cstring>

#include "dist_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/collectives.h"
#include "tensordict/distributed/init_remote.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/tags.h"
#include "wire/leaf_order.h"
#include "wire/metadata_pickle.h"
#include "wire/pickle.h"

namespace tensordict::dist {
namespace {

using namespace ::tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

using testing::bytes_of;
using testing::error_of;
using testing::run_ranks;

// Four leaves in wire order _, a/a2, a/b, c (leaf i holds base + i), with non-tensor entries
// sorting before, between and after them at every level: "0", "a0" < "a2" < "a5" < "b", "bb",
// "d". The data says which side built it.
TensorDict sample(double base, const std::string& who) {
  auto leaf = [&](int i, at::IntArrayRef shape) { return at::full(shape, base + i); };
  TensorDict inner({{"b", leaf(2, {2})}, {"a2", leaf(1, {2, 2})}}, {2});
  inner.set_non_tensor("a0", who + "/a0");
  inner.set_non_tensor("a5", JsonValue::map({{"who", who}, {"n", JsonValue::list({1, 2.5})}}));
  TensorDict td({{"c", leaf(3, {2, 3})}, {"a", inner}, {"_", leaf(0, {2, 1, 5})}}, {2});
  td.set_non_tensor("0", who);
  td.set_non_tensor("bb", nullptr);
  td.set_non_tensor({"d", "deep"}, who + "/d");  // a level holding only a non-tensor entry
  return td;
}

void expect_leaves(const TensorDict& td, double base) {
  const auto order = wire::leaves_in_order(td);
  ASSERT_EQ(order.size(), 4u);  // the non-tensor entries are not leaves
  const std::vector<std::vector<std::string>> want = {{"_"}, {"a", "a2"}, {"a", "b"}, {"c"}};
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(order[i].first, want[i]);
    EXPECT_TRUE(order[i].second.eq(base + static_cast<double>(i)).all().item<bool>()) << i;
  }
}

void expect_non_tensors(const TensorDict& td, const std::string& who) {
  EXPECT_EQ(td.get_non_tensor("0"), JsonValue(who));
  EXPECT_EQ(td.get_non_tensor({"a", "a0"}), JsonValue(who + "/a0"));
  EXPECT_EQ(td.get_non_tensor({"a", "a5"}).at("who"), JsonValue(who));
  EXPECT_EQ(td.get_non_tensor({"a", "a5"}).at("n"), JsonValue::list({1, 2.5}));
  EXPECT_TRUE(td.get_non_tensor("bb").is_null());
  EXPECT_EQ(td.get_non_tensor({"d", "deep"}), JsonValue(who + "/d"));
  EXPECT_EQ(td.get({"a", "a0"}).non_tensor().batch_size(), at::IntArrayRef({2}));
}

int64_t last_tag(int64_t init_tag, int leaves, bool pseudo_rand) {
  int64_t tag = init_tag - 1;
  for (int i = 0; i < leaves; ++i) tag = next_tag(tag, pseudo_rand);
  return tag;
}

TEST(DistNonTensor, PerLeafTransfersSkipThemWithoutATag) {
  run_ranks(2, [](int rank, int) {
    int round = 0;
    for (bool checked : {false, true}) {
      for (bool pseudo_rand : {false, true}) {
        for (int flavour = 0; flavour < 2; ++flavour) {  // send/recv, isend/irecv
          SCOPED_TRACE(
              c10::str("checked ", checked, ", pseudo_rand ", pseudo_rand, ", flavour ", flavour));
          const double base = 10.0 * ++round;
          const int64_t init_tag = 7;
          if (rank == 0) {
            const TensorDict td = sample(base, "sender");
            const SendOptions o{
                .init_tag = init_tag, .pseudo_rand = pseudo_rand, .checked = checked};
            if (flavour == 0) {
              send(td, 1, o);
            } else {
              EXPECT_EQ(isend(td, 1, o), last_tag(init_tag, 4, pseudo_rand));
            }
          } else {
            // The receiver's non-tensor entries differ and stay its own, as in the reference.
            const TensorDict td = sample(0.0, "receiver");
            const RecvOptions o{
                .init_tag = init_tag, .pseudo_rand = pseudo_rand, .checked = checked};
            if (flavour == 0) {
              const auto tag = recv(td, 0, o);
              if (!checked) {
                EXPECT_EQ(tag, last_tag(init_tag, 4, pseudo_rand));
              }
            } else {
              irecv(td, 0, o);
            }
            expect_leaves(td, base);
            expect_non_tensors(td, "receiver");
          }
        }
      }
    }
  });
}

// The tags a plain c10d peer sees: one per tensor leaf, init_tag + i in wire order.
TEST(DistNonTensor, RawPeerSeesOneTagPerTensor) {
  run_ranks(2, [](int rank, int) {
    auto pg = default_group();
    if (rank == 0) {
      send(sample(1.0, "sender"), 1, {.init_tag = 20});
    } else {
      const std::vector<std::pair<int, std::vector<int64_t>>> expected = {
          {20, {2, 1, 5}}, {21, {2, 2}}, {22, {2}}, {23, {2, 3}}};  // "_", a/a2, a/b, c
      for (size_t i = 0; i < expected.size(); ++i) {
        std::vector<at::Tensor> buf{at::zeros(expected[i].second)};
        pg->recv(buf, 0, expected[i].first)->wait();
        EXPECT_TRUE(buf[0].eq(1.0 + double(i)).all().item<bool>()) << "tag " << expected[i].first;
      }
    }
  });
}

TEST(DistNonTensor, ReductionsSkipThem) {
  run_ranks(2, [](int rank, int) {
    const std::string who = c10::str("rank", rank);
    // Leaf i holds (1 + i) on rank 0 and (2 + i) on rank 1: the sum is 3 + 2i.
    auto expect_sums = [](const TensorDict& td) {
      const auto order = wire::leaves_in_order(td);
      ASSERT_EQ(order.size(), 4u);
      for (size_t i = 0; i < order.size(); ++i) {
        EXPECT_TRUE(order[i].second.eq(3.0 + 2.0 * double(i)).all().item<bool>()) << i;
      }
    };
    TensorDict td = sample(rank + 1.0, who);
    all_reduce(td);
    expect_sums(td);
    expect_non_tensors(td, who);
    TensorDict r = sample(rank + 1.0, who);
    reduce(r, 0);
    if (rank == 0) expect_sums(r);
    expect_non_tensors(r, who);
  });
}

TEST(DistNonTensor, InitRemoteDeliversThem) {
  run_ranks(2, [](int rank, int) {
    for (bool use_broadcast : {false, true}) {
      SCOPED_TRACE(use_broadcast);
      if (rank == 0) {
        const TensorDict td = consolidate(sample(1.0, "sender"));
        const TensorDict sent = init_remote(td, 1, {.use_broadcast = use_broadcast});
        EXPECT_TRUE(sent.is_same(td));
        // Tensors in place; equal non-tensor entries are left alone (the TensorDict is locked).
        TensorDict(sent).update(sample(5.0, "sender"), {.inplace = true});
        EXPECT_TRUE(is_consolidated(sent));
        send(sent, 1, {.consolidated = true});
      } else {
        const TensorDict got = from_remote_init(0, {.use_broadcast = use_broadcast});
        EXPECT_TRUE(is_consolidated(got));
        expect_leaves(got, 1.0);
        expect_non_tensors(got, "sender");
        // The rebuild's order: non-tensor entries, leaves, nested levels (the reference's).
        EXPECT_EQ(got.entries()[0].first, "0");
        EXPECT_EQ(got.entries()[1].first, "bb");
        recv(got, 0, {.consolidated = true});
        expect_leaves(got, 5.0);
        expect_non_tensors(got, "sender");
      }
    }
  });
}

TEST(DistNonTensor, CollectivesDeliverThem) {
  run_ranks(3, [](int rank, int) {
    const std::string who = c10::str("rank", rank);
    {
      const TensorDict got = broadcast(rank == 1 ? sample(1.0, who) : TensorDict(), 1);
      expect_leaves(got, 1.0);
      expect_non_tensors(got, "rank1");
    }
    {
      const auto all = all_gather(sample(10.0 * rank, who));
      ASSERT_EQ(all.size(), 3u);
      for (int r = 0; r < 3; ++r) {
        expect_leaves(all[r], 10.0 * r);
        expect_non_tensors(all[r], c10::str("rank", r));
      }
    }
    {
      std::vector<TensorDict> tds;
      if (rank == 2) {
        for (int r = 0; r < 3; ++r) tds.push_back(sample(100.0 + r, c10::str("for", r)));
      }
      const TensorDict got = scatter(2, tds);
      expect_leaves(got, 100.0 + rank);
      expect_non_tensors(got, c10::str("for", rank));
    }
  });
}

// A sender whose metadata pickle holds the non-tensor entry `entry` at the root.
struct Bad {
  const char* name;
  pickle::Value entry;
  const char* error;
};

TEST(DistNonTensor, MalformedEntriesFromAPeerAreRefused) {
  using pickle::Value;
  auto ints = [](std::vector<int64_t> v) {
    std::vector<Value> items;
    for (int64_t i : v) items.push_back(Value::from_int(i));
    return Value::list(std::move(items));
  };
  Value deep = Value::list();
  for (int i = 0; i < 200; ++i) deep = Value::list({deep});
  const std::vector<Bad> cases = {
      {"bad_batch", Value::tuple({Value::from_str("x"), ints({3}), Value()}),
       "does not start with the batch size [2]"},
      {"negative_batch", Value::tuple({Value::from_str("x"), ints({2, -1}), Value()}),
       "negative dim"},
      {"batch_not_ints", Value::tuple({Value::from_str("x"), Value::from_str("2"), Value()}),
       "must be a list of integers"},
      {"device_not_str", Value::tuple({Value::from_str("x"), ints({2}), Value::from_int(3)}),
       "must be a string or null"},
      {"bad_device", Value::tuple({Value::from_str("x"), ints({2}), Value::from_str("gpu:x")}),
       "not a device name"},
      {"too_short", Value::tuple({Value::from_str("x")}), "must be [data, batch_size, device]"},
      {"not_a_tuple", Value::from_int(1), "must be [data, batch_size, device]"},
      {"too_deep", Value::tuple({deep, ints({2}), Value()}), "nesting deeper than"},
  };
  run_ranks(2,
            [&](int rank, int) {
              auto store = c10::make_intrusive<c10d::FileStore>(run_scratch_dir() + "/bad_nt", 2);
              static auto* keep = new std::vector<BackendPtr>();
              const TensorDict td = sample(1.0, "sender");
              const int64_t total = consolidated_storage(consolidate(td)).numel();
              for (const auto& c : cases) {
                SCOPED_TRACE(c.name);
                auto group =
                    make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>(c.name, store), rank,
                                      2, std::chrono::seconds(5), "127.0.0.1");
                keep->push_back(group);
                if (rank == 0) {
                  Value meta = metadata_to_pickle(metadata_of(td), {{"_total_bytes", total}});
                  Value non_tensors = *meta.find("non_tensors");
                  non_tensors.set("0", c.entry);
                  meta.set("non_tensors", std::move(non_tensors));
                  const std::string bytes = pickle::dumps(meta);
                  std::vector<std::vector<at::Tensor>> messages = {
                      {at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong)},
                      {bytes_of(bytes)},
                      {at::zeros({total}, at::kByte)}};
                  try {
                    for (auto& m : messages) group->send(m, 1, 0)->wait();
                  } catch (const std::exception&) {  // a receiver that refuses before the storage
                  }
                } else {
                  const std::string error =
                      error_of([&] { from_remote_init({}, {.group = group, .group_src = 0}); });
                  EXPECT_NE(error.find(c.error), std::string::npos) << error;
                  EXPECT_NE(error.find("from_remote_init: "), std::string::npos) << error;
                }
              }
            },
            {.watchdog = std::chrono::seconds(120)});
}

}  // namespace
}  // namespace tensordict::dist

// init_remote / from_remote_init and the collectives over Gloo, on real processes
// (127.0.0.1, FileStore rendezvous), including peers that send malformed framing by hand.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cstring>

#include "dist_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/collectives.h"
#include "tensordict/distributed/init_remote.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/params.h"
#include "wire/metadata_pickle.h"
#include "wire/pickle.h"

namespace tensordict::dist {
namespace {

using namespace ::tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

using testing::bytes_of;
using testing::error_of;
using testing::run_ranks;

// A nested TensorDict whose schema depends on `variant` (extra leaves of growing shapes), so
// that ranks can hold different structures; every leaf is `fill`.
TensorDict sample(double fill, int variant = 0) {
  TensorDict inner(
      {{"z", at::full({3, 2}, fill, at::kLong)}, {"y", at::full({3}, fill, at::kHalf)}}, {3});
  std::vector<TensorDict::Entry> entries = {{"b", at::full({3, 4}, fill)},
                                            {"a", at::full({3}, fill, at::kDouble)},
                                            {"n", inner},
                                            {"_", at::full({3}, fill != 0, at::kBool)}};
  for (int i = 0; i < variant; ++i) {
    entries.emplace_back(c10::str("extra", i), at::full({3, i + 1}, fill + i, at::kInt));
  }
  return TensorDict(entries, {3});
}

// Same leaf keys, dtypes, shapes and values. (A rebuilt level lists its leaves before its
// nested levels, as the metadata does, so the insertion order may differ from the sender's.)
void expect_same(const TensorDict& got, const TensorDict& want) {
  const auto g = got.items({.include_nested = true, .leaves_only = true});
  const auto w = want.items({.include_nested = true, .leaves_only = true});
  ASSERT_EQ(g.size(), w.size());
  for (const auto& [key, value] : w) {
    ASSERT_TRUE(got.contains(key)) << key.parts().back();
    const at::Tensor leaf = got.get(key).tensor();
    EXPECT_TRUE(leaf.dtype() == value.tensor().dtype() && at::equal(leaf, value.tensor()))
        << key.parts().back();
  }
  EXPECT_EQ(got.batch_size(), want.batch_size());
}

std::string metadata_text(const TensorDict& td) {
  return metadata_to_json(*consolidated_metadata(td));
}

TEST(DistCollectives, InitRemoteThenSteadyState) {
  run_ranks(2, [](int rank, int) {
    // The default group by global rank, then a subgroup by group rank, then broadcast mode.
    auto sub = new_group({0, 1});
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(c10::str("mode ", mode));
      if (rank == 0) {
        TensorDict td = consolidate(sample(1.0, 2));
        const auto before = consolidated_metadata(td);
        const std::string text = metadata_text(td);
        TensorDict sent = mode == 0   ? init_remote(td, 1)
                          : mode == 1 ? init_remote(td, {}, {.group = sub, .group_dst = 1})
                                      : init_remote(td, 5, {.use_broadcast = true});
        // The caller's TensorDict is sent as is, and its metadata stays untouched.
        EXPECT_TRUE(sent.is_same(td));
        EXPECT_EQ(consolidated_metadata(td), before);
        EXPECT_EQ(metadata_text(td), text);
        const void* storage = consolidated_storage(sent).data_ptr();
        for (int step = 2; step < 6; ++step) {
          sent.update(sample(step, 2), {.inplace = true});  // writes into the storage
          send(sent, 1, {.consolidated = true});
          EXPECT_EQ(consolidated_storage(sent).data_ptr(), storage);
        }
      } else {
        TensorDict got = mode == 0   ? from_remote_init(0)
                         : mode == 1 ? from_remote_init({}, {.group = sub, .group_src = 0})
                                     : from_remote_init(0, {.use_broadcast = true});
        EXPECT_TRUE(is_consolidated(got));
        expect_same(got, sample(1.0, 2));
        // Later values land in the same storage: nothing is allocated.
        const void* storage = consolidated_storage(got).data_ptr();
        for (int step = 2; step < 6; ++step) {
          recv(got, 0, {.consolidated = true});
          EXPECT_EQ(consolidated_storage(got).data_ptr(), storage);
          expect_same(got, sample(step, 2));
        }
      }
    }
    // A TensorDict that is not consolidated is consolidated (copied) first, and an empty one
    // still sends its three messages.
    if (rank == 0) {
      TensorDict td = sample(7.0);
      EXPECT_FALSE(init_remote(td, 1).is_same(td));
      EXPECT_FALSE(is_consolidated(td));
      init_remote(TensorDict(), 1);
      EXPECT_NE(error_of([] { init_remote(sample(0.0), 0); }).find("should not be the same"),
                std::string::npos);
    } else {
      expect_same(from_remote_init(0), sample(7.0));
      EXPECT_TRUE(from_remote_init(0).entries().empty());
    }
  });
}

// A tensorclass's name travels as "_tensorclass_type" with init_remote (both modes) and
// broadcast, and comes back to the receiver as a plain string; without one, nullopt.
TEST(DistCollectives, TensorclassTypeTravelsWithInitRemoteAndBroadcast) {
  run_ranks(2, [](int rank, int) {
    const std::string name = "my.module.MyData";
    for (int mode = 0; mode < 4; ++mode) {
      SCOPED_TRACE(c10::str("mode ", mode));
      const bool named = mode != 3;
      const std::optional<std::string> sent_type =
          named ? std::optional<std::string>(name) : std::nullopt;
      std::optional<std::string> got_type = "stale";
      if (rank == 0) {
        if (mode == 0 || mode == 3) init_remote(sample(1.0), 1, {.tensorclass_type = sent_type});
        if (mode == 1)
          init_remote(sample(1.0), {}, {.use_broadcast = true, .tensorclass_type = name});
        if (mode == 2) {
          broadcast(sample(1.0), 0, {.tensorclass_type = name}, &got_type);
          EXPECT_EQ(got_type, name);  // the source reports what it sent
        }
      } else {
        TensorDict got = mode == 0 || mode == 3 ? from_remote_init(0, {}, &got_type)
                         : mode == 1 ? from_remote_init(0, {.use_broadcast = true}, &got_type)
                                     : broadcast(TensorDict(), 0, {}, &got_type);
        EXPECT_EQ(got_type, sent_type);
        expect_same(got, sample(1.0));
      }
    }
  });
}

// World of 3 with non-zero roots, on the default group and on new_group({1, 2}), where global
// rank 1 is group rank 0 and global rank 2 is group rank 1.
TEST(DistCollectives, BroadcastScatterAllGatherThreeRanks) {
  run_ranks(3, [](int rank, int) {
    auto sub = new_group({1, 2});
    // broadcast from global rank 2; receivers pass an empty TensorDict.
    {
      TensorDict mine = rank == 2 ? consolidate(sample(2.0, 1)) : TensorDict();
      const std::string text = rank == 2 ? metadata_text(mine) : "";
      TensorDict got = broadcast(mine, 2);
      EXPECT_TRUE(is_consolidated(got));
      expect_same(got, sample(2.0, 1));
      if (rank == 2) {
        EXPECT_TRUE(got.is_same(mine));
        EXPECT_EQ(metadata_text(mine), text);
      }
    }
    // init_remote(use_broadcast) from rank 1 reaches both other ranks.
    if (rank == 1) {
      init_remote(sample(9.0), std::nullopt, {.use_broadcast = true});
    } else {
      expect_same(from_remote_init(1, {.use_broadcast = true}), sample(9.0));
    }
    // scatter from global rank 1: rank r gets a TensorDict of schema variant r.
    {
      std::vector<TensorDict> tds;
      if (rank == 1) {
        for (int r = 0; r < 3; ++r) tds.push_back(sample(10.0 + r, r));
      }
      TensorDict got = scatter(1, tds);
      EXPECT_TRUE(is_consolidated(got));
      expect_same(got, sample(10.0 + rank, rank));
    }
    // all_gather: every rank holds a different schema.
    {
      TensorDict mine = consolidate(sample(20.0 + rank, 2 - rank));
      const std::string text = metadata_text(mine);
      auto all = all_gather(mine);
      ASSERT_EQ(all.size(), 3u);
      for (int r = 0; r < 3; ++r) {
        EXPECT_TRUE(is_consolidated(all[r]));
        expect_same(all[r], sample(20.0 + r, 2 - r));
      }
      EXPECT_EQ(metadata_text(mine), text);
    }
    if (rank == 0) return;  // not in `sub`
    // On the subgroup: src/dst are global ranks, mapped to group ranks.
    TensorDict b = broadcast(rank == 2 ? sample(30.0) : TensorDict(), 2, {.group = sub});
    expect_same(b, sample(30.0));
    b = broadcast(rank == 1 ? sample(31.0) : TensorDict(), {}, {.group = sub, .group_src = 0});
    expect_same(b, sample(31.0));
    std::vector<TensorDict> tds;
    if (rank == 2) tds = {sample(40.0, 0), sample(41.0, 3)};
    expect_same(scatter(2, tds, {.group = sub}), rank == 1 ? sample(40.0, 0) : sample(41.0, 3));
    auto all = all_gather(sample(50.0 + rank, rank), {.group = sub});
    ASSERT_EQ(all.size(), 2u);
    expect_same(all[0], sample(51.0, 1));
    expect_same(all[1], sample(52.0, 2));
    if (rank == 2) {
      init_remote(sample(60.0), 1, {.group = sub});
    } else {
      expect_same(from_remote_init(2, {.group = sub}), sample(60.0));
    }
    // A global rank outside the group is refused before anything is sent.
    EXPECT_NE(
        error_of([&] { broadcast(sample(0.0), 0, {.group = sub}); }).find("is not part of group"),
        std::string::npos);
  });
}

// Leaf values per rank: rank r holds r + 2 everywhere, so SUM, PRODUCT and MAX differ.
TensorDict reducible(int rank, bool reversed = false) {
  auto v = [&](at::IntArrayRef shape, at::ScalarType t) { return at::full(shape, rank + 2.0, t); };
  TensorDict inner({{"q", v({2, 2}, at::kDouble)}, {"p", v({2}, at::kLong)}}, {2});
  // A non-contiguous leaf: reduced through a contiguous copy.
  at::Tensor t = v({3, 2}, at::kFloat).t();
  if (reversed) {
    return TensorDict({{"t", t}, {"n", inner}, {"a", v({2}, at::kFloat)}}, {2});
  }
  return TensorDict({{"a", v({2}, at::kFloat)}, {"n", inner}, {"t", t}}, {2});
}

void expect_all(const TensorDict& td, double value) {
  for (const auto& [key, leaf] : td.items({.include_nested = true, .leaves_only = true})) {
    EXPECT_TRUE(leaf.tensor().eq(value).all().item<bool>())
        << key.parts().back() << " holds " << leaf.tensor().flatten()[0].item<double>()
        << ", expected " << value;
  }
}

// gather_and_stack on 3 ranks, each rank the destination once: the others' TensorDicts land
// in its rows, in rank order; headers a peer forges are refused on every rank alike.
TEST(DistCollectives, GatherAndStackThreeRanks) {
  run_ranks(3, [](int rank, int) {
    for (int dst = 0; dst < 3; ++dst) {
      if (rank == dst) {
        TensorDict rows = stack(std::vector<TensorDict>{sample(0.0), sample(0.0)}, 0);
        const at::Tensor b = rows.get("b").tensor();
        auto out = gather_and_stack(rows, dst);
        ASSERT_TRUE(out.has_value());
        EXPECT_TRUE(out->is_same(rows));
        EXPECT_TRUE(rows.get("b").tensor().is_same(b));  // written in place
        int row = 0;
        for (int r = 0; r < 3; ++r) {
          if (r == dst) continue;
          EXPECT_TRUE(rows.get({"n", "z"}).tensor()[row].eq(10 + r).all().item<bool>()) << r;
          EXPECT_TRUE(rows.get("b").tensor()[row].eq(10 + r).all().item<bool>()) << r;
          ++row;
        }
      } else {
        EXPECT_FALSE(gather_and_stack(sample(10.0 + rank), dst).has_value());
      }
    }
    // A destination whose rows do not fit: a named ValueError there, the others complete.
    if (rank == 0) {
      TensorDict wrong = stack(std::vector<TensorDict>{sample(0.0, 1), sample(0.0, 1)}, 0);
      wrong.set("b", at::zeros({2, 3, 5}));
      EXPECT_NE(error_of([&] { gather_and_stack(wrong, 0); }).find("'b'"), std::string::npos);
    } else {
      gather_and_stack(sample(1.0), 0);
    }
    // A rank announcing a storage above the bound: every rank refuses before the gather.
    auto pg = default_group();
    const int64_t forged = rank == 2 ? int64_t{1} << 40 : 0;
    if (rank == 2) {
      std::vector<at::Tensor> header{at::tensor({int64_t{2}, forged, forged + 10}, at::kLong)};
      std::vector<std::vector<at::Tensor>> headers(1);
      for (int r = 0; r < 3; ++r) headers[0].push_back(at::empty({3}, at::kLong));
      pg->allgather(headers, header)->wait();
    } else {
      const std::string err = error_of([&] {
        gather_and_stack(
            rank == 0 ? stack(std::vector<TensorDict>{sample(0.0), sample(0.0)}, 0) : sample(1.0),
            0, {.max_total_bytes = int64_t{1} << 30});
      });
      EXPECT_NE(err.find("gather_and_stack (from group rank 2): a storage of 1099511627776 bytes"),
                std::string::npos)
          << err;
    }
    // All three stayed in step: the next gather works.
    TensorDict rows = stack(std::vector<TensorDict>{sample(0.0), sample(0.0)}, 0);
    gather_and_stack(rank == 1 ? rows : sample(5.0 + rank), 1);
    if (rank == 1) {
      EXPECT_TRUE(rows.get("a").tensor()[1].eq(7.0).all().item<bool>());
    }
  });
}

TEST(DistCollectives, AllReduceAndReduceThreeRanks) {
  run_ranks(3, [](int rank, int) {
    auto sub = new_group({1, 2});
    const std::vector<std::pair<c10d::ReduceOp, double>> ops = {
        {c10d::ReduceOp::SUM, 2 + 3 + 4},
        {c10d::ReduceOp::PRODUCT, 2 * 3 * 4},
        {c10d::ReduceOp::MAX, 4},
        {c10d::ReduceOp::MIN, 2}};
    for (const auto& [op, want] : ops) {
      for (bool async_op : {false, true}) {
        TensorDict td = reducible(rank);
        all_reduce(td, {.op = op, .async_op = async_op});
        expect_all(td, want);
      }
      TensorDict td = reducible(rank);
      for (const auto& w : all_reduce_async(td, {.op = op})) w->wait();
      expect_all(td, want);
      // reduce to global rank 2, keys walked in sorted order: insertion order may differ.
      for (int flavour = 0; flavour < 3; ++flavour) {
        TensorDict r = reducible(rank, /*reversed=*/rank == 1);
        if (flavour == 2) {
          for (const auto& w : reduce_premature(r, 2, {.op = op})) w->wait();
        } else {
          reduce(r, 2, {.op = op, .async_op = flavour == 1});
        }
        if (rank == 2) expect_all(r, want);
      }
    }
    EXPECT_NE(error_of([&] {
                all_reduce(TensorDict({{"e", at::ones({1}).expand({4})}}, {}));
              }).find("share memory"),
              std::string::npos);
    if (rank == 0) return;
    // On the subgroup, nested leaves included (the reference drops `group` below the root,
    // which would hang here: rank 0 takes no part).
    TensorDict td = reducible(rank);
    all_reduce(td, {.op = c10d::ReduceOp::PRODUCT, .group = sub});
    expect_all(td, 3 * 4);
    TensorDict r = reducible(rank, rank == 2);
    reduce(r, 1, {.op = c10d::ReduceOp::SUM, .group = sub});
    if (rank == 1) expect_all(r, 3 + 4);
    r = reducible(rank);
    reduce(r, {}, {.op = c10d::ReduceOp::MAX, .group = sub, .group_dst = 1});
    if (rank == 2) expect_all(r, 4);
  });
}

// ---- malformed input from a raw peer ----

std::string metadata_pickle_of(const TensorDict& td, const TransportFields& fields) {
  return pickle::dumps(metadata_to_pickle(metadata_of(td), fields));
}

struct Case {
  const char* name;
  int64_t announced;      // the pickle length sent in the first message
  std::string pickle;     // the second message
  int64_t storage;        // bytes of the third message (-1: none)
  bool sender_completes;  // the receiver takes the storage before refusing
  const char* error;      // substring of the receiver's error
  std::optional<int64_t> max_total_bytes{};
};

std::vector<Case> malformed_cases() {
  const TensorDict td = sample(1.0);  // lays out 24 + 96 + 48 + 8 + ... bytes
  const int64_t total = consolidated_storage(consolidate(td)).numel();
  const std::string good = metadata_pickle_of(td, {{"_total_bytes", total}});
  // pickle.dumps(os.system("ls")) style: GLOBAL names a callable (read inertly), REDUCE calls it.
  static const char kGlobal[] =
      "\x80\x02"
      "cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.";
  const std::string global(kGlobal, sizeof(kGlobal) - 1);
  return {
      {"truncated", int64_t(good.size() / 2), good.substr(0, good.size() / 2), total, false,
       "the metadata from the sender is refused: pickle:"},
      {"shorter_than_announced", int64_t(good.size()), good.substr(0, good.size() - 9), total,
       false, "bytes and sent fewer"},
      {"longer_than_announced", int64_t(good.size() - 9), good, total, false,
       "bytes and sent more"},
      {"oversized_length", int64_t{1} << 40, "x", -1, false, "a metadata pickle must have 1 to"},
      {"negative_length", -5, "x", -1, false, "a metadata pickle must have 1 to"},
      {"global_opcode", int64_t(global.size()), global, total, false,
       "refused opcode REDUCE: it would import or call code"},
      {"layout_beyond_total_bytes", 0, metadata_pickle_of(td, {{"_total_bytes", 16}}), 16, true,
       "but \"_total_bytes\" is 16"},
      {"total_bytes_above_bound", 0, good, total, false, "this receiver accepts 0 to 64",
       /*max_total_bytes=*/64},
      {"no_total_bytes", 0, metadata_pickle_of(td, {}), total, false,
       "the metadata has no integer \"_total_bytes\""},
      {"tensorclass_type_not_a_string", 0,
       metadata_pickle_of(td, {{"_total_bytes", total}, {"_tensorclass_type", int64_t{7}}}), total,
       true, "\"_tensorclass_type\" is not a string of 1 to 4096 bytes"},
      {"tensorclass_type_too_long", 0,
       metadata_pickle_of(td,
                          {{"_total_bytes", total}, {"_tensorclass_type", std::string(5000, 'm')}}),
       total, true, "\"_tensorclass_type\" is not a string"},
      {"bad_leaf_salvaged", 0, pickle::dumps([&] {
         auto v = metadata_to_pickle(metadata_of(td), {{"_total_bytes", total}});
         pickle::Value leaves = *v.find("leaves");
         leaves.set("b", pickle::Value::from_str("x"));  // a leaf entry must be a tuple
         v.set("leaves", std::move(leaves));
         return v;
       }()),
       total, true, "the metadata from the sender is refused"},
  };
}

// The receiver refuses each case with a clear error; the raw sender either completes (the
// receiver drained the storage) or fails at its 3 s timeout, never later.
TEST(DistCollectives, MalformedInputIsRefused) {
  run_ranks(
      2,
      [](int rank, int) {
        auto store = c10::make_intrusive<c10d::FileStore>(run_scratch_dir() + "/malformed", 2);
        // Groups stay alive to the end: one that timed out may still hold a pending message.
        static auto* keep = new std::vector<BackendPtr>();
        for (auto& c : malformed_cases()) {
          SCOPED_TRACE(c.name);
          auto group = make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>(c.name, store),
                                         rank, 2, std::chrono::seconds(3), "127.0.0.1");
          keep->push_back(group);
          if (rank == 0) {
            const int64_t announced = c.announced ? c.announced : int64_t(c.pickle.size());
            std::vector<std::vector<at::Tensor>> messages = {{at::full({1}, announced, at::kLong)},
                                                             {bytes_of(c.pickle)}};
            if (c.storage >= 0) messages.push_back({at::zeros({c.storage}, at::kByte)});
            const auto start = std::chrono::steady_clock::now();
            std::string error;
            try {
              for (auto& m : messages) group->send(m, 1, 0)->wait();
            } catch (const std::exception& e) {  // Gloo's timeout is not a c10::Error
              error = e.what();
            }
            const auto seconds =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            EXPECT_LT(seconds, 10.0);
            if (c.sender_completes) {
              EXPECT_EQ(error, "");
            } else {
              EXPECT_NE(error, "");  // the group's timeout, not a hang
            }
          } else {
            const std::string error = error_of([&] {
              from_remote_init(
                  {}, {.group = group, .group_src = 0, .max_total_bytes = c.max_total_bytes});
            });
            EXPECT_NE(error.find(c.error), std::string::npos) << error;
            EXPECT_EQ(error.rfind("from_remote_init: ", 0), 0u) << error;
          }
        }
      },
      {.watchdog = std::chrono::seconds(90)});
}

TEST(DistCollectives, ArgumentErrors) {
  run_ranks(2, [](int rank, int) {
    EXPECT_EQ(error_of([] { broadcast(sample(0.0), std::nullopt); }),
              "Exactly one of `src` and `group_src` must be provided.");
    EXPECT_EQ(error_of([] { reduce(sample(0.0), 0, {.group_dst = 0}); }),
              "`group_dst` requires `group` to be passed.");
    EXPECT_EQ(error_of([] { from_remote_init(0, {.group = default_group(), .group_src = 0}); }),
              "`src` and `group_src` are mutually exclusive.");
    if (rank == 0) {
      EXPECT_NE(
          error_of([] { scatter(0, {sample(0.0)}); }).find("passes 1 TensorDicts to a group of 2"),
          std::string::npos);
    }
  });
}

// ---- bucket_bytes: leaves of one device and dtype reduced as flat buckets --------------------

// Mixed dtypes and sizes, a transposed (non-contiguous) leaf, one leaf larger than the small
// buckets, a nested level; leaf values depend on the rank and on the position, so that a value
// landing in another leaf's place, or a bucket cut at the wrong offset, shows.
TensorDict bucketable(int rank) {
  const double r = rank + 1;
  const auto v = [&](int64_t n, at::ScalarType t, double k) {
    return ((at::arange(n, at::kDouble) % 7 + k) * r).to(t);
  };
  TensorDict inner(
      {{"f", v(3, at::kFloat, 5)}, {"i", v(5, at::kInt, 6)}, {"d", v(2, at::kDouble, 7)}}, {});
  return TensorDict({{"a", v(5, at::kFloat, 1)},
                     {"l", v(7, at::kLong, 2)},
                     {"t", v(6, at::kFloat, 3).view({2, 3}).t()},
                     {"big", v(300, at::kFloat, 4)},
                     {"n", inner},
                     {"d", v(4, at::kDouble, 8)},
                     {"b", v(2, at::kFloat, 9)}},
                    {});
}

void expect_equal_leaves(const TensorDict& got, const TensorDict& want) {
  const auto w = want.items({.include_nested = true, .leaves_only = true});
  ASSERT_EQ(got.items({.include_nested = true, .leaves_only = true}).size(), w.size());
  for (const auto& [key, value] : w) {
    const at::Tensor g = got.get(key).tensor();
    EXPECT_EQ(g.scalar_type(), value.tensor().scalar_type()) << key.str();
    EXPECT_TRUE(at::equal(g, value.tensor())) << key.str() << ": " << g << " vs " << value.tensor();
  }
}

TEST(DistCollectives, BucketBytesGivesTheUnbucketedResults) {
  run_ranks(3, [](int rank, int) {
    // 1: every leaf alone; 12: some pairs; 64: several leaves, "big" (1200 bytes) alone;
    // 1 MiB: one bucket per dtype.
    const std::vector<int64_t> sizes = {1, 12, 64, int64_t{1} << 20};
    for (const auto op : {c10d::ReduceOp::SUM, c10d::ReduceOp::MAX, c10d::ReduceOp::MIN}) {
      SCOPED_TRACE(static_cast<int>(op));
      TensorDict plain = bucketable(rank);
      all_reduce(plain, {.op = op});
      // Against the arithmetic too: rank r holds (r + 1) x.
      const int64_t factor = op == c10d::ReduceOp::SUM ? 6 : op == c10d::ReduceOp::MAX ? 3 : 1;
      expect_equal_leaves(plain, bucketable(0) * at::Scalar(factor));
      TensorDict reduced = bucketable(rank);
      reduce(reduced, 1, {.op = op});
      for (const int64_t bytes : sizes) {
        SCOPED_TRACE(c10::str("bucket_bytes ", bytes));
        TensorDict td = bucketable(rank);
        const at::Tensor t = td.get("t").tensor();
        all_reduce(td, {.op = op, .bucket_bytes = bytes});
        expect_equal_leaves(td, plain);
        EXPECT_TRUE(td.get("t").tensor().is_same(t));  // in place
        TensorDict a = bucketable(rank);
        all_reduce(a, {.op = op, .async_op = true, .bucket_bytes = bytes});
        expect_equal_leaves(a, plain);
        TensorDict w = bucketable(rank);
        const auto works = all_reduce_async(w, {.op = op, .bucket_bytes = bytes});
        EXPECT_FALSE(works.empty());
        for (const auto& work : works) work->wait();
        expect_equal_leaves(w, plain);
        // reduce to global rank 1: the destination holds the unbucketed result.
        TensorDict r = bucketable(rank);
        reduce(r, 1, {.op = op, .bucket_bytes = bytes});
        if (rank == 1) expect_equal_leaves(r, reduced);
        TensorDict p = bucketable(rank);
        for (const auto& work : reduce_premature(p, 1, {.op = op, .bucket_bytes = bytes})) {
          work->wait();
        }
        if (rank == 1) expect_equal_leaves(p, reduced);
      }
    }
  });
}

TEST(DistCollectives, BucketBytesCountsWorksAndRefusesNonPositiveSizes) {
  run_ranks(2, [](int rank, int) {
    // Six float32 leaves of 16 bytes: 1 MiB makes one bucket, 32 bytes three, 1 byte six.
    const auto make = [&] {
      std::vector<TensorDict::Entry> entries;
      for (int i = 0; i < 6; ++i)
        entries.emplace_back(c10::str("k", i), at::full({4}, i + rank + 1.0));
      return TensorDict(entries, {});
    };
    for (const auto& [bytes, buckets] :
         std::vector<std::pair<int64_t, size_t>>{{int64_t{1} << 20, 1}, {32, 3}, {48, 2}, {1, 6}}) {
      SCOPED_TRACE(bytes);
      TensorDict td = make();
      const auto works = all_reduce_async(td, {.bucket_bytes = bytes});
      EXPECT_EQ(works.size(), buckets);
      for (const auto& w : works) w->wait();
      for (int i = 0; i < 6; ++i) {
        EXPECT_TRUE(td.get(c10::str("k", i)).tensor().eq(2 * i + 3).all().item<bool>()) << i;
      }
    }
    for (const int64_t bad : {int64_t{0}, int64_t{-8}}) {
      EXPECT_NE(error_of([&] {
                  all_reduce(make(), {.bucket_bytes = bad});
                }).find("bucket_bytes must be a positive number of bytes"),
                std::string::npos);
      EXPECT_NE(error_of([&] {
                  reduce(make(), 0, {.bucket_bytes = bad});
                }).find("bucket_bytes must be a positive number of bytes"),
                std::string::npos);
    }
    // The group is still in step after the refusals.
    TensorDict td = make();
    all_reduce(td, {.bucket_bytes = 16});
    EXPECT_TRUE(td.get("k0").tensor().eq(3).all().item<bool>());
  });
}

// reduce into a lazy stack with buckets: the stacked leaves are reduced and written back into
// the members at the destination.
TEST(DistCollectives, BucketBytesReduceIntoALazyStack) {
  run_ranks(2, [](int rank, int) {
    const auto make = [&] {
      TensorDict a({{"x", at::full({3}, rank + 1.0)}, {"y", at::full({3, 2}, rank + 2.0)}}, {3});
      TensorDict b({{"x", at::full({3}, rank + 3.0)}, {"y", at::full({3, 2}, rank + 4.0)}}, {3});
      return TensorDict({{"s", LazyStackedTensorDict({a, b}, 0)}, {"z", at::full({2}, rank + 5.0)}},
                        {2});
    };
    for (bool premature : {false, true}) {
      SCOPED_TRACE(premature);
      TensorDict td = make();
      if (premature) {
        for (const auto& w : reduce_premature(td, 0, {.bucket_bytes = 1 << 20})) w->wait();
      } else {
        reduce(td, 0, {.bucket_bytes = 1 << 20});
      }
      if (rank != 0) continue;
      const auto members = LazyStackedTensorDict::of(td.get("s").tensordict()).tensordicts();
      EXPECT_TRUE(members[0].get("x").tensor().eq(3).all().item<bool>());
      EXPECT_TRUE(members[0].get("y").tensor().eq(5).all().item<bool>());
      EXPECT_TRUE(members[1].get("x").tensor().eq(7).all().item<bool>());
      EXPECT_TRUE(members[1].get("y").tensor().eq(9).all().item<bool>());
      EXPECT_TRUE(td.get("z").tensor().eq(11).all().item<bool>());
    }
  });
}

// check_buckets: the ranks' layouts are compared first, so a bucket_bytes that differs is a
// ValueError on every rank instead of Gloo's abort; equal layouts go through, and the group
// stays in step.
TEST(DistCollectives, CheckBucketsRefusesDifferentBucketBytesOnEveryRank) {
  run_ranks(2, [](int rank, int) {
    // Four float32 leaves of 64 bytes: 64 makes four buckets, 1 MiB one.
    const auto make = [&] {
      std::vector<TensorDict::Entry> entries;
      for (int i = 0; i < 4; ++i) {
        entries.emplace_back(c10::str("k", i), at::full({16}, rank + 1.0));
      }
      return TensorDict(entries, {});
    };
    const int64_t mine = rank == 0 ? 64 : int64_t{1} << 20;
    std::string error = "<no error>";
    try {
      all_reduce(make(), {.bucket_bytes = mine, .check_buckets = true});
    } catch (const c10::ValueError& e) {
      error = e.msg();
    }
    EXPECT_NE(error.find("all_reduce(check_buckets=True): the ranks' buckets differ"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("rank 0: bucket_bytes = 64, 4 collectives; rank 1: bucket_bytes = "
                         "1048576, 1 collective)"),
              std::string::npos)
        << error;
    EXPECT_NE(error_of([&] {
                for (const auto& w :
                     all_reduce_async(make(), {.bucket_bytes = mine, .check_buckets = true})) {
                  w->wait();
                }
              }).find("the ranks' buckets differ"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                reduce(make(), 0,
                       {.bucket_bytes = rank == 0 ? std::optional<int64_t>(1 << 20) : std::nullopt,
                        .check_buckets = true});
              })
                  .find("reduce(check_buckets=True): the ranks' buckets differ, so their "
                        "collectives would not match and Gloo would abort a rank (rank 0: "
                        "bucket_bytes = 1048576, 1 collective; rank 1: bucket_bytes = None, 4 "
                        "collectives). Every rank must pass the same bucket_bytes"),
              std::string::npos);
    // Values that give the same layout pass the check: every leaf fits either way, or 64 bytes
    // make a bucket of each leaf as no bucket_bytes does.
    TensorDict td = make();
    all_reduce(td, {.bucket_bytes = rank == 0 ? 256 : 4096, .check_buckets = true});
    EXPECT_TRUE(td.get("k3").tensor().eq(3).all().item<bool>());
    TensorDict r = make();
    const auto bytes = rank == 0 ? std::optional<int64_t>(64) : std::nullopt;
    for (const auto& w : reduce_premature(r, 1, {.bucket_bytes = bytes, .check_buckets = true})) {
      w->wait();
    }
    if (rank == 1) {
      EXPECT_TRUE(r.get("k0").tensor().eq(3).all().item<bool>());
    }
  });
}

// Every transfer that writes into a TensorDict's leaves bumps their autograd version counters,
// so that a backward that saved a leaf before the write raises (the reference bumps nothing).
TEST(DistCollectives, WritesIntoLeavesBumpTheirVersions) {
  run_ranks(2, [](int rank, int) {
    const auto make = [&] {
      return TensorDict({{"w", at::full({4, 3}, rank + 1.0)},
                         {"n", TensorDict({{"t", at::full({4, 3}, 2.0).t()}}, {})}},
                        {});
    };
    const auto versions = [](const TensorDict& td) {
      return std::vector<int64_t>{td.get("w").tensor()._version(),
                                  td.get(NestedKey({"n", "t"})).tensor()._version()};
    };
    const auto bumped = [&](const TensorDict& td, const std::vector<int64_t>& before) {
      const auto after = versions(td);
      for (size_t i = 0; i < after.size(); ++i) EXPECT_GT(after[i], before[i]) << i;
    };
    for (int mode = 0; mode < 7; ++mode) {
      SCOPED_TRACE(c10::str("mode ", mode));
      TensorDict td = mode >= 5 ? consolidate(make()) : make();
      const auto before = versions(td);
      switch (mode) {
        case 0: all_reduce(td); break;
        case 1: all_reduce(td, {.bucket_bytes = 1 << 20}); break;
        case 2:
          for (const auto& w : all_reduce_async(td, {.bucket_bytes = 1 << 20})) w->wait();
          break;
        case 3: reduce(td, 0, {.bucket_bytes = 1 << 20}); break;
        case 4:
        case 5:
        case 6: {
          const SendOptions o{.consolidated = mode == 5, .checked = mode == 6};
          if (rank == 0) {
            send(td, 1, o);
            continue;
          }
          recv(td, 0, {.consolidated = o.consolidated, .checked = o.checked});
          break;
        }
      }
      bumped(td, before);
    }
  });
}

// The same through a module's parameters: a backward built before a receive into
// TensorDictParams::from_module(...)->params() raises autograd's in-place error.
TEST(DistCollectives, ReceiveIntoModuleParametersInvalidatesAnEarlierGraph) {
  run_ranks(2, [](int rank, int) {
    torch::manual_seed(rank);
    torch::nn::Linear linear(4, 2);
    const TensorDict params = TensorDictParams::from_module(*linear)->params();
    if (rank == 0) {
      send(params, 1);
      return;
    }
    const at::Tensor x = at::ones({3, 4}).requires_grad_();  // so the weight is saved
    const at::Tensor out = linear->forward(x).sum();
    recv(params, 0);
    EXPECT_NE(error_of([&] { out.backward(); })
                  .find("one of the variables needed for gradient computation has been modified "
                        "by an inplace operation"),
              std::string::npos);
  });
}

}  // namespace
}  // namespace tensordict::dist

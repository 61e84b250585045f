// LazyStackedTensorDict (lazy_stack.h): construction, reads and writes through the members,
// indexing, copies, nesting, and its consolidated metadata (written, read back from JSON and
// pickle, rebuilt, and refused when a peer's is malformed).

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "expect_throw.h"
#include "tensordict/consolidate.h"
#include "tensordict/lazy_stack.h"
#include "wire/metadata_pickle.h"

namespace tensordict {
namespace {

using at::indexing::Slice;

// Member 0 has x, e and n.y [3, 2]; member 1 has x and n.y [3, 4]: a heterogeneous stack.
std::vector<TensorDict> members(double fill = 0) {
  TensorDict a({{"x", at::arange(3, at::kFloat) + fill},
                {"e", at::ones({3}, at::kLong)},
                {{"n", "y"}, at::full({3, 2}, fill + 1)}},
               {3});
  TensorDict b({{"x", at::arange(3, at::kFloat) + fill + 10}, {{"n", "y"}, at::full({3, 4}, fill + 2)}},
               {3});
  return {a, b};
}

TEST(LazyStack, BatchSizeKeysAndStackedReads) {
  const auto ms = members();
  LazyStackedTensorDict s(ms, 0);
  EXPECT_TRUE(s.is_lazy_stack());
  EXPECT_EQ(s.batch_size(), at::IntArrayRef({2, 3}));
  EXPECT_EQ(s.stack_dim(), 0);
  EXPECT_EQ(s.keys(), (std::vector<NestedKey>{"x", "n"}));
  EXPECT_EQ(s.keys({.include_nested = true, .leaves_only = true}),
            (std::vector<NestedKey>{"x", {"n", "y"}}));
  EXPECT_TRUE(at::equal(s.get("x").tensor(), at::stack({ms[0].get("x").tensor(),
                                                         ms[1].get("x").tensor()})));
  EXPECT_TRUE(s.contains({"n", "y"}));
  EXPECT_FALSE(s.contains("e"));  // member 1 lacks it
  EXPECT_THROW_MSG(s.get({"n", "y"}), c10::Error,
                   "Failed to stack tensors within a tensordict under the key 'y'");
  EXPECT_THROW_MSG(s.get("e"), KeyError, "members 1 lack it");
  EXPECT_EQ(s.exclusive_keys(), (std::vector<std::vector<NestedKey>>{{"e"}, {}}));
  EXPECT_TRUE(s.get("n").tensordict().is_lazy_stack());
  EXPECT_EQ(LazyStackedTensorDict(ms, -1).stack_dim(), 1);
  EXPECT_THROW_MSG(LazyStackedTensorDict(ms, 2), c10::Error, "Stack dim 2 is too big");
  EXPECT_THROW_MSG(LazyStackedTensorDict({ms[0], TensorDict({}, {4})}), c10::ValueError,
                   "share their batch size");
  EXPECT_THROW_MSG(LazyStackedTensorDict::of(ms[0]), c10::TypeError, "LazyStackedTensorDict");
}

TEST(LazyStack, WritesReachEveryMemberOrNone) {
  auto ms = members();
  LazyStackedTensorDict s(ms, 1);
  s.set("w", at::stack({at::zeros({3}), at::ones({3})}, 1));
  EXPECT_TRUE(at::equal(ms[0].get("w").tensor(), at::zeros({3})));
  EXPECT_TRUE(at::equal(ms[1].get("w").tensor(), at::ones({3})));
  s.set_("x", at::full({3, 2}, 5.0));
  EXPECT_TRUE(ms[1].get("x").tensor().eq(5).all().item<bool>());
  s.fill_("n", 7);  // heterogeneous leaves are filled where they are
  EXPECT_TRUE(ms[1].get({"n", "y"}).tensor().eq(7).all().item<bool>());
  EXPECT_THROW_MSG(s.set("bad", at::zeros({2, 3})), c10::ValueError, "'bad'");
  ms[1].lock_();
  EXPECT_THROW_MSG(s.set("late", at::zeros({3, 2})), c10::Error, "locked");
  EXPECT_FALSE(ms[0].contains("late"));
  ms[1].unlock_();
  s.erase("w");
  EXPECT_FALSE(ms[0].contains("w") || ms[1].contains("w"));
  EXPECT_THROW_MSG(s.set_batch_size({6}), c10::Error, "LazyStackedTensorDict");
}

TEST(LazyStack, IndexingUnbindAndCopies) {
  const auto ms = members();
  LazyStackedTensorDict s(ms, 0);
  EXPECT_TRUE(s.index({1}).is_same(ms[1]));  // the member itself
  const TensorDict col = s.index({Slice(), 1});
  ASSERT_TRUE(col.is_lazy_stack());
  EXPECT_EQ(col.batch_size(), at::IntArrayRef({2}));
  EXPECT_TRUE(at::equal(col.get("x").tensor(), s.get("x").tensor().index({Slice(), 1})));
  const TensorDict tail = s.index({Slice(1, std::nullopt)});
  EXPECT_EQ(LazyStackedTensorDict::of(tail).tensordicts().size(), 1u);
  EXPECT_TRUE(LazyStackedTensorDict::of(tail).tensordicts()[0].is_same(ms[1]));
  const auto rows = s.unbind(0);
  EXPECT_TRUE(rows[0].is_same(ms[0]) && rows[1].is_same(ms[1]));
  const auto cols = s.unbind(1);
  ASSERT_EQ(cols.size(), 3u);
  EXPECT_TRUE(cols[2].is_lazy_stack());
  EXPECT_TRUE(at::equal(cols[2].get("x").tensor(), s.get("x").tensor().index({Slice(), 2})));

  const TensorDict c = s.clone();
  ASSERT_TRUE(c.is_lazy_stack());
  TensorDict(c).zero_();
  EXPECT_FALSE(s.get("x").tensor().eq(0).all().item<bool>());
  EXPECT_EQ(s.to(at::kDouble).get("x").tensor().scalar_type(), at::kDouble);
  EXPECT_THROW_MSG(s.contiguous(), c10::Error, "under the key 'y'");
  LazyStackedTensorDict homogeneous({ms[0], ms[0].clone()}, 1);
  const TensorDict dense = homogeneous.contiguous();
  EXPECT_FALSE(dense.is_lazy_stack());
  EXPECT_TRUE(at::equal(dense.get({"n", "y"}).tensor(), homogeneous.get({"n", "y"}).tensor()));
  EXPECT_TRUE(homogeneous.allclose(dense));
  EXPECT_TRUE((homogeneous == dense).all());
}

TEST(LazyStack, NestsBothWays) {
  const auto ms = members();
  TensorDict td({{"z", at::zeros({2, 3})}, {"s", LazyStackedTensorDict(ms, 0)}}, {2, 3});
  EXPECT_TRUE(td.get("s").tensordict().is_lazy_stack());
  EXPECT_EQ(td.get({"s", "x"}).tensor().sizes(), at::IntArrayRef({2, 3}));
  EXPECT_TRUE(td.index({0}).get("s").tensordict().is_same(ms[0]));
  td.set({"s", "q"}, at::ones({2, 3}));
  EXPECT_TRUE(ms[0].contains("q") && ms[1].contains("q"));
  LazyStackedTensorDict outer({td, td.clone()}, 0);
  EXPECT_EQ(outer.get({"s", "x"}).tensor().sizes(), at::IntArrayRef({2, 2, 3}));
}

TEST(LazyStack, ConsolidatesAsTheReferenceAndRebuilds) {
  const auto ms = members();
  TensorDict td({{"z", at::full({3, 2}, 9.0)}, {"s", LazyStackedTensorDict(ms, 1)}}, {3, 2});
  const TensorDict c = consolidate(td);
  const auto& m = *consolidated_metadata(c);
  ASSERT_EQ(m.children.size(), 1u);
  const Metadata& node = m.children[0].second;
  EXPECT_EQ(node.cls, "LazyStackedTensorDict");
  EXPECT_TRUE(node.leaves.empty());
  EXPECT_EQ(node.children[0].first, "0");
  EXPECT_EQ(node.children[1].first, "1");
  EXPECT_EQ(node.cls_metadata.stack_dim, 1);
  // z (24 bytes), then member 0's x (16 with its pad), e (24) and n.y (24)
  EXPECT_EQ(node.children[1].second.leaves[0].second.start, 88);
  const std::string json = metadata_to_json(m);
  EXPECT_NE(json.find("\"cls_metadata\": {\"stack_dim\": 1, \"stack_dim_name\": null, "
                      "\"is_locked\": false}"),
            std::string::npos)
      << json;
  EXPECT_EQ(metadata_from_json(json), m);
  EXPECT_EQ(metadata_from_pickle_bytes(metadata_pickle_bytes(m)), m);

  const TensorDict back = rebuild(m, consolidated_storage(c));
  const TensorDict s = back.get("s").tensordict();
  ASSERT_TRUE(s.is_lazy_stack());
  EXPECT_EQ(LazyStackedTensorDict::of(s).stack_dim(), 1);
  EXPECT_TRUE(at::equal(LazyStackedTensorDict::of(s).tensordicts()[1].get({"n", "y"}).tensor(),
                        ms[1].get({"n", "y"}).tensor()));
  EXPECT_TRUE(is_consolidated(back));
  TensorDict(LazyStackedTensorDict::of(s).tensordicts()[0]).unlock_().set("x", at::zeros({3}));
  EXPECT_FALSE(is_consolidated(back));  // a member's change is seen from the root
  EXPECT_TRUE(consolidate(LazyStackedTensorDict(ms, 0)).is_lazy_stack());
}

TEST(LazyStack, MalformedLazyNodesFromAPeerAreRefused) {
  const auto ms = members();
  const Metadata good = metadata_of(LazyStackedTensorDict(ms, 0));
  const auto refused = [&](auto&& change, const char* needle) {
    Metadata m = good;
    change(m);
    EXPECT_THROW_MSG(metadata_from_json(metadata_to_json(m)), c10::ValueError, needle);
  };
  refused([](Metadata& m) { m.children[1].first = "7"; }, "keyed '7'");
  refused([](Metadata& m) { m.children[1].second.cls_metadata.batch_size = {4}; },
          "different batch sizes");
  refused([](Metadata& m) { m.cls_metadata.stack_dim = 5; }, "stack_dim 5");
  refused([](Metadata& m) { m.leaves.push_back(m.children[0].second.leaves[0]); },
          "of its own");
  refused([](Metadata& m) { m.children.clear(); }, "no members");
  const std::string extra = [&] {
    std::string j = metadata_to_json(good);
    const std::string at = "\"stack_dim\": 0";
    return j.replace(j.find(at), at.size(), "\"stack_dim\": 0, \"device\": \"cpu\"");
  }();
  EXPECT_THROW_MSG(metadata_from_json(extra), c10::ValueError, "unexpected field 'device'");
}

}  // namespace
}  // namespace tensordict

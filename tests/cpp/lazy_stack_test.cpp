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

using namespace ::tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

using at::indexing::Slice;

// Member 0 has x, e and n.y [3, 2]; member 1 has x and n.y [3, 4]: a heterogeneous stack.
std::vector<TensorDict> members(double fill = 0) {
  TensorDict a({{"x", at::arange(3, at::kFloat) + fill},
                {"e", at::ones({3}, at::kLong)},
                {{"n", "y"}, at::full({3, 2}, fill + 1)}},
               {3});
  TensorDict b(
      {{"x", at::arange(3, at::kFloat) + fill + 10}, {{"n", "y"}, at::full({3, 4}, fill + 2)}},
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
  EXPECT_TRUE(at::equal(s.get("x").tensor(),
                        at::stack({ms[0].get("x").tensor(), ms[1].get("x").tensor()})));
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
  refused([](Metadata& m) { m.leaves.push_back(m.children[0].second.leaves[0]); }, "of its own");
  refused([](Metadata& m) { m.children.clear(); }, "no members");
  const std::string extra = [&] {
    std::string j = metadata_to_json(good);
    const std::string at = "\"stack_dim\": 0";
    return j.replace(j.find(at), at.size(), "\"stack_dim\": 0, \"device\": \"cpu\"");
  }();
  EXPECT_THROW_MSG(metadata_from_json(extra), c10::ValueError, "unexpected field 'device'");
}

// ---- maybe_dense_stack: the reference's LazyStackedTensorDict.maybe_dense_stack ----------------

TensorDict dense_member(double fill, int64_t width = 2) {
  TensorDict n({{"y", at::full({3, width}, fill + 1)}}, {3});
  return TensorDict({{"x", at::full({3}, fill)}, {"n", n}}, {3});
}

TEST(MaybeDenseStack, SameKeysAndShapesStackDensely) {
  const std::vector<TensorDict> tds = {dense_member(0), dense_member(10), dense_member(20)};
  for (int64_t dim : {0, 1, -1, -2}) {
    SCOPED_TRACE(dim);
    const TensorDict s = maybe_dense_stack(tds, dim);
    EXPECT_FALSE(s.is_lazy_stack());
    EXPECT_FALSE(s.get("n").tensordict().is_lazy_stack());
    const TensorDict want = stack(tds, dim);
    EXPECT_EQ(s.batch_size(), want.batch_size());
    EXPECT_TRUE(at::equal(s.get("x").tensor(), want.get("x").tensor()));
    EXPECT_TRUE(at::equal(s.get({"n", "y"}).tensor(), want.get({"n", "y"}).tensor()));
    EXPECT_EQ(s.get("n").tensordict().batch_size(), want.get("n").tensordict().batch_size());
  }
  EXPECT_EQ(maybe_dense_stack(tds, 1).batch_size(), at::IntArrayRef({3, 3}));
  EXPECT_TRUE(
      at::equal(maybe_dense_stack(tds, 1).get("x").tensor()[0], at::tensor({0.0f, 10.0f, 20.0f})));
  // One TensorDict: a stack of one.
  const TensorDict one = maybe_dense_stack({dense_member(1)});
  EXPECT_FALSE(one.is_lazy_stack());
  EXPECT_EQ(one.batch_size(), at::IntArrayRef({1, 3}));
  // Keys in another order are the same keys; dtypes are promoted as torch.stack does.
  TensorDict reordered({{"n", dense_member(5).get("n")}, {"x", at::full({3}, 5, at::kLong)}}, {3});
  const TensorDict mixed = maybe_dense_stack({dense_member(0), reordered});
  EXPECT_FALSE(mixed.is_lazy_stack());
  EXPECT_EQ(mixed.get("x").tensor().scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(mixed.get("x").tensor()[1], at::full({3}, 5.0f)));
}

TEST(MaybeDenseStack, DifferentKeysOrShapesStackLazily) {
  {
    // A root leaf of another shape.
    TensorDict other({{"x", at::full({3, 2}, 1.0)}, {"n", dense_member(1).get("n")}}, {3});
    const TensorDict s = maybe_dense_stack({dense_member(0), other});
    ASSERT_TRUE(s.is_lazy_stack());
    EXPECT_EQ(s.batch_size(), at::IntArrayRef({2, 3}));
    EXPECT_TRUE(LazyStackedTensorDict::of(s).tensordicts()[1].is_same(other));
  }
  {
    // Exclusive keys.
    TensorDict a({{"x", at::zeros({3})}}, {3});
    TensorDict b({{"z", at::zeros({3})}}, {3});
    const TensorDict s = maybe_dense_stack({a, b}, 1);
    ASSERT_TRUE(s.is_lazy_stack());
    EXPECT_EQ(LazyStackedTensorDict::of(s).stack_dim(), 1);
    EXPECT_EQ(s.batch_size(), at::IntArrayRef({3, 2}));
    // A key missing in one member only.
    TensorDict c({{"x", at::zeros({3})}, {"z", at::zeros({3})}}, {3});
    EXPECT_TRUE(maybe_dense_stack({a, c}).is_lazy_stack());
    // A leaf in one, a nested level in the other.
    TensorDict d({{"x", TensorDict({}, {3})}}, {3});
    EXPECT_TRUE(maybe_dense_stack({a, d}).is_lazy_stack());
  }
}

TEST(MaybeDenseStack, ANestedLevelDecidesForItself) {
  // The nested leaves differ: a dense root holding a lazy stack of the nested levels.
  const TensorDict s = maybe_dense_stack({dense_member(0, 2), dense_member(1, 4)});
  ASSERT_FALSE(s.is_lazy_stack());
  EXPECT_EQ(s.batch_size(), at::IntArrayRef({2, 3}));
  EXPECT_TRUE(at::equal(s.get("x").tensor(), at::stack({at::zeros({3}), at::ones({3})})));
  const TensorDict n = s.get("n").tensordict();
  ASSERT_TRUE(n.is_lazy_stack());
  EXPECT_EQ(n.batch_size(), at::IntArrayRef({2, 3}));
  EXPECT_EQ(LazyStackedTensorDict::of(n).tensordicts()[1].get("y").tensor().sizes(),
            at::IntArrayRef({3, 4}));
  // The nested levels' batch sizes differ (the leaves' shapes too): the reference stacks the
  // whole lot lazily, since a nested level's shape is its batch size.
  TensorDict a({{"x", at::zeros({2})}, {"n", TensorDict({{"y", at::zeros({2, 3})}}, {2, 3})}}, {2});
  TensorDict b({{"x", at::zeros({2})}, {"n", TensorDict({{"y", at::zeros({2, 4})}}, {2, 4})}}, {2});
  const TensorDict l = maybe_dense_stack({a, b});
  EXPECT_TRUE(l.is_lazy_stack());
  EXPECT_EQ(l.batch_size(), at::IntArrayRef({2, 2}));
}

TEST(MaybeDenseStack, NonTensorAndUnbatchedEntriesStackDensely) {
  TensorDict a({{"x", at::zeros({2})}, {"u", Value::unbatched(at::zeros({5}))}}, {2});
  TensorDict b({{"x", at::ones({2})}, {"u", Value::unbatched(at::ones({5}))}}, {2});
  a.set_non_tensor("s", "hi");
  b.set_non_tensor("s", "yo");
  const TensorDict s = maybe_dense_stack({a, b});
  ASSERT_FALSE(s.is_lazy_stack());
  EXPECT_EQ(s.batch_size(), at::IntArrayRef({2, 2}));
  ASSERT_TRUE(s.get("s").is_non_tensor());
  EXPECT_EQ(s.get("s").non_tensor().batch_size(), at::IntArrayRef({2, 2}));
  EXPECT_EQ(s.get_non_tensor("s"),
            JsonValue::list({JsonValue::list({"hi", "hi"}), JsonValue::list({"yo", "yo"})}));
  // The unbatched leaf is tensordict 0's, as stack() keeps it.
  ASSERT_TRUE(s.get("u").is_unbatched());
  EXPECT_TRUE(at::equal(s.get("u").tensor(), at::zeros({5})));
}

TEST(MaybeDenseStack, LazyStacksOfTheSameLayoutStackTheirMembers) {
  // As the reference: every input a lazy stack with as many members and leaves, so the
  // members are stacked (densely where they can be) and the result is a lazy stack of those,
  // its stack dim moved past the new one.
  auto lazy = [](double fill) {
    return lazy_stack({TensorDict({{"x", at::full({3}, fill)}}, {3}),
                       TensorDict({{"x", at::full({3}, fill + 1)}}, {3})},
                      0);
  };
  const TensorDict s = maybe_dense_stack({lazy(0), lazy(10)}, 0);
  ASSERT_TRUE(s.is_lazy_stack());
  EXPECT_EQ(s.batch_size(), at::IntArrayRef({2, 2, 3}));
  const LazyStackedTensorDict l = LazyStackedTensorDict::of(s);
  EXPECT_EQ(l.stack_dim(), 1);
  ASSERT_EQ(l.tensordicts().size(), 2u);
  for (const auto& m : l.tensordicts()) {
    EXPECT_FALSE(m.is_lazy_stack());
    EXPECT_EQ(m.batch_size(), at::IntArrayRef({2, 3}));
  }
  // Values: s[i][j] is lazy(10 i) member j.
  const at::Tensor x = s.get("x").tensor();
  EXPECT_TRUE(at::equal(x[0][1], at::full({3}, 1.0)));
  EXPECT_TRUE(at::equal(x[1][0], at::full({3}, 10.0)));
}

TEST(MaybeDenseStack, Errors) {
  EXPECT_THROW_MSG(maybe_dense_stack({}), c10::Error, "list_of_tensordicts cannot be empty");
  TensorDict a({{"x", at::zeros({2, 3})}}, {2});
  TensorDict b({{"x", at::zeros({2, 3})}}, {2, 3});
  EXPECT_THROW_MSG(maybe_dense_stack({a, b}), c10::Error,
                   "Lazy stacking of tensordicts requires them to have congruent batch "
                   "dimensions, got td[1].batch_dims=2 and td[0].batch_dims=1");
  // Batch sizes that differ with the same number of dims: the reference makes a lazy stack
  // with a -1 dim, which ours cannot hold (LazyStackedTensorDict needs one batch size).
  TensorDict c({{"x", at::zeros({3, 3})}}, {3});
  EXPECT_THROW(maybe_dense_stack({a, c}), c10::Error);
}

}  // namespace
}  // namespace tensordict

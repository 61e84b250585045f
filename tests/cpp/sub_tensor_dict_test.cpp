// SubTensorDict (sub_tensor_dict.h): rows of a parent selected by an index. Reads come from
// the parent at the index, writes land in the parent's storage; basic indices give views,
// advanced ones copies. Receives into a SubTensorDict are in dist_receivers_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "expect_throw.h"
#include "tensordict/errors.h"
#include "tensordict/sub_tensor_dict.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {
namespace {

using at::indexing::Ellipsis;
using at::indexing::None;
using at::indexing::Slice;

// a = row r holds 10 r + column, n.b = row r holds -r; batch [4].
TensorDict parent() {
  TensorDict n({{"b", -at::arange(4, at::kLong)}}, {4});
  return TensorDict(
      {{"a", at::arange(12, at::kFloat).view({4, 3}) + at::arange(4, at::kFloat).view({4, 1}) * 7},
       {"n", n}},
      {4});
}

at::Tensor rows_of(const TensorDict& td, const NestedKey& key, std::vector<int64_t> rows) {
  return td.get(key).tensor().index({at::tensor(rows, at::kLong)});
}

bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.storage().is_alias_of(b.storage());
}

TEST(SubTensorDict, SliceIsAViewOfTheParentsRows) {
  TensorDict p = parent();
  const at::Tensor a_before = p.get("a").tensor().clone();
  SubTensorDict sub(p, {Slice(1, 3)});
  EXPECT_TRUE(sub.is_view());
  EXPECT_EQ(sub.batch_size(), at::IntArrayRef({2}));
  EXPECT_TRUE(sub.parent().is_same(p));

  TensorDict v = sub.view();
  EXPECT_EQ(v.batch_size(), at::IntArrayRef({2}));
  const at::Tensor va = v.get("a").tensor();
  EXPECT_TRUE(shares_memory(va, p.get("a").tensor()));
  EXPECT_EQ(va.data_ptr(), p.get("a").tensor()[1].data_ptr());
  EXPECT_TRUE(shares_memory(v.get({"n", "b"}).tensor(), p.get({"n", "b"}).tensor()));
  EXPECT_TRUE(at::equal(sub.get("a").tensor(), a_before.slice(0, 1, 3)));
  EXPECT_TRUE(at::equal(sub.get({"n", "b"}).tensor(), at::tensor({-1, -2}, at::kLong)));
  // A nested level comes back as a TensorDict of the rows.
  EXPECT_EQ(sub.get("n").tensordict().batch_size(), at::IntArrayRef({2}));

  // Writes into the view land in the parent (it is its memory).
  at::Tensor(va).fill_(100);
  EXPECT_TRUE(p.get("a").tensor().slice(0, 1, 3).eq(100).all().item<bool>());
  EXPECT_TRUE(at::equal(p.get("a").tensor()[0], a_before[0]));
  EXPECT_TRUE(at::equal(p.get("a").tensor()[3], a_before[3]));
}

TEST(SubTensorDict, SetUnderscoreWritesOnlyTheSelectedRows) {
  TensorDict p = parent();
  const at::Tensor a_before = p.get("a").tensor().clone();
  const void* storage = p.get("a").tensor().data_ptr();
  SubTensorDict sub(p, {Slice(1, 3)});
  sub.set_("a", at::full({2, 3}, 5.0));
  sub.set_({"n", "b"}, at::tensor({70, 80}, at::kLong));
  EXPECT_EQ(p.get("a").tensor().data_ptr(), storage);  // in place
  EXPECT_TRUE(p.get("a").tensor().slice(0, 1, 3).eq(5).all().item<bool>());
  EXPECT_TRUE(at::equal(p.get("a").tensor()[0], a_before[0]));
  EXPECT_TRUE(at::equal(p.get("a").tensor()[3], a_before[3]));
  EXPECT_TRUE(at::equal(p.get({"n", "b"}).tensor(), at::tensor({0, 70, 80, -3}, at::kLong)));
  // Broadcasting as tensor indexing does.
  sub.set_("a", at::full({3}, 1.0));
  EXPECT_TRUE(p.get("a").tensor().slice(0, 1, 3).eq(1).all().item<bool>());
}

TEST(SubTensorDict, IntegerEllipsisAndNoneIndices) {
  TensorDict p({{"x", at::arange(24, at::kFloat).view({4, 2, 3})}}, {4, 2});
  {
    SubTensorDict sub(p, {2});
    EXPECT_TRUE(sub.is_view());
    EXPECT_EQ(sub.batch_size(), at::IntArrayRef({2}));
    EXPECT_TRUE(at::equal(sub.get("x").tensor(), p.get("x").tensor()[2]));
    sub.set_("x", at::zeros({2, 3}));
    EXPECT_TRUE(p.get("x").tensor()[2].eq(0).all().item<bool>());
    EXPECT_TRUE(p.get("x").tensor()[1].ne(0).all().item<bool>());
  }
  {
    // The Ellipsis covers the batch dims only: index 1 of the second batch dim, all features.
    SubTensorDict sub(p, {Ellipsis, 1});
    EXPECT_TRUE(sub.is_view());
    EXPECT_EQ(sub.batch_size(), at::IntArrayRef({4}));
    EXPECT_EQ(sub.view().get("x").tensor().sizes(), at::IntArrayRef({4, 3}));
    sub.set_("x", at::full({4, 3}, -1.0));
    EXPECT_TRUE(p.get("x").tensor().select(1, 1).eq(-1).all().item<bool>());
    EXPECT_TRUE(p.get("x").tensor().select(1, 0).ne(-1).all().item<bool>());
  }
  {
    SubTensorDict sub(p, {None, Slice(0, 2)});
    EXPECT_TRUE(sub.is_view());
    EXPECT_EQ(sub.batch_size(), at::IntArrayRef({1, 2, 2}));
    EXPECT_TRUE(shares_memory(sub.view().get("x").tensor(), p.get("x").tensor()));
  }
}

TEST(SubTensorDict, AdvancedIndicesCopyAndWriteBack) {
  for (bool mask : {false, true}) {
    SCOPED_TRACE(mask ? "mask" : "index tensor");
    TensorDict p = parent();
    const at::Tensor a_before = p.get("a").tensor().clone();
    const at::Tensor idx =
        mask ? at::tensor({1, 0, 1, 0}, at::kByte).to(at::kBool) : at::tensor({0, 2}, at::kLong);
    SubTensorDict sub(p, {idx});
    EXPECT_FALSE(sub.is_view());
    EXPECT_EQ(sub.batch_size(), at::IntArrayRef({2}));

    // view() is a copy: writing into it leaves the parent alone.
    TensorDict v = sub.view();
    EXPECT_FALSE(shares_memory(v.get("a").tensor(), p.get("a").tensor()));
    EXPECT_TRUE(at::equal(v.get("a").tensor(), rows_of(p, "a", {0, 2})));
    v.get("a").tensor().fill_(9);
    EXPECT_TRUE(at::equal(p.get("a").tensor(), a_before));

    // update_ writes the values at the index (what a receive does afterwards).
    sub.update_(v);
    EXPECT_TRUE(rows_of(p, "a", {0, 2}).eq(9).all().item<bool>());
    EXPECT_TRUE(at::equal(rows_of(p, "a", {1, 3}),
                          rows_of(TensorDict({{"a", a_before}}, {4}), "a", {1, 3})));
    EXPECT_TRUE(at::equal(p.get({"n", "b"}).tensor(), -at::arange(4, at::kLong)));

    sub.set_({"n", "b"}, at::tensor({5, 6}, at::kLong));
    EXPECT_TRUE(at::equal(p.get({"n", "b"}).tensor(), at::tensor({5, -1, 6, -3}, at::kLong)));
  }
}

TEST(SubTensorDict, SetsANewKeyInTheParent) {
  TensorDict p = parent();
  SubTensorDict sub(p, {Slice(2, 4)});
  sub.set("new", Value(at::ones({2, 5}, at::kInt)));
  ASSERT_TRUE(p.contains("new"));
  const at::Tensor t = p.get("new").tensor();
  EXPECT_EQ(t.sizes(), at::IntArrayRef({4, 5}));
  EXPECT_EQ(t.scalar_type(), at::kInt);
  EXPECT_TRUE(t.slice(0, 0, 2).eq(0).all().item<bool>());
  EXPECT_TRUE(t.slice(0, 2, 4).eq(1).all().item<bool>());
  // An existing leaf: set() writes the rows as set_() does.
  sub.set("a", Value(at::zeros({2, 3})));
  EXPECT_TRUE(p.get("a").tensor().slice(0, 2, 4).eq(0).all().item<bool>());
  EXPECT_TRUE(p.get("a").tensor().slice(0, 0, 2).ne(0).any().item<bool>());
  // A new non-tensor entry is set for every row.
  sub.set("note", Value(NonTensorData(JsonValue("hi"))));
  ASSERT_TRUE(p.contains("note"));
  EXPECT_TRUE(p.get("note").is_non_tensor());
  EXPECT_EQ(p.get_non_tensor("note"), JsonValue("hi"));
  // A shape that does not start with the rows' batch size, and a new nested level, are refused.
  EXPECT_THROW_MSG(sub.set("bad", Value(at::ones({3, 5}))), tensordict::BatchSizeError,
                   "does not start with the batch size");
  EXPECT_FALSE(p.contains("bad"));
  EXPECT_THROW_MSG(sub.set("lvl", Value(TensorDict({}, {2}))), c10::ValueError,
                   "cannot be written into some rows only");
  EXPECT_FALSE(p.contains("lvl"));
}

TEST(SubTensorDict, LockedParent) {
  TensorDict p = parent();
  p.lock_();
  SubTensorDict sub(p, {Slice(0, 2)});
  sub.set_("a", at::full({2, 3}, 3.0));  // an existing leaf: allowed
  EXPECT_TRUE(p.get("a").tensor().slice(0, 0, 2).eq(3).all().item<bool>());
  EXPECT_THROW(sub.set("new", Value(at::ones({2}))), c10::Error);
  EXPECT_FALSE(p.contains("new"));
  EXPECT_TRUE(p.is_locked());
}

TEST(SubTensorDict, ErrorsNameTheKeyOrIndex) {
  TensorDict p = parent();
  SubTensorDict sub(p, {Slice(0, 2)});
  EXPECT_THROW_MSG(sub.get("missing"), KeyError, "missing");
  EXPECT_THROW_MSG(sub.set_("missing", at::ones({2})), KeyError, "missing");
  EXPECT_THROW_MSG(sub.set_("n", at::ones({2})), c10::TypeError, "set_");
  EXPECT_THROW(SubTensorDict(p, {7}), c10::IndexError);
  EXPECT_THROW(SubTensorDict(p, {0, 0}), c10::IndexError);  // more indices than batch dims
}

TEST(SubTensorDict, SeesLaterChangesOfTheParentAndCopiesOnRequest) {
  TensorDict p = parent();
  SubTensorDict sub(p, {Slice(1, 3)});
  TensorDict copy = sub.to_tensordict();
  EXPECT_FALSE(shares_memory(copy.get("a").tensor(), p.get("a").tensor()));
  p.set_("a", at::full({4, 3}, 42.0));
  EXPECT_TRUE(sub.get("a").tensor().eq(42).all().item<bool>());
  EXPECT_FALSE(copy.get("a").tensor().eq(42).any().item<bool>());
  p.set("c", at::ones({4, 2}));
  EXPECT_EQ(sub.get("c").tensor().sizes(), at::IntArrayRef({2, 2}));
}

TEST(SubTensorDict, UnbatchedLeafIsWrittenWhole) {
  TensorDict p = parent();
  p.set("u", Value::unbatched(at::zeros({2, 2})));
  SubTensorDict sub(p, {Slice(1, 3)});
  const Value got = sub.get("u");
  EXPECT_TRUE(got.is_unbatched());
  EXPECT_EQ(got.tensor().sizes(), at::IntArrayRef({2, 2}));
  sub.set_("u", at::ones({2, 2}));
  EXPECT_TRUE(p.get("u").tensor().eq(1).all().item<bool>());
}

// No index on a parent without batch dims: every leaf whole (how a receive writes into
// parameters that require grad: set_ runs without grad).
TEST(SubTensorDict, EmptyIndexIsTheWholeParentAndWritesIntoParameters) {
  const at::Tensor w = at::zeros({2, 2}).requires_grad_();
  TensorDict p({{"w", w}, {"i", at::zeros({3}, at::kLong)}});
  SubTensorDict sub(p, {});
  EXPECT_TRUE(sub.is_view());
  EXPECT_TRUE(sub.batch_size().empty());
  EXPECT_EQ(sub.view().get("w").tensor().data_ptr(), w.data_ptr());
  sub.update_(TensorDict({{"w", at::ones({2, 2})}, {"i", at::full({3}, 4, at::kLong)}}));
  EXPECT_TRUE(w.eq(1).all().item<bool>());
  EXPECT_TRUE(w.requires_grad());
  EXPECT_TRUE(p.get("w").tensor().is_same(w));
  EXPECT_TRUE(p.get("i").tensor().eq(4).all().item<bool>());
}

}  // namespace
}  // namespace tensordict

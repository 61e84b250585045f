// Batch and tensor-like operations.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "expect_throw.h"
#include "tensordict/tensordict.h"

using namespace at::indexing;
using tensordict::KeyError;
using tensordict::NestedKey;
using tensordict::TensorDict;

namespace {

// batch [4, 3]; a: arange, nested n (batch [4, 3, 2]) holding x.
TensorDict sample() {
  TensorDict td({{"a", at::arange(12, at::kFloat).reshape({4, 3})},
                 {"b", at::arange(24, at::kLong).reshape({4, 3, 2})}},
                {4, 3});
  td.set("n", TensorDict({{"x", at::arange(48, at::kFloat).reshape({4, 3, 2, 2})}}, {4, 3, 2}));
  return td;
}

at::Tensor A(const TensorDict& td) { return td.get("a").tensor(); }
at::Tensor X(const TensorDict& td) { return td.get({"n", "x"}).tensor(); }

}  // namespace

TEST(TensorDictOps, IndexInteger) {
  TensorDict td = sample();
  TensorDict r = td.index({1});
  EXPECT_EQ(r.batch_size(), at::IntArrayRef({3}));
  EXPECT_TRUE(at::equal(A(r), A(td)[1]));
  EXPECT_EQ(r.get("n").tensordict().batch_size(), at::IntArrayRef({3, 2}));
  EXPECT_TRUE(at::equal(X(r), X(td)[1]));
  // A view: writing it changes the source.
  A(r).fill_(-1);
  EXPECT_EQ(A(td)[1][0].item<float>(), -1.0f);
  EXPECT_EQ(td.index({-1}).get("b").tensor()[0][0].item<int64_t>(), 18);
}

TEST(TensorDictOps, IndexSliceEllipsisNone) {
  TensorDict td = sample();
  TensorDict r = td.index({Slice(1, None, 2)});
  EXPECT_EQ(r.batch_size(), at::IntArrayRef({2, 3}));
  EXPECT_TRUE(at::equal(A(r), A(td).index({Slice(1, None, 2)})));
  EXPECT_EQ(A(r).data_ptr<float>(), A(td).data_ptr<float>() + 3);  // view
  TensorDict e = td.index({Ellipsis, 0});
  EXPECT_EQ(e.batch_size(), at::IntArrayRef({4}));
  // The ellipsis covers batch dims only: leaf b keeps its feature dim.
  EXPECT_EQ(e.get("b").tensor().sizes(), at::IntArrayRef({4, 2}));
  EXPECT_EQ(X(e).sizes(), at::IntArrayRef({4, 2, 2}));
  TensorDict u = td.index({None});
  EXPECT_EQ(u.batch_size(), at::IntArrayRef({1, 4, 3}));
  EXPECT_THROW_MSG(td.index({0, 0, 0}), c10::IndexError, "too many indices");
}

TEST(TensorDictOps, IndexMaskAndTensor) {
  TensorDict td = sample();
  at::Tensor mask = at::tensor({1, 0, 1, 0}).to(at::kBool);
  TensorDict m = td.index({mask});
  EXPECT_EQ(m.batch_size(), at::IntArrayRef({2, 3}));
  EXPECT_TRUE(at::equal(A(m), A(td).index({mask})));
  EXPECT_TRUE(at::equal(X(m), X(td).index({mask})));
  at::Tensor full_mask = A(td) > 4;
  EXPECT_EQ(td.index({full_mask}).batch_size(), at::IntArrayRef({7}));
  at::Tensor idx = at::tensor({3, 0, 3}, at::kLong);
  TensorDict t = td.index({idx});
  EXPECT_EQ(t.batch_size(), at::IntArrayRef({3, 3}));
  EXPECT_TRUE(at::equal(t.get("b").tensor(), td.get("b").tensor().index({idx})));
  EXPECT_THROW(td.index({at::tensor({1, 0}).to(at::kBool)}), c10::Error);
}

TEST(TensorDictOps, Unbind) {
  TensorDict td = sample();
  auto parts = td.unbind(1);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[2].batch_size(), at::IntArrayRef({4}));
  EXPECT_TRUE(at::equal(A(parts[2]), A(td).select(1, 2)));
  EXPECT_EQ(parts[0].get("n").tensordict().batch_size(), at::IntArrayRef({4, 2}));
  EXPECT_EQ(td.unbind(-2).size(), 4u);
  EXPECT_THROW(td.unbind(2), c10::IndexError);
}

TEST(TensorDictOps, StackAndCat) {
  TensorDict a = sample();
  TensorDict b = sample().apply([](const at::Tensor& t) { return t + 100; });
  TensorDict s = tensordict::stack({a, b}, 1);
  EXPECT_EQ(s.batch_size(), at::IntArrayRef({4, 2, 3}));
  EXPECT_TRUE(at::equal(A(s), at::stack({A(a), A(b)}, 1)));
  EXPECT_EQ(s.get("n").tensordict().batch_size(), at::IntArrayRef({4, 2, 3, 2}));
  TensorDict c = tensordict::cat({a, b}, 0);
  EXPECT_EQ(c.batch_size(), at::IntArrayRef({8, 3}));
  EXPECT_TRUE(at::equal(X(c), at::cat({X(a), X(b)}, 0)));
  EXPECT_EQ(tensordict::cat({a, a.index({Slice(0, 2)})}, 0).batch_size(), at::IntArrayRef({6, 3}));

  TensorDict other({{"a", at::ones({4, 3})}}, {4, 3});
  EXPECT_THROW_MSG(tensordict::stack({a, other}), KeyError, "only in the first: ['b', 'n']");
  EXPECT_THROW_MSG(tensordict::cat({a, other}), KeyError, "keys mismatch");
  EXPECT_THROW_MSG(tensordict::stack({a, a.index({0})}), c10::ValueError,
                   "tensordict 1 has batch_size [3]");
  EXPECT_THROW_MSG(tensordict::cat({a, a.index({Slice(), Slice(0, 1)})}, 0), c10::ValueError,
                   "outside dim 0");
  EXPECT_THROW(tensordict::stack({}), c10::ValueError);
}

TEST(TensorDictOps, ReshapeViewExpand) {
  TensorDict td = sample();
  TensorDict r = td.reshape({12});
  EXPECT_EQ(r.batch_size(), at::IntArrayRef({12}));
  EXPECT_EQ(r.get("b").tensor().sizes(), at::IntArrayRef({12, 2}));
  EXPECT_EQ(X(r).sizes(), at::IntArrayRef({12, 2, 2}));
  EXPECT_EQ(r.get("n").tensordict().batch_size(), at::IntArrayRef({12, 2}));
  EXPECT_EQ(td.reshape({-1, 6}).batch_size(), at::IntArrayRef({2, 6}));
  TensorDict v = td.view({3, 4});
  EXPECT_EQ(A(v).data_ptr(), A(td).data_ptr());
  EXPECT_THROW_MSG(td.reshape({5}), c10::ValueError,
                   "invalid shape [5] for a batch of 12 elements");
  EXPECT_THROW_MSG(td.view({-1, -1}), c10::ValueError, "only one dimension can be inferred");

  TensorDict one({{"a", at::ones({1, 3})}}, {1});
  TensorDict e = one.expand({2, 5});
  EXPECT_EQ(e.batch_size(), at::IntArrayRef({2, 5}));
  EXPECT_EQ(A(e).sizes(), at::IntArrayRef({2, 5, 3}));
  EXPECT_EQ(A(e).stride(1), 0);
  EXPECT_EQ(td.expand({2, -1, -1}).batch_size(), at::IntArrayRef({2, 4, 3}));
  EXPECT_THROW_MSG(td.expand({5, 3}), c10::ValueError, "cannot be expanded");
  EXPECT_THROW(td.expand({3}), c10::ValueError);
}

TEST(TensorDictOps, UnsqueezeSqueeze) {
  TensorDict td = sample();
  TensorDict u = td.unsqueeze(-1);
  EXPECT_EQ(u.batch_size(), at::IntArrayRef({4, 3, 1}));
  EXPECT_EQ(u.get("b").tensor().sizes(), at::IntArrayRef({4, 3, 1, 2}));
  EXPECT_EQ(X(u).sizes(), at::IntArrayRef({4, 3, 1, 2, 2}));
  EXPECT_EQ(u.squeeze().batch_size(), at::IntArrayRef({4, 3}));
  EXPECT_EQ(u.squeeze(2).get("b").tensor().sizes(), at::IntArrayRef({4, 3, 2}));
  EXPECT_EQ(td.unsqueeze(0).squeeze(0).batch_size(), at::IntArrayRef({4, 3}));
  EXPECT_EQ(td.squeeze(0).batch_size(), at::IntArrayRef({4, 3}));  // size 4: unchanged
  EXPECT_THROW(td.unsqueeze(4), c10::IndexError);
}

TEST(TensorDictOps, Split) {
  TensorDict td = sample();
  auto parts = td.split(3, 0);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].batch_size(), at::IntArrayRef({3, 3}));
  EXPECT_EQ(parts[1].batch_size(), at::IntArrayRef({1, 3}));
  EXPECT_TRUE(at::equal(A(parts[1]), A(td).index({Slice(3, None)})));
  auto sized = td.split(at::IntArrayRef({1, 2}), 1);
  EXPECT_EQ(sized[1].batch_size(), at::IntArrayRef({4, 2}));
  EXPECT_EQ(sized[1].get("n").tensordict().batch_size(), at::IntArrayRef({4, 2, 2}));
  EXPECT_THROW_MSG(td.split(at::IntArrayRef({1, 1}), 1), c10::ValueError, "sum to 2");
  EXPECT_THROW(td.split(0), c10::ValueError);
}

TEST(TensorDictOps, CloneToContiguous) {
  TensorDict td = sample();
  TensorDict c = td.clone();
  EXPECT_FALSE(c.is_same(td));
  EXPECT_NE(A(c).data_ptr(), A(td).data_ptr());
  EXPECT_TRUE(c.allclose(td));
  A(c).fill_(0);
  EXPECT_FALSE(c.allclose(td));
  TensorDict d = td.to(at::kDouble);
  EXPECT_EQ(d.get("b").tensor().scalar_type(), at::kDouble);
  EXPECT_EQ(X(d).scalar_type(), at::kDouble);
  TensorDict cpu = td.to(at::Device("cpu"));
  EXPECT_EQ(cpu.device()->str(), "cpu");
  EXPECT_EQ(cpu.get("n").tensordict().device()->str(), "cpu");
  TensorDict t({{"a", at::ones({3, 4}).t()}}, {4});
  EXPECT_FALSE(A(t).is_contiguous());
  EXPECT_TRUE(A(t.contiguous()).is_contiguous());
}

TEST(TensorDictOps, ApplyAndApplyWithOther) {
  TensorDict td = sample();
  TensorDict doubled = td.apply([](const at::Tensor& t) { return t * 2; });
  EXPECT_TRUE(at::equal(X(doubled), X(td) * 2));
  TensorDict no_b = td.apply([](const at::Tensor& t) {
    return t.dim() == 3 && t.scalar_type() == at::kLong ? at::Tensor() : t;
  });
  EXPECT_FALSE(no_b.contains("b"));
  TensorDict sum =
      td.apply([](const at::Tensor& a, const at::Tensor& b) { return a + b; }, doubled);
  EXPECT_TRUE(at::equal(A(sum), A(td) * 3));
  TensorDict missing({{"a", at::ones({4, 3})}}, {4, 3});
  EXPECT_THROW(td.apply([](const at::Tensor& a, const at::Tensor& b) { return a; }, missing),
               KeyError);
  EXPECT_THROW_MSG(td.apply([](const at::Tensor& t) { return t.sum(); }), c10::ValueError,
                   "batch size mismatch: key 'a' has shape []");
}

TEST(TensorDictOps, UpdateReplaceAndInPlace) {
  TensorDict td = sample();
  at::Tensor old_a = A(td);
  TensorDict src({{"a", at::zeros({4, 3})}, {"new", at::ones({4, 3})}}, {4, 3});
  src.set({"n", "y"}, at::ones({4, 3, 2}));
  td.update(src);
  EXPECT_FALSE(A(td).is_same(old_a));
  EXPECT_TRUE(A(td).is_same(A(src)));
  EXPECT_TRUE(td.contains("new"));
  EXPECT_TRUE(td.contains({"n", "x"}));  // merged, not replaced
  EXPECT_TRUE(td.contains({"n", "y"}));

  TensorDict td2 = sample();
  at::Tensor a2 = A(td2);
  td2.update(src, {.inplace = true});
  EXPECT_TRUE(A(td2).is_same(a2));
  EXPECT_EQ(a2.sum().item<float>(), 0.0f);

  TensorDict td3 = sample();
  td3.update(src, {.clone = true});
  EXPECT_FALSE(A(td3).is_same(A(src)));
}

TEST(TensorDictOps, ZeroFill) {
  TensorDict td = sample();
  td.fill_("a", 3);
  EXPECT_TRUE((A(td) == 3).all().item<bool>());
  td.fill_("n", 1.5);
  EXPECT_TRUE((X(td) == 1.5).all().item<bool>());
  td.zero_();
  EXPECT_FALSE(td.any());
  EXPECT_THROW(td.fill_("nope", 1), KeyError);
}

TEST(TensorDictOps, ComparisonsAllAny) {
  TensorDict td = sample();
  TensorDict eq = td == td.clone();
  EXPECT_EQ(eq.batch_size(), td.batch_size());
  EXPECT_EQ(eq.get({"n", "x"}).tensor().scalar_type(), at::kBool);
  EXPECT_TRUE(eq.all());
  TensorDict other = td.clone();
  A(other)[0][0] = 100;
  TensorDict ne = td != other;
  EXPECT_TRUE(ne.any());
  EXPECT_FALSE(ne.all());
  EXPECT_FALSE((td == other).all());
  EXPECT_TRUE((td == 0).any());  // a[0][0] == 0
  EXPECT_FALSE((td == 0).all());
  EXPECT_TRUE((td != -5).all());
  TensorDict fewer({{"a", at::ones({4, 3})}}, {4, 3});
  EXPECT_THROW_MSG(td == fewer, KeyError, "keys mismatch");
}

TEST(TensorDictOps, Allclose) {
  TensorDict td = sample();
  TensorDict near =
      td.apply([](const at::Tensor& t) { return t.is_floating_point() ? t * (1 + 1e-6) : t; });
  EXPECT_TRUE(td.allclose(near));
  EXPECT_FALSE(td.allclose(near, 0, 0));
  TensorDict nan({{"a", at::full({2}, NAN)}}, {2});
  EXPECT_FALSE(nan.allclose(nan));
  EXPECT_TRUE(nan.allclose(nan, 1e-5, 1e-8, true));
  EXPECT_FALSE(td.allclose(TensorDict({{"a", A(td)}}, {4, 3})));
}

// ---- non-tensor entries: the data is kept, the batch size follows the level's -------------------

namespace {

using tensordict::JsonValue;
using tensordict::NonTensorData;
using tensordict::Value;

// sample() plus "s" at the root and "t" (with one extra batch dim) in the nested level.
TensorDict with_non_tensors() {
  TensorDict td = sample();
  td.set_non_tensor("s", "hello");
  td.set({"n", "t"}, NonTensorData(JsonValue::list({1, nullptr}), {4, 3, 2, 5}));
  return td;
}

std::vector<int64_t> nt_batch(const TensorDict& td, const NestedKey& key) {
  return td.get(key).non_tensor().batch_size().vec();
}

}  // namespace

TEST(TensorDictOpsNonTensor, BatchOperationsKeepTheData) {
  const TensorDict td = with_non_tensors();
  using V = std::vector<int64_t>;
  TensorDict i = td.index({1});
  EXPECT_EQ(i.get_non_tensor("s"), JsonValue("hello"));
  EXPECT_EQ(nt_batch(i, "s"), V({3}));
  EXPECT_EQ(nt_batch(i, {"n", "t"}), V({3, 2, 5}));
  EXPECT_EQ(nt_batch(td.index({Slice(1, None), None}), "s"), V({3, 1, 3}));
  auto parts = td.unbind(1);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(nt_batch(parts[2], "s"), V({4}));
  EXPECT_EQ(parts[2].get_non_tensor({"n", "t"}), JsonValue::list({1, nullptr}));
  EXPECT_EQ(nt_batch(td.reshape({12}), {"n", "t"}), V({12, 2, 5}));
  EXPECT_EQ(nt_batch(td.view({-1}), "s"), V({12}));
  EXPECT_EQ(nt_batch(td.expand({2, 4, 3}), "s"), V({2, 4, 3}));
  EXPECT_EQ(nt_batch(td.unsqueeze(0), "s"), V({1, 4, 3}));
  EXPECT_EQ(nt_batch(td.unsqueeze(0).squeeze(), "s"), V({4, 3}));
  auto halves = td.split(3, 0);
  EXPECT_EQ(nt_batch(halves[1], {"n", "t"}), V({1, 3, 2, 5}));
}

TEST(TensorDictOps, LevelsTwoDeepKeepTheirExtraBatchDims) {
  TensorDict td = sample();
  td.set({"n", "m"}, TensorDict({{"y", at::zeros({4, 3, 2, 7})}}, {4, 3, 2, 7}));
  EXPECT_EQ(td.index({1}).get({"n", "m"}).tensordict().batch_size(), at::IntArrayRef({3, 2, 7}));
  EXPECT_EQ(td.reshape({12}).get({"n", "m"}).tensordict().batch_size(),
            at::IntArrayRef({12, 2, 7}));
}

// As the reference: stacking gives a NonTensorStack of the entries, equal or not (tensordict
// 0.15.3's default, capture_non_tensor_stack() False); cat keeps an entry that is the same in
// every part and stacks the elements otherwise.
TEST(TensorDictOpsNonTensor, StackMakesNonTensorStacks) {
  const TensorDict a = with_non_tensors();
  const TensorDict b = with_non_tensors();
  using V = std::vector<int64_t>;
  TensorDict s = tensordict::stack({a, b}, 1);
  EXPECT_EQ(nt_batch(s, "s"), V({4, 2, 3}));
  EXPECT_EQ(nt_batch(s, {"n", "t"}), V({4, 2, 3, 2, 5}));
  const NonTensorData st = s.get("s").non_tensor();
  EXPECT_TRUE(st.is_stack());
  EXPECT_EQ(st.stack_dim(), 1);
  ASSERT_EQ(st.members().size(), 2u);
  EXPECT_EQ(st.members()[0].data(), JsonValue("hello"));
  EXPECT_EQ(st.common_data(), JsonValue("hello"));
  EXPECT_EQ(s.index({0, 1, 2}).get_non_tensor("s"), JsonValue("hello"));
  TensorDict c = tensordict::cat({a, b}, 0);
  EXPECT_EQ(nt_batch(c, "s"), V({8, 3}));
  EXPECT_FALSE(c.get("s").non_tensor().is_stack());
  EXPECT_EQ(nt_batch(c, {"n", "t"}), V({8, 3, 2, 5}));

  TensorDict other = with_non_tensors();
  other.set({"n", "t"}, NonTensorData("different", {4, 3, 2, 5}));
  TensorDict mixed = tensordict::stack({a, other});
  const auto members = mixed.get({"n", "t"}).non_tensor().members();
  EXPECT_EQ(members[1].data(), JsonValue("different"));
  EXPECT_EQ(members[0].data(), JsonValue::list({1, nullptr}));
  TensorDict joined = tensordict::cat({a, other});
  EXPECT_EQ(nt_batch(joined, {"n", "t"}), V({8, 3, 2, 5}));
  const NonTensorData j = joined.get({"n", "t"}).non_tensor();
  EXPECT_EQ(j.unbind(0)[5].tolist().at(0).at(1).at(4), JsonValue("different"));
  EXPECT_EQ(j.unbind(0)[3].tolist().at(0).at(1).at(4), JsonValue::list({1, nullptr}));
  TensorDict tensor_there = with_non_tensors();
  tensor_there.set("s", at::zeros({4, 3}));
  EXPECT_THROW_MSG(tensordict::stack({a, tensor_there}), c10::TypeError,
                   "key 's' is a non-tensor entry in tensordict 0 but a tensor");
  EXPECT_THROW_MSG(tensordict::stack({tensor_there, a}), c10::TypeError,
                   "key 's' is a tensor in tensordict 0 but a non-tensor entry");
}

TEST(TensorDictOpsNonTensor, TensorLikeOperations) {
  TensorDict td = with_non_tensors();
  TensorDict c = td.clone();
  EXPECT_EQ(c.get_non_tensor("s"), JsonValue("hello"));
  c.set_non_tensor("s", "changed");
  EXPECT_EQ(td.get_non_tensor("s"), JsonValue("hello"));  // independent copies

  TensorDict moved = td.to(at::Device(at::kCPU));
  EXPECT_EQ(moved.get("s").non_tensor().device(), at::Device(at::kCPU));
  EXPECT_EQ(moved.get({"n", "t"}).non_tensor().device(), at::Device(at::kCPU));
  EXPECT_EQ(td.to(at::kDouble).get_non_tensor("s"), JsonValue("hello"));
  EXPECT_EQ(td.contiguous().get_non_tensor("s"), JsonValue("hello"));

  // apply passes non-tensor entries through, as the reference does.
  TensorDict doubled = td.apply([](const at::Tensor& t) { return t * 2; });
  EXPECT_EQ(doubled.get_non_tensor({"n", "t"}), JsonValue::list({1, nullptr}));
  TensorDict summed = td.apply([](const at::Tensor& x, const at::Tensor& y) { return x + y; }, td);
  EXPECT_EQ(summed.get_non_tensor("s"), JsonValue("hello"));

  td.zero_();  // skips them
  EXPECT_EQ(td.get_non_tensor("s"), JsonValue("hello"));
  EXPECT_THROW_MSG(td.fill_("s", 1), c10::TypeError, "key 's' holds a non-tensor entry");
  td.fill_("n", 3);  // the nested level's tensors only

  TensorDict target({}, {4, 3});
  target.update(with_non_tensors());
  EXPECT_EQ(target.get_non_tensor({"n", "t"}), JsonValue::list({1, nullptr}));
  target.set("s", at::zeros({4, 3}));
  target.update(with_non_tensors(), {.inplace = true});  // replaces the tensor by the entry
  EXPECT_TRUE(target.get("s").is_non_tensor());
}

TEST(TensorDictOpsNonTensor, Comparisons) {
  const TensorDict a = with_non_tensors();
  TensorDict b = with_non_tensors();
  TensorDict eq = a == b;
  // Like the reference's NonTensorData.__eq__: a bool tensor of the entry's batch size.
  EXPECT_TRUE(at::equal(eq.get("s").tensor(), at::ones({4, 3}, at::kBool)));
  EXPECT_EQ(eq.get({"n", "t"}).tensor().sizes(), at::IntArrayRef({4, 3, 2, 5}));
  EXPECT_TRUE(eq.all());
  EXPECT_TRUE(a.allclose(b));
  b.set_non_tensor("s", "other");
  EXPECT_FALSE((a == b).all());
  EXPECT_TRUE((a != b).get("s").tensor().all().item<bool>());
  EXPECT_FALSE(a.allclose(b));
  // A comparison with a scalar leaves them out.
  EXPECT_FALSE((a == 0).contains("s"));
  EXPECT_TRUE((a == 0).contains({"n", "x"}));
  b.set("s", at::zeros({4, 3}));
  EXPECT_THROW_MSG(a == b, c10::TypeError, "key 's' is a non-tensor entry in the first");
}

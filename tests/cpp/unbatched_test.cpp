// Unbatched leaves (Value::unbatched, the reference's UnbatchedTensor): the leaf ignores the
// batch size, passes whole through batch operations, is transformed by value operations (and
// stays unbatched), and is refused by consolidate() and memmap() with the reference's messages.
// Per-leaf transfers of it are in dist_receivers_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "expect_throw.h"
#include "tensordict/consolidate.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/memmap.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {
namespace {

using at::indexing::Slice;

at::Tensor u_values() { return at::arange(6, at::kFloat).view({2, 3}); }

// batch [4]; "u" is [2, 3] (no batch prefix), as are "n.u2".
TensorDict sample() {
  TensorDict n({{"b", at::zeros({4, 1})}, {"u2", Value::unbatched(u_values() * 10)}}, {4});
  return TensorDict({{"a", at::arange(20, at::kFloat).view({4, 5})},
                     {"u", Value::unbatched(u_values())},
                     {"n", n}},
                    {4});
}

// "u" (and "n.u2") is still the unbatched [2, 3] leaf with its original values (times `mul`).
void expect_untouched(const TensorDict& td, double mul = 1.0) {
  ASSERT_TRUE(td.contains("u"));
  const Value u = td.get("u");
  EXPECT_TRUE(u.is_unbatched());
  EXPECT_TRUE(at::equal(u.tensor(), u_values() * mul)) << u.tensor();
  if (td.contains({"n", "u2"})) {
    const Value u2 = td.get({"n", "u2"});
    EXPECT_TRUE(u2.is_unbatched());
    EXPECT_TRUE(at::equal(u2.tensor(), u_values() * 10 * mul));
  }
}

TEST(Unbatched, IgnoresTheBatchSize) {
  TensorDict td = sample();
  EXPECT_TRUE(td.get("u").is_unbatched());
  EXPECT_FALSE(td.get("a").is_unbatched());
  EXPECT_FALSE(Value(at::ones({2})).is_unbatched());
  // The same shape as a plain leaf is refused: it does not start with the batch size.
  EXPECT_THROW(td.set("plain", at::zeros({2, 3})), c10::ValueError);
  // A batch size the unbatched leaf could not have is fine; the other leaves still check it.
  td.set_batch_size({});
  EXPECT_EQ(td.batch_dims(), 0);
  expect_untouched(td);
  TensorDict flat({{"a", at::zeros({4, 5})}, {"u", Value::unbatched(at::zeros({7}))}}, {4});
  flat.set_batch_size({4, 5});
  EXPECT_EQ(flat.batch_size(), at::IntArrayRef({4, 5}));
  EXPECT_THROW(flat.set_batch_size({3}), c10::ValueError);  // "a" refuses
  // A zero-dim unbatched leaf too.
  flat.set("s", Value::unbatched(at::tensor(3.0)));
  EXPECT_TRUE(flat.get("s").is_unbatched());
}

TEST(Unbatched, PassesWholeThroughIndexing) {
  const TensorDict td = sample();
  expect_untouched(td.index({1}));
  expect_untouched(td.index({Slice(1, 3)}));
  expect_untouched(td.index({at::tensor({0, 3, 3}, at::kLong)}));
  expect_untouched(td.index({at::tensor({1, 0, 1, 1}, at::kByte).to(at::kBool)}));
  EXPECT_EQ(td.index({Slice(1, 3)}).get("a").tensor().size(0), 2);
  for (const auto& part : td.unbind(0)) expect_untouched(part);
  for (const auto& part : td.split(3, 0)) expect_untouched(part);
  for (const auto& part : td.chunk(2, 0)) expect_untouched(part);
  // The leaf itself, not a copy.
  EXPECT_EQ(td.index({Slice(1, 3)}).get("u").tensor().data_ptr(), td.get("u").tensor().data_ptr());
}

TEST(Unbatched, PassesWholeThroughShapeOperations) {
  const TensorDict td = sample();
  const TensorDict r = td.reshape({2, 2});
  EXPECT_EQ(r.batch_size(), at::IntArrayRef({2, 2}));
  expect_untouched(r);
  expect_untouched(td.view({2, 2}));
  expect_untouched(td.unsqueeze(0));
  expect_untouched(td.unsqueeze(0).squeeze(0));
  expect_untouched(td.expand({3, 4}));
  EXPECT_EQ(td.expand({3, 4}).batch_size(), at::IntArrayRef({3, 4}));
  expect_untouched(td.reshape({2, 2}).flatten(0, 1));
  expect_untouched(td.unflatten(0, {2, 2}));
  const TensorDict two({{"a", at::zeros({4, 5, 6})}, {"u", Value::unbatched(u_values())}}, {4, 5});
  const TensorDict p = two.permute({1, 0});
  EXPECT_EQ(p.batch_size(), at::IntArrayRef({5, 4}));
  EXPECT_EQ(p.get("a").tensor().sizes(), at::IntArrayRef({5, 4, 6}));
  expect_untouched(p);
  expect_untouched(two.transpose(0, 1));
}

TEST(Unbatched, StackAndCatKeepTheFirstOnesLeaf) {
  const TensorDict a = sample();
  TensorDict b = sample();
  const TensorDict s = stack(std::vector<TensorDict>{a, b}, 0);
  EXPECT_EQ(s.batch_size(), at::IntArrayRef({2, 4}));
  EXPECT_EQ(s.get("a").tensor().sizes(), at::IntArrayRef({2, 4, 5}));
  expect_untouched(s);
  const TensorDict c = cat(std::vector<TensorDict>{a, b}, 0);
  EXPECT_EQ(c.batch_size(), at::IntArrayRef({8}));
  expect_untouched(c);
  // A lazy stack reads it whole too (member 0's).
  const TensorDict lazy = lazy_stack({a, b}, 0);
  expect_untouched(lazy);
  EXPECT_EQ(lazy.get("a").tensor().sizes(), at::IntArrayRef({2, 4, 5}));
}

TEST(Unbatched, ValueOperationsApplyAndKeepItUnbatched) {
  const TensorDict td = sample();
  expect_untouched(td.apply([](const at::Tensor& t) { return t * 2; }), 2.0);
  expect_untouched(td.apply([](const at::Tensor& t, const at::Tensor& o) { return t + o; }, td),
                   2.0);
  expect_untouched(td.named_apply([](const NestedKey&, const at::Tensor& t) { return t * 3; }),
                   3.0);
  const TensorDict cl = td.clone();
  expect_untouched(cl);
  EXPECT_NE(cl.get("u").tensor().data_ptr(), td.get("u").tensor().data_ptr());
  const TensorDict d = td.to(at::kDouble);
  EXPECT_EQ(d.get("u").tensor().scalar_type(), at::kDouble);
  EXPECT_TRUE(d.get("u").is_unbatched());
  expect_untouched(td.detach());
  expect_untouched(td.contiguous());
  expect_untouched(td * 2.0, 2.0);
  const TensorDict eq = td == td;
  EXPECT_TRUE(eq.get("u").is_unbatched());
  EXPECT_TRUE(eq.all());
  // update() carries the kind along (with and without clone).
  for (bool clone : {false, true}) {
    TensorDict other({{"a", at::zeros({4, 5})}}, {4});
    other.update(td, {.clone = clone});
    EXPECT_TRUE(other.get("u").is_unbatched());
    EXPECT_TRUE(other.get({"n", "u2"}).is_unbatched());
  }
  // In place.
  TensorDict m = sample();
  m.apply_([](const at::Tensor& t) { return t.mul_(4); });
  expect_untouched(m, 4.0);
}

TEST(Unbatched, ConsolidateRefusesWithTheReferencesMessage) {
  TensorDict td({{"a", at::zeros({4})}, {"u", Value::unbatched(at::zeros({2}))}}, {4});
  try {
    consolidate(td);
    ADD_FAILURE() << "expected NotImplementedError";
  } catch (const c10::NotImplementedError& e) {
    EXPECT_EQ(e.msg(), "UnbatchedTensor entries cannot be consolidated yet, but 'u' is one.");
  }
  // Nested: the path, as the reference writes a tuple key.
  TensorDict nested({{"n", sample()}}, {4});
  nested.erase({"n", "u"});
  try {
    consolidate(nested);
    ADD_FAILURE() << "expected NotImplementedError";
  } catch (const c10::NotImplementedError& e) {
    EXPECT_EQ(e.msg(),
              "UnbatchedTensor entries cannot be consolidated yet, but ('n', 'n', 'u2') is one.");
  }
  // Without it, it consolidates.
  EXPECT_TRUE(is_consolidated(consolidate(td.exclude({"u"}))));
}

TEST(Unbatched, MemmapRefuses) {
  TensorDict td({{"a", at::zeros({4})}, {"u", Value::unbatched(at::zeros({2}))}}, {4});
  EXPECT_THROW_MSG(memmap(td), c10::NotImplementedError,
                   "UnbatchedTensor entries cannot be memory-mapped yet, but 'u' is one. Exclude "
                   "it first, e.g. with td.exclude('u').");
}

}  // namespace
}  // namespace tensordict

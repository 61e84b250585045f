// The everyday methods of TensorDict (docs/api-coverage.md) in C++: each against the torch
// computation it stands for, on a TensorDict with a nested level and on a lazy stack.
// tests/python/test_methods.py runs the same calls against the reference.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "expect_throw.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {
namespace {

using at::indexing::Slice;

TensorDict sample() {
  at::manual_seed(0);
  return TensorDict({{"a", at::randn({2, 3})},
                     {"i", at::arange(6, at::kLong).view({2, 3})},
                     {{"n", "x"}, at::randn({2, 3, 4})}},
                    {2, 3});
}

at::Tensor leaf(const TensorDict& td, const NestedKey& k) { return td.get(k).tensor(); }

TEST(Methods, SelectExcludeAndKeys) {
  const TensorDict td = sample();
  const TensorDict s = td.select({"a", {"n", "x"}});
  EXPECT_EQ(s.keys({.include_nested = true, .leaves_only = true}),
            (std::vector<NestedKey>{"a", {"n", "x"}}));
  EXPECT_TRUE(leaf(s, "a").is_same(leaf(td, "a")));  // shared, not copied
  EXPECT_THROW_MSG(td.select({"zz"}), KeyError, "zz");
  EXPECT_EQ(td.select({"zz", "a"}, {.strict = false}).keys(), (std::vector<NestedKey>{"a"}));
  EXPECT_EQ(td.exclude({"a", {"n", "x"}, "zz"}).keys({.include_nested = true}),
            (std::vector<NestedKey>{"i", "n"}));
  TensorDict copy = td.copy();
  copy.select({"i"}, {.inplace = true});
  EXPECT_EQ(copy.keys(), (std::vector<NestedKey>{"i"}));
  EXPECT_EQ(td.keys().size(), 3u);  // the source keeps its keys

  const TensorDict flat = td.flatten_keys();
  EXPECT_TRUE(flat.contains("n.x"));
  EXPECT_TRUE(leaf(flat.unflatten_keys(), {"n", "x"}).is_same(leaf(td, {"n", "x"})));
  TensorDict r = td.copy();
  r.rename_key_("a", {"n", "b"});
  EXPECT_FALSE(r.contains("a"));
  EXPECT_TRUE(leaf(r, {"n", "b"}).is_same(leaf(td, "a")));
  EXPECT_THROW_MSG(r.rename_key_("i", {"n", "b"}, true), KeyError, "already present");
  EXPECT_TRUE(r.setdefault("z", at::zeros({2, 3})).tensor().eq(0).all().item<bool>());
  EXPECT_TRUE(r.setdefault("i", at::zeros({2, 3})).tensor().is_same(leaf(td, "i")));
  EXPECT_FALSE(td.empty().contains("a"));
  EXPECT_TRUE(td.empty(true).get("n").tensordict().keys().empty());
}

TEST(Methods, KeysWithIsLeafAndFind) {
  TensorDict td = sample();
  td.set_non_tensor("tag", "x");
  // The reference's is_leaf: nested levels are entered whatever it says, and what it calls a
  // leaf is listed after its own entries.
  KeysOptions options{.include_nested = true, .leaves_only = true};
  options.is_leaf = [](const Value& v) { return !v.is_non_tensor(); };
  EXPECT_EQ(td.keys(options), (std::vector<NestedKey>{"a", "i", {"n", "x"}, "n"}));
  options.is_leaf = [](const Value& v) { return v.is_non_tensor(); };
  EXPECT_EQ(td.keys(options), (std::vector<NestedKey>{"tag"}));
  // find: a one-part key of this level, without copy or KeyError.
  ASSERT_NE(td.find("a"), nullptr);
  EXPECT_TRUE(td.find("a")->tensor().is_same(leaf(td, "a")));
  EXPECT_TRUE(td.find("n")->is_tensordict());
  EXPECT_EQ(td.find("zz"), nullptr);
  EXPECT_EQ(td.find("n.x"), nullptr);
  EXPECT_EQ(lazy_stack({td.get("n").tensordict(), td.get("n").tensordict()}).find("x"), nullptr);
}

TEST(Methods, ApplyWithABatchSize) {
  const TensorDict td = sample();
  // A function that drops the batch dims: the result gets the batch size asked for.
  const TensorDict flat = td.apply([](const at::Tensor& t) { return t.flatten(0, 1); },
                                   {.batch_size = std::vector<int64_t>{6}});
  EXPECT_EQ(flat.batch_size(), at::IntArrayRef({6}));
  EXPECT_EQ(flat.get("n").tensordict().batch_size(), at::IntArrayRef({6}));
  EXPECT_TRUE(leaf(flat, {"n", "x"}).equal(leaf(td, {"n", "x"}).flatten(0, 1)));
  const TensorDict sum =
      td.apply([](const at::Tensor& a, const at::Tensor& b) { return (a + b).sum(0); }, td,
               {.batch_size = std::vector<int64_t>{3}});
  EXPECT_TRUE(leaf(sum, "i").equal((leaf(td, "i") * 2).sum(0)));
  EXPECT_THROW_MSG(
      td.apply([](const at::Tensor& t) { return t; }, {.batch_size = std::vector<int64_t>{5}}),
      c10::ValueError, "batch");
}

TEST(Methods, InPlaceWritesLandInTheLeaves) {
  TensorDict td = sample().exclude({"i"});  // float leaves: lerp_ and a float mul_
  const at::Tensor a = leaf(td, "a");
  td.update_(TensorDict({{"a", at::full({2, 3}, 4.0)}}, {2, 3}));
  EXPECT_TRUE(a.eq(4).all().item<bool>());
  EXPECT_THROW_MSG(td.update_(TensorDict({{"zz", at::zeros({2, 3})}}, {2, 3})), KeyError, "zz");
  td.set_at_("a", at::scalar_tensor(9.0), {1, Slice(0, 2)});
  EXPECT_EQ(a[1][1].item<double>(), 9);
  EXPECT_EQ(td.get_at("a", {1, 0}).item<double>(), 9);
  td.masked_fill_(at::tensor({1, 0}).to(at::kBool).view({2, 1}).expand({2, 3}), -1);
  EXPECT_TRUE(leaf(td, {"n", "x"})[0].eq(-1).all().item<bool>());
  td.copy_(td.clone().zero_());
  EXPECT_TRUE(a.eq(0).all().item<bool>());
  td.apply_([](const at::Tensor& t) { return t + 2; });
  EXPECT_TRUE(a.eq(2).all().item<bool>());
  td.add_(at::ones({}), 3);
  td.mul_(2);
  EXPECT_TRUE(a.eq(10).all().item<bool>());
  TensorDict other = td.clone();
  td.lerp_(other.zero_(), 0.5);
  EXPECT_TRUE(a.eq(5).all().item<bool>());
  TensorDict grads({{"w", at::ones({2}).requires_grad_().view({2})}}, {2});  // a view
  grads.detach_();
  EXPECT_FALSE(leaf(grads, "w").requires_grad());
}

TEST(Methods, ShapeOperations) {
  const TensorDict td = sample();
  EXPECT_EQ(td.flatten().batch_size(), at::IntArrayRef({6}));
  EXPECT_TRUE(at::equal(leaf(td.flatten(), {"n", "x"}), leaf(td, {"n", "x"}).flatten(0, 1)));
  EXPECT_EQ(td.flatten().unflatten(0, {3, -1}).batch_size(), at::IntArrayRef({3, 2}));
  const TensorDict p = td.permute({1, 0});
  EXPECT_TRUE(at::equal(leaf(p, {"n", "x"}), leaf(td, {"n", "x"}).permute({1, 0, 2})));
  EXPECT_TRUE(at::equal(leaf(td.transpose(0, 1), "a"), leaf(td, "a").t()));
  EXPECT_THROW_MSG(td.permute({0, 0}), c10::ValueError, "repeated dim");
  EXPECT_THROW_MSG(td.transpose(0, 2), c10::ValueError, "range of the batch dims");
  const auto chunks = td.chunk(2, 1);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1].batch_size(), at::IntArrayRef({2, 1}));
}

TEST(Methods, ValuesReductionsAndArithmetic) {
  const TensorDict td = sample();
  const at::Tensor a = leaf(td, "a"), x = leaf(td, {"n", "x"});
  const at::Tensor mask = at::tensor({1, 0, 1}).to(at::kBool).view({1, 3}).expand({2, 3});
  EXPECT_TRUE(at::equal(leaf(td.masked_fill(mask, 0), {"n", "x"}),
                        x.masked_fill(mask.unsqueeze(-1).expand_as(x), 0)));
  EXPECT_TRUE(at::equal(leaf(td.where(mask, 7), "a"), at::where(mask, a, 7)));
  EXPECT_TRUE(at::equal(leaf(td.where(mask, td * 0), "a"), at::where(mask, a, a * 0)));
  EXPECT_TRUE(at::equal(leaf(td.abs(), "a"), a.abs()));
  EXPECT_TRUE(leaf(td.isfinite(), "a").all().item<bool>());
  EXPECT_EQ(td.sum().batch_size(), at::IntArrayRef({}));
  EXPECT_TRUE(at::allclose(leaf(td.sum(), {"n", "x"}), x.sum()));
  EXPECT_TRUE(at::allclose(leaf(td.sum({.dims = {0}}), {"n", "x"}), x.sum(0)));
  EXPECT_EQ(td.exclude({"i"}).mean({.dims = {-1}, .keepdim = true}).batch_size(),
            at::IntArrayRef({2, 1}));
  EXPECT_TRUE(at::allclose(leaf(td.sum({.dims = {}, .feature = true}), {"n", "x"}), x.sum(-1)));
  EXPECT_TRUE(
      at::allclose(leaf(td.exclude({"i"}).std({.dims = {1}, .correction = 0}), "a"), a.std(1, 0)));
  auto [values, indices] = td.max({.dims = {1}});
  ASSERT_TRUE(indices.has_value());
  EXPECT_TRUE(at::equal(leaf(*indices, "a"), std::get<1>(a.max(1))));
  EXPECT_FALSE(td.min().second.has_value());
  const TensorDict floats = td.exclude({"i"});
  EXPECT_TRUE(at::allclose(floats.reduce_all(Reduction::kSum), a.sum() + x.sum()));
  EXPECT_TRUE(at::allclose(floats.reduce_all(Reduction::kMax), at::max(a.max(), x.max())));
  EXPECT_TRUE(at::equal(leaf(td + td, "a"), a + a));
  EXPECT_TRUE(at::equal(leaf(td - 1, "a"), a - 1));
  EXPECT_TRUE(at::equal(leaf(td * at::full({}, 2.0), "a"), a * 2));
  EXPECT_TRUE(at::equal(leaf(td / 4, "i"), leaf(td, "i") / 4));
  EXPECT_FALSE(td.is_shared());
  TensorDict shared = td.clone();
  shared.share_memory_();
  EXPECT_TRUE(shared.is_shared() && shared.is_locked());
  EXPECT_TRUE(at::equal(leaf(shared, "a"), a));
  EXPECT_TRUE(td.named_apply([](const NestedKey& k,
                                const at::Tensor& t) { return k.size() == 2 ? t : at::Tensor(); },
                             true)
                  .keys({.include_nested = true, .leaves_only = true}) ==
              (std::vector<NestedKey>{{"n", "x"}}));
}

TEST(Methods, OnALazyStack) {
  TensorDict a({{"x", at::zeros({3})}, {"y", at::zeros({3, 2})}}, {3});
  TensorDict b({{"x", at::ones({3})}, {"y", at::ones({3, 4})}}, {3});
  LazyStackedTensorDict s({a, b}, 0);
  s.masked_fill_(at::tensor({1, 0}).to(at::kBool).view({2, 1}).expand({2, 3}), 5);
  EXPECT_TRUE(a.get("y").tensor().eq(5).all().item<bool>());
  EXPECT_TRUE(b.get("y").tensor().eq(1).all().item<bool>());
  s.set_at_("x", at::scalar_tensor(7.0), {1, 0});
  EXPECT_EQ(b.get("x").tensor()[0].item<double>(), 7);  // written into the member
  EXPECT_TRUE(s.select({"x"}).is_lazy_stack());
  s.mul_(2);
  EXPECT_EQ(b.get("y").tensor()[0][0].item<double>(), 2);
  EXPECT_EQ(s.select({"x"}).transpose(0, 1).batch_size(), at::IntArrayRef({3, 2}));  // dense
}

TEST(Methods, UnflattenKeysRefusesToOverwriteAsTheReference) {
  // "a.b" then "a" (and the reverse): one would replace the other; the reference's KeyError.
  for (const bool leaf_first : {false, true}) {
    std::vector<TensorDict::Entry> entries{{"a.b", at::zeros({1})}, {"a", at::ones({1})}};
    if (leaf_first) std::swap(entries[0], entries[1]);
    const TensorDict td(std::move(entries));
    EXPECT_THROW_MSG(td.unflatten_keys(), KeyError,
                     "will override an existing for unflattened key ('a', 'b').");
  }
  // A level and a dotted key under it merge.
  TensorDict td;
  td.set({"a", "c"}, at::ones({1}));
  td.set("a.b", at::zeros({1}));
  EXPECT_EQ(td.unflatten_keys().keys({.include_nested = true, .leaves_only = true}).size(), 2u);
}

}  // namespace
}  // namespace tensordict

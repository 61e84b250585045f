// Entries, keys, batch size, device, locking: the dictionary side of TensorDict.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>

#include "expect_throw.h"
#include "tensordict/tensordict.h"

using tensordict::BatchSizeError;
using tensordict::KeyError;
using tensordict::NestedKey;
using tensordict::TensorDict;
using tensordict::Value;

namespace {

TensorDict sample() {
  TensorDict td({{"a", at::ones({4})}, {"b", at::ones({4, 3})}}, {4});
  td.set({"c", "d"}, at::zeros({4, 2}, at::kLong));
  return td;
}

std::vector<std::string> strs(const std::vector<NestedKey>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(k.str());
  return out;
}

}  // namespace

TEST(TensorDict, EmptyDefaults) {
  TensorDict td;
  EXPECT_EQ(td.batch_size().size(), 0u);
  EXPECT_EQ(td.batch_dims(), 0);
  EXPECT_EQ(td.numel(), 1);
  EXPECT_FALSE(td.device().has_value());
  EXPECT_TRUE(td.is_empty());
  EXPECT_TRUE(td.keys().empty());
  EXPECT_TRUE(td.all());
  EXPECT_FALSE(td.any());
}

TEST(TensorDict, ConstructFromListKeepsInsertionOrder) {
  TensorDict td({{"z", at::ones({2})}, {"a", at::ones({2})}, {"m", at::ones({2, 5})}}, {2});
  EXPECT_EQ(strs(td.keys()), (std::vector<std::string>{"'z'", "'a'", "'m'"}));
  EXPECT_EQ(td.sorted_keys(), (std::vector<std::string>{"a", "m", "z"}));
  EXPECT_EQ(td.batch_size(), at::IntArrayRef({2}));
  EXPECT_EQ(td.numel(), 2);
}

TEST(TensorDict, ConstructWithNestedKeysMakesLevels) {
  // As the reference's TensorDict({("a", "b"): x, "c": y, ("a", "d", "e"): z}, [2]).
  TensorDict td(
      {{{"a", "b"}, at::arange(2)}, {"c", at::ones({2})}, {{"a", "d", "e"}, at::ones({2, 3})}},
      {2});
  EXPECT_EQ(
      strs(td.keys({.include_nested = true})),
      (std::vector<std::string>{"('a', 'b')", "('a', 'd', 'e')", "('a', 'd')", "'a'", "'c'"}));
  EXPECT_EQ(td.get("a").tensordict().batch_size(), at::IntArrayRef({2}));
  EXPECT_EQ(td.get({"a", "d"}).tensordict().batch_size(), at::IntArrayRef({2}));
  EXPECT_EQ(td.get({"a", "b"}).tensor()[1].item<int64_t>(), 1);
  // The entries of another TensorDict still construct one (a template: braced lists above).
  TensorDict copy(td.entries(), {2});
  EXPECT_TRUE(copy.get("a").tensordict().is_same(td.get("a").tensordict()));
  EXPECT_THROW_MSG(TensorDict({{{"a", "b"}, at::ones({3})}}, {2}), c10::ValueError,
                   "key ('a', 'b') has shape [3], which does not start with [2]");
}

TEST(TensorDict, ConstructFromMap) {
  std::map<std::string, Value> m{{"b", at::ones({3})}, {"a", at::zeros({3})}};
  TensorDict td(m, {3});
  EXPECT_EQ(td.sorted_keys(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(td.get("a").tensor().eq(0).all().item<bool>());
}

TEST(TensorDict, BatchMismatchNamesKeyAndShapes) {
  // A BatchSizeError (Python: a RuntimeError, as the reference raises, and a ValueError), which
  // is a c10::ValueError, as it was thrown before.
  EXPECT_THROW_MSG(TensorDict({{"a", at::ones({4})}, {"b", at::ones({3, 3})}}, {4}), BatchSizeError,
                   "batch size mismatch: key 'b' has shape [3, 3], which does not start with [4]");
  TensorDict td = sample();
  EXPECT_THROW_MSG(td.set({"c", "e"}, at::ones({5})), BatchSizeError,
                   "key ('c', 'e') has shape [5], which does not start with [4]");
  EXPECT_THROW_MSG(td.set("x", TensorDict({}, {2})), c10::ValueError,
                   "key 'x' has shape [2], which does not start with [4]");
  EXPECT_THROW_MSG(
      td.set_non_tensor("n", tensordict::NonTensorData(tensordict::JsonValue("s"), {2})),
      BatchSizeError, "key 'n' has shape [2], which does not start with [4]");
  EXPECT_THROW_MSG(TensorDict({}, {-1}), c10::ValueError, "negative");
}

TEST(TensorDict, SetBatchSize) {
  TensorDict td({{"a", at::ones({4, 3})}}, {4});
  td.set_batch_size({4, 3});
  EXPECT_EQ(td.batch_dims(), 2);
  td.set_batch_size({});
  EXPECT_EQ(td.batch_dims(), 0);
  EXPECT_THROW_MSG(td.set_batch_size({3}), BatchSizeError,
                   "key 'a' has shape [4, 3], which does not start with [3]");
}

TEST(TensorDict, GetSetNested) {
  TensorDict td = sample();
  EXPECT_TRUE(td.contains("a"));
  EXPECT_TRUE(td.contains({"c", "d"}));
  EXPECT_FALSE(td.contains({"c", "x"}));
  EXPECT_FALSE(td.contains({"a", "x"}));  // a is a leaf
  EXPECT_TRUE(td.get("c").is_tensordict());
  EXPECT_EQ(td.get("c").tensordict().batch_size(), at::IntArrayRef({4}));
  EXPECT_EQ(td.get({"c", "d"}).tensor().scalar_type(), at::kLong);
  // The nested TensorDict is shared, like a Python object.
  TensorDict c = td.get("c").tensordict();
  c.set("e", at::ones({4}));
  EXPECT_TRUE(td.contains({"c", "e"}));
  // Intermediate levels are created three deep.
  td.set({"x", "y", "z"}, at::ones({4, 1}));
  EXPECT_EQ(td.get({"x", "y"}).tensordict().batch_size(), at::IntArrayRef({4}));
  // Replacing keeps the position.
  td.set("a", at::full({4}, 7.0));
  EXPECT_EQ(td.keys().front(), NestedKey("a"));
  EXPECT_EQ(td.get("a").tensor()[0].item<float>(), 7.0f);
}

TEST(TensorDict, GetMissingIsKeyError) {
  TensorDict td = sample();
  EXPECT_THROW_MSG(td.get("zz"), KeyError,
                   "key 'zz' not found in TensorDict with keys ['a', 'b', 'c']");
  EXPECT_THROW_MSG(td.get({"c", "zz"}), KeyError,
                   "key ('c', 'zz') not found in TensorDict with keys ['d']");
  EXPECT_THROW_MSG(td.get({"a", "b"}), KeyError, "'a' is a tensor, not a TensorDict");
  EXPECT_THROW(td.erase("nope"), KeyError);
  EXPECT_THROW(td.set({"a", "b"}, at::ones({4})), KeyError);
}

TEST(TensorDict, GetWithDefault) {
  TensorDict td = sample();
  Value v = td.get("missing", at::full({1}, 3.0));
  EXPECT_EQ(v.tensor().item<float>(), 3.0f);
  EXPECT_EQ(td.get({"c", "missing"}, td).tensordict().is_same(td), true);
  EXPECT_TRUE(td.get("a", at::Tensor()).tensor().defined());
}

TEST(TensorDict, ValueAccessorTypeErrors) {
  TensorDict td = sample();
  EXPECT_THROW(td.get("a").tensordict(), c10::TypeError);
  EXPECT_THROW(td.get("c").tensor(), c10::TypeError);
  EXPECT_THROW(td.set("u", at::Tensor()), c10::TypeError);
}

TEST(TensorDict, EraseAndPop) {
  TensorDict td = sample();
  Value b = td.pop("b");
  EXPECT_EQ(b.tensor().sizes(), at::IntArrayRef({4, 3}));
  EXPECT_FALSE(td.contains("b"));
  td.erase({"c", "d"});
  EXPECT_TRUE(td.contains("c"));
  EXPECT_FALSE(td.contains({"c", "d"}));
  td.set("b", at::ones({4}));  // re-inserted at the end
  EXPECT_EQ(strs(td.keys()), (std::vector<std::string>{"'a'", "'c'", "'b'"}));
  EXPECT_EQ(td.get("b").tensor().dim(), 1);
}

TEST(TensorDict, KeysValuesItemsOptions) {
  TensorDict td({{"b", at::ones({4, 3})}}, {4});
  td.set({"a", "z"}, at::ones({4}));
  td.set({"a", "y", "q"}, at::ones({4}));
  td.set("c", at::ones({4}));
  // Same order as the reference: nested keys before the level's own key.
  EXPECT_EQ(strs(td.keys()), (std::vector<std::string>{"'b'", "'a'", "'c'"}));
  EXPECT_EQ(strs(td.keys({.include_nested = true})),
            (std::vector<std::string>{"'b'", "('a', 'z')", "('a', 'y', 'q')", "('a', 'y')", "'a'",
                                      "'c'"}));
  EXPECT_EQ(strs(td.keys({.include_nested = true, .leaves_only = true})),
            (std::vector<std::string>{"'b'", "('a', 'z')", "('a', 'y', 'q')", "'c'"}));
  EXPECT_EQ(strs(td.keys({.leaves_only = true})), (std::vector<std::string>{"'b'", "'c'"}));
  EXPECT_EQ(td.values({.include_nested = true, .leaves_only = true}).size(), 4u);
  auto items = td.items({.include_nested = true, .leaves_only = true});
  EXPECT_EQ(items[1].first, (NestedKey{"a", "z"}));
  EXPECT_TRUE(items[1].second.is_tensor());
  EXPECT_EQ(td.entries().size(), 3u);
}

TEST(TensorDict, SortedKeysByCodePoint) {
  TensorDict td({{"c", at::ones({})},
                 {"cls", at::ones({})},
                 {"_", at::ones({})},
                 {"a", at::ones({})},
                 {"Z", at::ones({})},
                 {"\xc3\xa9", at::ones({})},
                 {"\xf0\x9f\x98\x80", at::ones({})},
                 {"\xef\xbd\x81", at::ones({})}},
                {});
  // U+00E9 < U+FF41 < U+1F600: code point order, which UTF-16 order would get wrong.
  EXPECT_EQ(td.sorted_keys(), (std::vector<std::string>{"Z", "_", "a", "c", "cls", "\xc3\xa9",
                                                        "\xef\xbd\x81", "\xf0\x9f\x98\x80"}));
}

TEST(TensorDict, IsEmpty) {
  TensorDict td;
  td.set("sub", TensorDict());
  EXPECT_TRUE(td.is_empty());
  td.set({"sub", "x"}, at::ones({}));
  EXPECT_FALSE(td.is_empty());
}

TEST(TensorDict, DeviceMovesLeaves) {
  TensorDict td({{"a", at::ones({2})}}, {2}, at::Device("cpu"));
  ASSERT_TRUE(td.device().has_value());
  EXPECT_EQ(td.device()->str(), "cpu");
  td.set({"n", "x"}, at::ones({2}));
  EXPECT_EQ(td.get("n").tensordict().device(), td.device());
  TensorDict moved = TensorDict({{"a", at::ones({2})}}, {2}).to(at::Device("cpu"));
  EXPECT_EQ(moved.device()->str(), "cpu");
}

TEST(TensorDict, LockRefusesChanges) {
  TensorDict td = sample();
  td.lock_();
  EXPECT_TRUE(td.is_locked());
  EXPECT_TRUE(td.get("c").tensordict().is_locked());
  EXPECT_THROW_MSG(td.set("x", at::ones({4})), c10::Error, "Cannot modify locked TensorDict");
  EXPECT_THROW_MSG(td.set({"c", "x"}, at::ones({4})), c10::Error,
                   "Cannot modify locked TensorDict");
  EXPECT_THROW(td.erase("a"), c10::Error);
  td.set_("a", at::full({4}, 5.0));  // in place is allowed
  EXPECT_EQ(td.get("a").tensor()[3].item<float>(), 5.0f);
  td.unlock_();
  td.set("x", at::ones({4}));
  EXPECT_FALSE(td.get("c").tensordict().is_locked());
}

TEST(TensorDict, SetInPlaceChecks) {
  TensorDict td = sample();
  at::Tensor a = td.get("a").tensor();
  td.set_("a", at::full({4}, 2.0));
  EXPECT_EQ(a.sum().item<float>(), 8.0f);  // same storage
  EXPECT_THROW_MSG(td.set_("a", at::ones({5})), c10::ValueError, "key 'a' has shape [4]");
  EXPECT_THROW(td.set_("c", at::ones({4})), c10::TypeError);
  EXPECT_THROW(td.set_("missing", at::ones({4})), KeyError);
}

TEST(TensorDict, EveryDtypeZeroDimAndNumelZero) {
  const std::vector<at::ScalarType> dtypes = {
      at::kBool,          at::kByte,   at::kChar,        at::kShort,
      at::kInt,           at::kLong,   at::kHalf,        at::kBFloat16,
      at::kFloat,         at::kDouble, at::kComplexHalf, at::kComplexFloat,
      at::kComplexDouble, at::kUInt16, at::kUInt32,      at::kUInt64};
  TensorDict td({}, {2});
  for (auto dt : dtypes) {
    const std::string k = tensordict::dtype_name(dt);
    td.set(k, at::empty({2, 3}, dt));
    EXPECT_EQ(td.get(k).tensor().scalar_type(), dt);
  }
  td.set("empty", at::ones({2, 0}));
  TensorDict scalar({{"s", at::scalar_tensor(3.0)}}, {});
  EXPECT_EQ(scalar.get("s").tensor().dim(), 0);
  EXPECT_EQ(td.clone().keys().size(), dtypes.size() + 1);
  EXPECT_EQ(td.index({0}).get("empty").tensor().sizes(), at::IntArrayRef({0}));
}

// ---- non-tensor entries ----------------------------------------------------------------------

using tensordict::JsonValue;
using tensordict::NonTensorData;

TEST(TensorDictNonTensor, SetAndGet) {
  TensorDict td({{"a", at::ones({4})}}, {4});
  td.set_non_tensor("label", "cat");
  td.set_non_tensor({"n", "cfg"},
                    JsonValue::map({{"lr", 0.1}, {"layers", JsonValue::list({1, 2})}}));
  EXPECT_EQ(td.get_non_tensor("label"), JsonValue("cat"));
  EXPECT_EQ(td.get_non_tensor({"n", "cfg"}).at("lr").as_float(), 0.1);
  const Value v = td.get("label");
  ASSERT_TRUE(v.is_non_tensor());
  EXPECT_FALSE(v.is_tensor());
  EXPECT_FALSE(v.is_tensordict());
  EXPECT_EQ(v.non_tensor().batch_size(), at::IntArrayRef({4}));
  EXPECT_FALSE(v.non_tensor().device().has_value());
  // The level created on the way has the batch size of its parent, and so has the entry.
  EXPECT_EQ(td.get({"n", "cfg"}).non_tensor().batch_size(), at::IntArrayRef({4}));
  // Replacing keeps the position.
  td.set_non_tensor("a", 5);
  EXPECT_EQ(td.entries()[0].first, "a");
  EXPECT_EQ(td.get_non_tensor("a"), JsonValue(5));

  EXPECT_THROW_MSG(td.get_non_tensor("missing"), KeyError, "'missing'");
  EXPECT_THROW_MSG(td.get_non_tensor("n"), c10::TypeError, "holds a TensorDict");
  EXPECT_THROW_MSG(td.get("label").tensor(), c10::TypeError, "got a non-tensor entry");
  EXPECT_THROW_MSG(td.get("label").tensordict(), c10::TypeError, "got a non-tensor entry");
  EXPECT_THROW_MSG(td.get("n").non_tensor(), c10::TypeError, "got a TensorDict");
  EXPECT_THROW_MSG(td.get({"label", "x"}), KeyError, "'label' is a non-tensor entry");
  EXPECT_THROW_MSG(td.set({"label", "x"}, at::ones({4})), KeyError, "cannot reach key");
  EXPECT_THROW_MSG(td.set_("label", at::ones({4})), c10::TypeError, "holds a non-tensor entry");
}

TEST(TensorDictNonTensor, DeviceOfTheLevel) {
  TensorDict td({}, {2}, at::Device(at::kCPU));
  td.set_non_tensor("x", nullptr);
  EXPECT_EQ(td.get("x").non_tensor().device(), at::Device(at::kCPU));
  td.set("y", NonTensorData(JsonValue("q")));  // an empty batch size is the level's
  EXPECT_EQ(td.get("y").non_tensor().batch_size(), at::IntArrayRef({2}));
  EXPECT_EQ(td.get("y").non_tensor().device(), at::Device(at::kCPU));
}

TEST(TensorDictNonTensor, SetChecksTheBatchSize) {
  TensorDict td({}, {3});
  td.set("ok", NonTensorData(JsonValue(1), {3, 4}));
  EXPECT_EQ(td.get("ok").non_tensor().batch_size(), at::IntArrayRef({3, 4}));
  EXPECT_THROW_MSG(td.set({"n", "bad"}, NonTensorData(JsonValue(1), {2})), c10::ValueError,
                   "key ('n', 'bad') has shape [2], which does not start with [3]");
  EXPECT_THROW_MSG(TensorDict({{"bad", NonTensorData(JsonValue(1), {2})}}, {3}), c10::ValueError,
                   "key 'bad'");
  TensorDict only({{"ok", NonTensorData(JsonValue(1), {3, 4})}}, {3});
  EXPECT_THROW_MSG(only.set_batch_size({4}), c10::ValueError, "key 'ok'");
  only.set_batch_size({3, 4});
  only.set_batch_size({});
}

TEST(TensorDictNonTensor, KeysItemsAndEmptiness) {
  TensorDict td({{"a", at::ones({2})}}, {2});
  td.set_non_tensor("s", "x");
  td.set_non_tensor({"n", "t"}, "y");
  td.set({"n", "u"}, at::ones({2}));
  EXPECT_EQ(strs(td.keys()), (std::vector<std::string>{"'a'", "'s'", "'n'"}));
  // The reference: a non-tensor entry is not a leaf, so leaves_only leaves it out.
  EXPECT_EQ(strs(td.keys({.include_nested = true, .leaves_only = true})),
            (std::vector<std::string>{"'a'", "('n', 'u')"}));
  EXPECT_EQ(strs(td.keys({.include_nested = true})),
            (std::vector<std::string>{"'a'", "'s'", "('n', 't')", "('n', 'u')", "'n'"}));
  EXPECT_EQ(td.sorted_keys(), (std::vector<std::string>{"a", "n", "s"}));
  TensorDict only;
  only.set_non_tensor({"deep", "x"}, "a");
  EXPECT_FALSE(only.is_empty());  // a non-tensor entry counts, as in the reference
  EXPECT_FALSE(TensorDict(only.get("deep").tensordict()).is_empty());
}

TEST(TensorDictNonTensor, Locking) {
  TensorDict td({}, {});
  td.set_non_tensor({"n", "x"}, 1);
  td.lock_();
  EXPECT_THROW_MSG(td.set_non_tensor("y", 2), c10::Error, "Cannot modify locked TensorDict");
  EXPECT_THROW_MSG(td.set_non_tensor({"n", "x"}, 2), c10::Error, "Cannot modify locked");
  EXPECT_THROW_MSG(td.erase({"n", "x"}), c10::Error, "Cannot modify locked");
  td.unlock_();
  td.set_non_tensor({"n", "x"}, 2);
  EXPECT_EQ(td.pop({"n", "x"}).non_tensor().data(), JsonValue(2));
}

TEST(TensorDict, ATensorDictInsideItselfIsRefusedAtTheAssignment) {
  TensorDict td({{"a", at::zeros({2})}}, {2});
  EXPECT_THROW_MSG(td.set("me", td), c10::ValueError,
                   "Cannot set a tensordict inside itself (key 'me')");
  // Through a chain of any length, and through a lazy stack's members: cycles a walk would
  // never leave.
  TensorDict a, b, c;
  a.set("b", b);
  b.set("c", c);
  EXPECT_THROW_MSG(c.set("a", a), c10::ValueError, "contain themselves");
  EXPECT_THROW_MSG(c.set({"x", "y"}, b), c10::ValueError, "inside itself");
  const TensorDict lazy = tensordict::lazy_stack({a, TensorDict()});
  EXPECT_THROW_MSG(c.set("s", lazy), c10::ValueError, "inside itself");
  EXPECT_FALSE(c.contains("a"));
  // The same TensorDict twice side by side is no cycle.
  TensorDict shared({{"v", at::ones({1})}}, {});
  TensorDict holder;
  holder.set("p", shared);
  holder.set("q", shared);
  EXPECT_EQ(holder.keys({.include_nested = true, .leaves_only = true}).size(), 2u);
}

TEST(TensorDict, ABatchSizeBeyondInt64IsRefusedNotWrapped) {
  // numel() would wrap to 0 (the product overflows): refused at construction and on set.
  const int64_t big = int64_t{1} << 40;
  EXPECT_THROW_MSG(TensorDict({}, {big, big}), c10::ValueError,
                   "has more elements than int64 can count");
  TensorDict td({}, {big});
  EXPECT_EQ(td.numel(), big);
  EXPECT_THROW_MSG(td.set_batch_size({big, big, 4}), c10::ValueError, "int64");
  EXPECT_EQ(TensorDict({}, {big, 0}).numel(), 0);
}

// Tensorclasses without a transport: declaration, accessors, construction, validation of
// from_tensordict, the TensorDict underneath, consolidate().
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "expect_throw.h"
#include "tensordict/tensordict.h"

using tensordict::JsonValue;
using tensordict::KeyError;
using tensordict::TensorDict;

namespace {

TENSORDICT_TENSORCLASS(Inner, (at::Tensor, x));

TENSORDICT_TENSORCLASS(MyData, (at::Tensor, obs), (at::Tensor, reward), (std::string, label),
                       (Inner, inner));

// Every non-tensor field type, and the Python-side name of a peer class.
TENSORDICT_TENSORCLASS_NAMED(Scalars, "__main__.Scalars", (int64_t, step), (double, scale),
                             (bool, done), (tensordict::JsonValue, config), (at::Tensor, t));

// A class with a method of its own.
class WithMethod : public tensordict::TensorClass<WithMethod> {
 public:
  TENSORDICT_TENSORCLASS_BODY(WithMethod, "pkg.WithMethod", (at::Tensor, a), (at::Tensor, b))
  at::Tensor total() const { return a() + b(); }
};

TENSORDICT_TENSORCLASS(NoFields);

MyData sample(float fill = 1) {
  return MyData(at::full({4, 3}, fill), at::full({4}, fill * 2), "train",
                Inner(at::full({4, 2}, fill * 3), {4}), {4});
}

// Takes any TensorDict: a tensorclass converts implicitly.
int64_t count_leaves(const TensorDict& td) {
  return static_cast<int64_t>(td.keys({.include_nested = true, .leaves_only = true}).size());
}

}  // namespace

static_assert(tensordict::TensorClassType<MyData>);
static_assert(tensordict::TensorClassType<WithMethod>);
static_assert(!tensordict::TensorClassType<TensorDict>);
static_assert(MyData::type_name() == "MyData");
static_assert(Scalars::type_name() == "__main__.Scalars");
static_assert(MyData::field_names() ==
              std::array<std::string_view, 4>{"obs", "reward", "label", "inner"});
static_assert(NoFields::field_names().empty());
static_assert(tensordict::detail::tc_kind<int>() == tensordict::detail::TcKind::kUnsupported);
static_assert(tensordict::detail::tc_kind<float>() == tensordict::detail::TcKind::kUnsupported);
static_assert(tensordict::detail::tc_reserved_name("batch_size"));

TEST(TensorClass, AccessorsAndBackingTensorDict) {
  MyData d = sample();
  EXPECT_TRUE(at::equal(d.obs(), at::full({4, 3}, 1.0f)));
  EXPECT_TRUE(at::equal(d.reward(), at::full({4}, 2.0f)));
  EXPECT_EQ(d.label(), "train");
  EXPECT_TRUE(at::equal(d.inner().x(), at::full({4, 2}, 3.0f)));
  EXPECT_EQ(d.batch_size(), at::IntArrayRef({4}));
  EXPECT_FALSE(d.device().has_value());

  // Declaration order is insertion order (the consolidated layout's order); the label is a
  // non-tensor entry, the nested class a nested TensorDict.
  const TensorDict& td = d.td();
  ASSERT_EQ(td.entries().size(), 4u);
  EXPECT_EQ(td.entries()[0].first, "obs");
  EXPECT_EQ(td.entries()[3].first, "inner");
  EXPECT_TRUE(td.get("label").is_non_tensor());
  EXPECT_EQ(td.get_non_tensor("label"), JsonValue("train"));
  EXPECT_EQ(td.get("label").non_tensor().batch_size(), at::IntArrayRef({4}));
  EXPECT_TRUE(td.get("inner").is_tensordict());
  EXPECT_EQ(count_leaves(d), 3);
  TensorDict copy = d;  // the conversion yields the handle
  EXPECT_TRUE(copy.is_same(d.td()));
}

TEST(TensorClass, SettersShareTheEntries) {
  MyData d = sample();
  MyData alias = d;  // a handle, as TensorDict
  d.set_obs(at::zeros({4, 7})).set_label("eval");
  EXPECT_EQ(alias.obs().sizes(), at::IntArrayRef({4, 7}));
  EXPECT_EQ(alias.label(), "eval");
  // The nested accessor shares the parent's entries too.
  d.inner().set_x(at::full({4}, 9.0f));
  EXPECT_TRUE(at::equal(d.inner().x(), at::full({4}, 9.0f)));
  d.set_inner(Inner(at::ones({4, 1, 1}), {4, 1}));
  EXPECT_EQ(d.inner().batch_size(), at::IntArrayRef({4, 1}));
  // clone() copies.
  MyData c = d.clone();
  c.set_label("other");
  c.obs().fill_(5);
  EXPECT_EQ(d.label(), "eval");
  EXPECT_TRUE(d.obs().eq(0).all().item<bool>());
}

TEST(TensorClass, EveryNonTensorType) {
  Scalars s(7, 0.5, true, JsonValue::map({{"lr", 0.1}, {"tags", JsonValue::list({"a", 1})}}),
            at::ones({2}), {2});
  EXPECT_EQ(s.step(), 7);
  EXPECT_EQ(s.scale(), 0.5);
  EXPECT_TRUE(s.done());
  EXPECT_EQ(s.config().at("tags").at(size_t{0}).as_string(), "a");
  s.set_step(8).set_scale(2.0).set_done(false).set_config(nullptr);
  EXPECT_EQ(s.step(), 8);
  EXPECT_EQ(s.scale(), 2.0);
  EXPECT_FALSE(s.done());
  EXPECT_TRUE(s.config().is_null());
  // A double field takes an integer (a Python peer may send 1 for 1.0).
  TensorDict td = s.td().clone();
  td.set_non_tensor("scale", 3);
  EXPECT_EQ(Scalars::from_tensordict(td).scale(), 3.0);
}

TEST(TensorClass, CustomMethodsAndEmptyClasses) {
  WithMethod w(at::ones({3}), at::full({3}, 2.0f), {3});
  EXPECT_TRUE(at::equal(w.total(), at::full({3}, 3.0f)));
  EXPECT_EQ(WithMethod::type_name(), "pkg.WithMethod");
  NoFields n(at::IntArrayRef({5}));
  EXPECT_EQ(n.batch_size(), at::IntArrayRef({5}));
  EXPECT_TRUE(n.td().entries().empty());
}

TEST(TensorClass, DeviceAndTo) {
  MyData d(at::ones({2, 3}), at::ones({2}), "x", Inner(at::ones({2}), {2}), {2}, at::kCPU);
  ASSERT_TRUE(d.device().has_value());
  EXPECT_EQ(*d.device(), at::Device(at::kCPU));
  EXPECT_EQ(d.td().get("label").non_tensor().device(), at::Device(at::kCPU));
  MyData moved = d.to(at::kCPU);
  EXPECT_EQ(moved.label(), "x");
  EXPECT_EQ(*moved.device(), at::Device(at::kCPU));
}

TEST(TensorClass, ConstructionErrorsNameClassAndField) {
  EXPECT_THROW_MSG(MyData(at::ones({3, 3}), at::ones({4}), "x", Inner(at::ones({4}), {4}), {4}),
                   tensordict::BatchSizeError,
                   "MyData: field 'obs' has shape [3, 3], which does not start with the batch "
                   "size [4]");
  EXPECT_THROW_MSG(MyData(at::ones({4}), at::Tensor(), "x", Inner(at::ones({4}), {4}), {4}),
                   c10::ValueError, "MyData: field 'reward' is an undefined tensor");
  EXPECT_THROW_MSG(MyData(at::ones({4}), at::ones({4}), "x", Inner(at::ones({2}), {2}), {4}),
                   c10::ValueError,
                   "MyData: field 'inner' (Inner) has batch size [2], which does not start with "
                   "the batch size [4]");
  MyData d = sample();
  EXPECT_THROW_MSG(d.set_reward(at::ones({5})), c10::ValueError,
                   "MyData: field 'reward' has shape [5]");
  EXPECT_THROW_MSG(d.inner().set_x(at::ones({1})), c10::ValueError, "Inner: field 'x'");
}

TEST(TensorClass, FromTensorDictWrapsWithoutCopying) {
  TensorDict inner({{"x", at::ones({4})}}, {4});
  TensorDict td({{"obs", at::ones({4, 2})}, {"reward", at::ones({4})}, {"inner", inner}}, {4});
  td.set_non_tensor("label", "from-td");
  MyData d = MyData::from_tensordict(td);
  EXPECT_TRUE(d.td().is_same(td));
  EXPECT_EQ(d.label(), "from-td");
  td.set("obs", at::zeros({4, 2}));
  EXPECT_TRUE(d.obs().eq(0).all().item<bool>());
}

TEST(TensorClass, FromTensorDictErrors) {
  auto good = [] {
    TensorDict td({{"obs", at::ones({4, 2})},
                   {"reward", at::ones({4})},
                   {"inner", TensorDict({{"x", at::ones({4})}}, {4})}},
                  {4});
    td.set_non_tensor("label", "l");
    return td;
  };
  // Missing field: ValueError naming the field and the class.
  TensorDict td = good();
  td.erase("label");
  EXPECT_THROW_MSG(MyData::from_tensordict(td), c10::ValueError,
                   "MyData.from_tensordict: field 'label' of MyData is missing");
  // A tensor where a string is expected, and the other way round: TypeError.
  td = good();
  td.set("label", at::ones({4}));
  EXPECT_THROW_MSG(MyData::from_tensordict(td), c10::TypeError,
                   "field 'label' of MyData must be a non-tensor entry holding a string, found a "
                   "tensor");
  td = good();
  td.set_non_tensor("obs", "oops");
  EXPECT_THROW_MSG(MyData::from_tensordict(td), c10::TypeError,
                   "field 'obs' of MyData must be a tensor, found a non-tensor entry");
  // A non-tensor of the wrong JSON kind.
  td = good();
  td.set_non_tensor("label", 3);
  EXPECT_THROW_MSG(MyData::from_tensordict(td), c10::TypeError,
                   "field 'label' of MyData must hold a string, found an integer");
  // The nested class: wrong kind, and its own fields checked with the path.
  td = good();
  td.set("inner", at::ones({4}));
  EXPECT_THROW_MSG(MyData::from_tensordict(td), c10::TypeError,
                   "field 'inner' of MyData must be a TensorDict (tensorclass Inner), found a "
                   "tensor");
  td = good();
  td.set("inner", TensorDict({{"y", at::ones({4})}}, {4}));
  EXPECT_THROW_MSG(MyData::from_tensordict(td), c10::ValueError,
                   "MyData.from_tensordict: field 'inner': field 'x' of Inner is missing");
  // A key that is not a field, as the reference refuses it.
  td = good();
  td.set("extra", at::ones({4}));
  EXPECT_THROW_MSG(MyData::from_tensordict(td), c10::ValueError,
                   "key 'extra' is not a field of MyData (fields: obs, reward, label, inner)");
  // Non-tensor kinds of every scalar type.
  Scalars s(1, 1.0, true, nullptr, at::ones({1}), {1});
  TensorDict st = s.td().clone();
  st.set_non_tensor("done", 1);
  EXPECT_THROW_MSG(Scalars::from_tensordict(st), c10::TypeError,
                   "field 'done' of __main__.Scalars must hold a bool, found an integer");
  st = s.td().clone();
  st.set_non_tensor("step", 1.5);
  EXPECT_THROW_MSG(Scalars::from_tensordict(st), c10::TypeError,
                   "field 'step' of __main__.Scalars must hold an integer, found a float");
}

TEST(TensorClass, PlaceholderAndChangedEntries) {
  MyData empty;
  EXPECT_TRUE(empty.td().entries().empty());
  EXPECT_THROW_MSG(empty.obs(), KeyError, "MyData: field 'obs' is not set");
  // Entries changed behind the tensorclass's back are caught by the accessor.
  MyData d = sample();
  TensorDict handle = d.td();
  handle.set("obs", TensorDict({}, {4}));
  EXPECT_THROW_MSG(d.obs(), c10::TypeError, "MyData: field 'obs' holds a TensorDict, not a tensor");
  handle.set_non_tensor("label", 1);
  EXPECT_THROW_MSG(d.label(), c10::TypeError,
                   "MyData: field 'label' holds an integer, not a string");
}

TEST(TensorClass, ConsolidateKeepsTheClass) {
  MyData d = sample(2);
  MyData c = tensordict::consolidate(d);
  EXPECT_TRUE(tensordict::is_consolidated(c));
  EXPECT_FALSE(c.td().is_same(d.td()));
  EXPECT_EQ(c.label(), "train");
  EXPECT_TRUE(at::equal(c.obs(), d.obs()));
  EXPECT_TRUE(at::equal(c.inner().x(), d.inner().x()));
  // The label is in the metadata, as the reference's non_tensors.
  const auto meta = tensordict::consolidated_metadata(c);
  ASSERT_EQ(meta->non_tensors.size(), 1u);
  EXPECT_EQ(meta->non_tensors[0].first, "label");
  EXPECT_EQ(meta->non_tensors[0].second.data, JsonValue("train"));
  // Consolidating a consolidated one returns it.
  EXPECT_TRUE(tensordict::consolidate(c).td().is_same(c.td()));
}

TEST(TensorClass, TypeNamesOnTheWire) {
  using tensordict::detail::same_tensorclass_type;
  static_assert(same_tensorclass_type("__main__.X", "__mp_main__.X"));
  static_assert(same_tensorclass_type("pkg.mod.X", "pkg.mod.X"));
  static_assert(!same_tensorclass_type("__main__.X", "__main__.Y"));
  static_assert(!same_tensorclass_type("pkg.X", "__main__.X"));
  static_assert(!same_tensorclass_type("__main__.", "X"));
  tensordict::detail::check_tensorclass_type<Scalars>("recv", std::nullopt);
  tensordict::detail::check_tensorclass_type<Scalars>("recv", "__mp_main__.Scalars");
  EXPECT_THROW_MSG(tensordict::detail::check_tensorclass_type<MyData>("recv", "__main__.MyData"),
                   c10::TypeError,
                   "recv: the sender's tensorclass is '__main__.MyData' but the receiver "
                   "expects 'MyData' (a C++ peer of a Python tensorclass declares its "
                   "\"<module>.<qualname>\" with TENSORDICT_TENSORCLASS_NAMED)");
}

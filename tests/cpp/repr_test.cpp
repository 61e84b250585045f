// The repr must match the reference's character for character: its detailed form (the expected
// strings below were printed by tensordict 0.15.3 under set_printoptions(compact=False)) and its
// default compact form. tests/python/test_repr_reference.py re-checks such cases against the
// installed reference.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>

#include "tensordict/tensordict.h"

using tensordict::TensorDict;

TEST(Repr, NestedMatchesReference) {
  TensorDict td({{"b", at::ones({4, 3}, at::kLong)}, {"a", at::ones({4})}}, {4});
  td.set({"c", "d"}, at::zeros({4, 2}, at::kBool));
  td.set({"c", "e", "f"}, at::ones({4}));
  const std::string expected =
      "TensorDict(\n"
      "    fields={\n"
      "        a: Tensor(shape=torch.Size([4]), device=cpu, dtype=torch.float32, "
      "is_shared=False),\n"
      "        b: Tensor(shape=torch.Size([4, 3]), device=cpu, dtype=torch.int64, "
      "is_shared=False),\n"
      "        c: TensorDict(\n"
      "            fields={\n"
      "                d: Tensor(shape=torch.Size([4, 2]), device=cpu, dtype=torch.bool, "
      "is_shared=False),\n"
      "                e: TensorDict(\n"
      "                    fields={\n"
      "                        f: Tensor(shape=torch.Size([4]), device=cpu, dtype=torch.float32, "
      "is_shared=False)},\n"
      "                    batch_size=torch.Size([4]),\n"
      "                    device=None,\n"
      "                    is_shared=False)},\n"
      "            batch_size=torch.Size([4]),\n"
      "            device=None,\n"
      "            is_shared=False)},\n"
      "    batch_size=torch.Size([4]),\n"
      "    device=None,\n"
      "    is_shared=False)";
  EXPECT_EQ(td.repr({.compact = false}), expected);
}

TEST(Repr, EmptyAndDevice) {
  EXPECT_EQ(TensorDict().repr({.compact = false}),
            "TensorDict(\n"
            "    fields={\n"
            "    },\n"
            "    batch_size=torch.Size([]),\n"
            "    device=None,\n"
            "    is_shared=False)");
  TensorDict td({{"x", at::scalar_tensor(1.0)}}, {}, at::Device("cpu"));
  EXPECT_EQ(td.repr({.compact = false}),
            "TensorDict(\n"
            "    fields={\n"
            "        x: Tensor(shape=torch.Size([]), device=cpu, dtype=torch.float32, "
            "is_shared=False)},\n"
            "    batch_size=torch.Size([]),\n"
            "    device=cpu,\n"
            "    is_shared=False)");
}

// Printed by tensordict 0.15.3 with its default options.
TEST(Repr, CompactMatchesReference) {
  TensorDict td({{"obs", at::zeros({4, 3})}}, {4});
  td.set({"next", "reward"}, at::zeros({4, 1}));
  EXPECT_EQ(td.repr(), "TensorDict(batch_size=[4], fields={next: {reward: f32[1]}, obs: f32[3]})");
  std::ostringstream os;
  os << td;
  EXPECT_EQ(os.str(), td.repr());
  EXPECT_EQ(TensorDict().repr(), "TensorDict(batch_size=[], fields={})");
  EXPECT_EQ(TensorDict({{"x", at::zeros({3})}}, {3}, at::Device("cpu")).repr(),
            "TensorDict(batch_size=[3], device=cpu, fields={x: f32[]})");
  TensorDict wide(
      {{"f", at::zeros({})}, {"l", at::zeros({2}, at::kLong)}, {"n", at::zeros({}, at::kLong)}},
      {});
  wide.set_non_tensor("o", nullptr);
  wide.set_non_tensor("s", "hello");
  EXPECT_EQ(wide.repr(),
            "TensorDict(batch_size=[], fields={\n"
            "    f: f32[],\n"
            "    l: i64[2],\n"
            "    n: i64[],\n"
            "    o: NoneType,\n"
            "    s: str})");
  // Sorted by "key: value": '1' < ':' < '_'.
  TensorDict keys({{"a", at::zeros({1})},
                   {"a1", at::zeros({1})},
                   {"A", at::zeros({1})},
                   {"a_b", at::zeros({1})},
                   {"b", at::zeros({1})},
                   {"_z", at::zeros({1})}},
                  {});
  EXPECT_EQ(keys.repr(),
            "TensorDict(batch_size=[], fields={\n"
            "    A: f32[1],\n"
            "    _z: f32[1],\n"
            "    a1: f32[1],\n"
            "    a: f32[1],\n"
            "    a_b: f32[1],\n"
            "    b: f32[1]})");
  TensorDict rl({{"action", at::zeros({4, 6})}, {"done", at::zeros({4, 1}, at::kBool)}}, {4});
  rl.set({"observation", "nested", "another_long_name"}, at::zeros({4}, at::kBool));
  rl.set({"observation", "nested", "inner_value"}, at::zeros({4, 2, 2}));
  rl.set({"observation", "pixels"}, at::zeros({4, 3, 84, 84}, at::kByte));
  rl.set({"observation", "state"}, at::zeros({4, 17}));
  rl.set("reward", at::zeros({4, 1}));
  EXPECT_EQ(rl.repr(),
            "TensorDict(batch_size=[4], fields={\n"
            "    action: f32[6],\n"
            "    done: bool[1],\n"
            "    observation: {\n"
            "        nested: {another_long_name: bool[], inner_value: f32[2,2]},\n"
            "        pixels: u8[3,84,84],\n"
            "        state: f32[17]},\n"
            "    reward: f32[1]})");
  TensorDict nested({{"x", at::zeros({2, 5, 3})}}, {2, 5});
  EXPECT_EQ(TensorDict({{"nested", nested}}, {2}).repr(),
            "TensorDict(batch_size=[2], fields={nested: [5]{x: f32[3]}})");
  EXPECT_EQ(tensordict::lazy_stack(
                {TensorDict({{"a", at::zeros({3})}}),
                 TensorDict({{"a", at::zeros({4}, at::kDouble)}, {"c", at::zeros({2}, at::kInt)}})})
                .repr(),
            "LazyStackedTensorDict(batch_size=[2], stack_dim=0, fields={\n"
            "    a: f64[-1]}, exclusive_fields={1: {c: i32[2]}})");
}

TEST(Repr, NonTensorEntries) {
  TensorDict td({{"a", at::zeros({3})}}, {3});
  td.set("s", tensordict::NonTensorData::stack({tensordict::NonTensorData("a"),
                                                tensordict::NonTensorData("b"),
                                                tensordict::NonTensorData("c")}));
  td.set("m", tensordict::NonTensorData::metadata("x", {3}));
  EXPECT_EQ(td.repr(),
            "TensorDict(batch_size=[3], fields={a: f32[], m: MetaData, s: NonTensorStack})");
  EXPECT_EQ(
      td.get("s").non_tensor().repr(),
      "NonTensorStack(\n    ['a', 'b', 'c'],\n    batch_size=torch.Size([3]),\n    device=None)");
  EXPECT_EQ(td.get("m").non_tensor().repr(),
            "MetaData(data=x, batch_size=torch.Size([3]), device=None)");
}

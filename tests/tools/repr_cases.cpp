// Prints the repr of a few TensorDicts, one per case, separated by lines "=== name". The pytest
// tests/python/test_repr_reference.py builds the same cases with the reference and compares.
#include <ATen/ATen.h>

#include <iostream>

#include "tensordict/tensordict.h"

using tensordict::TensorDict;

// Each case in the detailed form, then (named "<case> compact") in the default compact one.
void show(const char* name, const TensorDict& td) {
  std::cout << "=== " << name << "\n" << td.repr({.compact = false}) << "\n";
  std::cout << "=== " << name << " compact\n" << td << "\n";
}

int main() {
  TensorDict nested({{"b", at::ones({4, 3}, at::kLong)}, {"a", at::ones({4})}}, {4});
  nested.set({"c", "d"}, at::zeros({4, 2}, at::kBool));
  nested.set({"c", "e", "f"}, at::ones({4}));
  show("nested", nested);

  show("empty", TensorDict());
  show("device", TensorDict({{"x", at::scalar_tensor(1.0)}}, {}, at::Device("cpu")));

  // "a b" sorts before "a" once ": " is appended, as the reference sorts formatted lines.
  TensorDict tricky({{"a", at::ones({2, 0})}, {"a b", at::ones({2})}, {"B", at::ones({2, 1, 1})}},
                    {2});
  show("tricky", tricky);

  TensorDict dtypes({}, {1});
  const at::ScalarType all[] = {at::kBool,   at::kByte,   at::kChar,         at::kShort,
                                at::kInt,    at::kLong,   at::kHalf,         at::kBFloat16,
                                at::kFloat,  at::kDouble, at::kComplexFloat, at::kComplexDouble,
                                at::kUInt16, at::kUInt32, at::kUInt64};
  for (auto dt : all) dtypes.set("k" + std::to_string(static_cast<int>(dt)), at::zeros({1, 2}, dt));
  show("dtypes", dtypes);

  // Non-tensor entries print as the reference's NonTensorData: str(data), cut past 200.
  using tensordict::JsonValue;
  TensorDict non_tensors({{"a", at::ones({3})}}, {3});
  non_tensors.set_non_tensor("s", "hello");
  non_tensors.set_non_tensor("d", JsonValue::map({{"k", JsonValue::list({1, 2.0, nullptr, true})},
                                                  {"q", "it's \"x\"\t\xc3\xa9"}}));
  non_tensors.set_non_tensor("none", nullptr);
  non_tensors.set_non_tensor("f", 1e-07);
  non_tensors.set_non_tensor("b", false);
  non_tensors.set_non_tensor("i", -3);
  non_tensors.set_non_tensor("long", std::string(150, 'x') + "\xc3\xa9" + std::string(100, 'y'));
  non_tensors.set_non_tensor({"n", "lst"}, JsonValue::list({"a", "b'"}));
  TensorDict on_cpu({}, {3}, at::Device("cpu"));
  on_cpu.set_non_tensor("z", 1.5);
  non_tensors.set("cpu", on_cpu);
  show("non_tensors", non_tensors);
  return 0;
}

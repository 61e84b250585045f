// Prints the repr of a few TensorDicts, one per case, separated by lines "=== name". The pytest
// tests/python/test_repr_reference.py builds the same cases with the reference and compares.
#include <ATen/ATen.h>

#include <iostream>

#include "tensordict/tensordict.h"

using tensordict::TensorDict;

int main() {
  TensorDict nested({{"b", at::ones({4, 3}, at::kLong)}, {"a", at::ones({4})}}, {4});
  nested.set({"c", "d"}, at::zeros({4, 2}, at::kBool));
  nested.set({"c", "e", "f"}, at::ones({4}));
  std::cout << "=== nested\n" << nested << "\n";

  std::cout << "=== empty\n" << TensorDict() << "\n";

  std::cout << "=== device\n"
            << TensorDict({{"x", at::scalar_tensor(1.0)}}, {}, at::Device("cpu")) << "\n";

  // "a b" sorts before "a" once ": " is appended, as the reference sorts formatted lines.
  TensorDict tricky({{"a", at::ones({2, 0})}, {"a b", at::ones({2})}, {"B", at::ones({2, 1, 1})}}, {2});
  std::cout << "=== tricky\n" << tricky << "\n";

  TensorDict dtypes({}, {1});
  const at::ScalarType all[] = {at::kBool, at::kByte, at::kChar, at::kShort, at::kInt, at::kLong,
                                at::kHalf, at::kBFloat16, at::kFloat, at::kDouble, at::kComplexFloat,
                                at::kComplexDouble, at::kUInt16, at::kUInt32, at::kUInt64};
  for (auto dt : all) dtypes.set("k" + std::to_string(static_cast<int>(dt)), at::zeros({1, 2}, dt));
  std::cout << "=== dtypes\n" << dtypes << "\n";
  return 0;
}

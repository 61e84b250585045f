// One-process tour of TensorDict: build, nest, index, stack, print.
#include <ATen/ATen.h>

#include <iostream>

#include "tensordict/tensordict.h"

using tensordict::TensorDict;

int main() {
  TensorDict td({{"a", at::ones({4})}, {"b", at::ones({4, 3})}}, {4});
  td.set({"obs", "pixels"}, at::zeros({4, 2, 2}, at::kByte));
  std::cout << td << "\n\n";

  TensorDict first = td.index({0});
  std::cout << "td[0].batch_size = " << first.batch_size() << "\n";
  TensorDict stacked = tensordict::stack({td, td.clone()}, 0);
  std::cout << "stack of two: batch_size = " << stacked.batch_size() << "\n";
  std::cout << "sum of b = " << td.get("b").tensor().sum().item<float>() << "\n";
  return 0;
}

#include <ATen/ATen.h>

#include <iostream>

#include "tensordict/tensordict.h"

int main() {
  tensordict::TensorDict td({{"a", at::ones({4})}, {"b", at::ones({4, 3})}}, {4});
  const float sum = td.get("b").tensor().sum().item<float>();
  std::cout << "consumer: sum of b = " << sum << "\n";
  return sum == 12.0f ? 0 : 1;
}

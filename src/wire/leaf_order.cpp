#include "wire/leaf_order.h"

namespace tensordict::wire {

std::vector<std::pair<std::vector<std::string>, at::Tensor>> leaves_in_order(const TensorDict& td) {
  std::vector<std::pair<std::vector<std::string>, at::Tensor>> out;
  std::vector<std::string> path;
  auto add = [&](std::vector<std::string>* p, const at::Tensor& t) { out.emplace_back(*p, t); };
  for_each_leaf(td, &path, add);
  return out;
}

}  // namespace tensordict::wire

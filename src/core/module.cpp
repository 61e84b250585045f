#include "tensordict/module.h"

#include <torch/nn/module.h>

#include "tensordict/errors.h"

namespace tensordict {
namespace {

std::optional<TensorDict> entries_of(const torch::nn::Module& module, bool filter_empty) {
  std::vector<std::pair<NestedKey, Value>> entries;
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    entries.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    entries.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_children()) {
    if (auto child = entries_of(*item.value(), filter_empty)) {
      entries.emplace_back(item.key(), *child);
    }
  }
  if (entries.empty() && filter_empty) return std::nullopt;
  return TensorDict(std::move(entries));
}

TensorDict write(const TensorDict& td, torch::nn::Module& module, const ToModuleOptions& o) {
  std::vector<std::pair<NestedKey, Value>> old;
  const auto params = module.named_parameters(/*recurse=*/false);
  const auto buffers = module.named_buffers(/*recurse=*/false);
  const auto children = module.named_children();
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensordict()) {
      const auto* child = children.find(key);
      TD_CHECK_KEY(child != nullptr, "to_module: '", key, "' is not a submodule of ",
                   module.name());
      old.emplace_back(key, write(value.tensordict(), **child, o));
      continue;
    }
    TORCH_CHECK_TYPE(value.is_tensor(), "to_module: key '", key,
                     "' is a non-tensor entry, not a tensor");
    const at::Tensor* current = params.find(key);
    if (current == nullptr) current = buffers.find(key);
    TD_CHECK_KEY(current != nullptr, "to_module: '", key, "' is not a parameter or buffer of ",
                 module.name());
    at::Tensor handle = *current;  // the module's own TensorImpl
    const at::Tensor& leaf = value.tensor();
    if (o.inplace) {
      if (o.return_swap) old.emplace_back(key, handle.detach().clone());
      at::NoGradGuard no_grad;
      handle.copy_(leaf);
    } else {
      // A detached handle keeps the old storage once set_data points the module elsewhere.
      if (o.return_swap) old.emplace_back(key, handle.detach());
      handle.set_data(leaf);
    }
  }
  return TensorDict(std::move(old));
}

}  // namespace

TensorDict from_module(const torch::nn::Module& module, const FromModuleOptions& options) {
  TensorDict out = entries_of(module, options.filter_empty).value_or(TensorDict());
  if (options.lock) out.lock_();
  return out;
}

std::optional<TensorDict> to_module(const TensorDict& td, torch::nn::Module& module,
                                    const ToModuleOptions& options) {
  TensorDict old = write(td, module, options);
  if (!options.return_swap) return std::nullopt;
  return old;
}

}  // namespace tensordict

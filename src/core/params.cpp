#include "tensordict/params.h"

#include <c10/util/Exception.h>

#include "tensordict/errors.h"

namespace tensordict {
namespace {

bool is_float(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return d == at::kFloat || d == at::kDouble || d == at::kHalf;
}

}  // namespace

TensorDictParams::TensorDictParams(TensorDict params, const TensorDictParamsOptions& options)
    : TensorDictParams(std::move(params), options, nullptr) {}

TensorDictParams::TensorDictParams(TensorDict params, const TensorDictParamsOptions& options,
                                   const torch::nn::Module* like)
    : params_(std::move(params)), options_(options) {
  TORCH_CHECK_VALUE(!params_.is_lazy_stack(),
                    "TensorDictParams: a lazy stack cannot be a "
                    "module's parameters; pass a TensorDict");
  const bool locked = params_.is_locked();
  if (locked) params_.unlock_();  // a non-leaf float tensor is replaced by its detached alias
  for (const auto& [key, value] : std::vector<TensorDict::Entry>(params_.entries())) {
    if (!value.is_non_tensor()) register_entry(key, value, like);
  }
  if (locked || options_.lock) params_.lock_();
}

void TensorDictParams::register_entry(const std::string& key, const Value& value,
                                      const torch::nn::Module* like) {
  TORCH_CHECK_VALUE(key.find('.') == std::string::npos && !key.empty(), "TensorDictParams: key ",
                    quote_key(key),
                    " cannot name a parameter (torch::nn::Module names hold no "
                    "'.' and are not empty)");
  if (value.is_tensordict()) {
    std::shared_ptr<torch::nn::Module> child_like;
    if (like != nullptr) child_like = like->named_children()[key];
    TensorDictParamsOptions nested = options_;
    nested.lock = false;  // the root's lock_() locks every level
    register_module(key, std::shared_ptr<TensorDictParams>(
                             new TensorDictParams(value.tensordict(), nested, child_like.get())));
    return;
  }
  at::Tensor t = value.tensor();
  bool parameter = false;
  if (like != nullptr) {
    parameter = like->named_parameters(/*recurse=*/false).contains(key);
  } else if (options_.no_convert) {
    parameter = t.requires_grad();
  } else {
    parameter = is_float(t);
    if (parameter && t.grad_fn()) {  // the reference makes a new leaf of a non-leaf tensor
      t = t.detach();
      params_.set(key, t);
    }
  }
  // Both keep the tensor itself (the leaf's TensorImpl): the module's and the TensorDict's
  // values are one. A converted float leaf requires grad, as a new nn.Parameter does.
  if (parameter) {
    register_parameter(key, t, /*requires_grad=*/like != nullptr || options_.no_convert
                                   ? t.requires_grad()
                                   : true);
  } else {
    register_buffer(key, t);
  }
}

std::shared_ptr<TensorDictParams> TensorDictParams::from_module(const torch::nn::Module& module,
                                                                const FromModuleOptions& options) {
  FromModuleOptions o = options;
  o.lock = false;
  std::shared_ptr<TensorDictParams> out(new TensorDictParams(
      tensordict::from_module(module, o), TensorDictParamsOptions{.no_convert = true}, &module));
  if (options.lock) out->params_.lock_();
  return out;
}

void TensorDictParams::set(const NestedKey& key, const at::Tensor& value) {
  if (params_.contains(key)) {
    // In place: the registered tensor stays the module's (and an optimizer's) own.
    at::NoGradGuard no_grad;
    params_.set_(key, value);
    return;
  }
  TensorDictParams* level = this;
  for (size_t i = 0; i + 1 < key.size(); ++i) {
    // find(), not operator[], which throws its own error for a missing name.
    const auto children = level->named_children();
    const auto* child = children.find(key[i]);
    level = child ? dynamic_cast<TensorDictParams*>(child->get()) : nullptr;
    TORCH_CHECK_VALUE(level != nullptr, "TensorDictParams.set: ", key.str(),
                      " is not under a nested level of this module");
  }
  const bool locked = params_.is_locked();
  if (locked) params_.unlock_();
  level->params_.set(key.back(), value);
  if (locked) params_.lock_();
  level->register_entry(key.back(), level->params_.get(key.back()), nullptr);
}

}  // namespace tensordict

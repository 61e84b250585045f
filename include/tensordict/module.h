#pragma once
// A torch::nn::Module's parameters and buffers as a nested TensorDict and back: the reference's
// TensorDict.from_module / to_module, for flows that move or swap a model's state.

#include <optional>

#include "tensordict/tensor_dict.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace tensordict {

/// Options of from_module(), named like the reference's keywords.
struct FromModuleOptions {
  bool lock = false;         // lock the result
  bool filter_empty = true;  // leave out submodules without parameters or buffers
};

/// A TensorDict holding `module`'s parameters, then its buffers, then a nested TensorDict per
/// submodule (in registration order), batch size []. The leaves are the module's own tensors
/// (the same TensorImpl), not copies.
TensorDict from_module(const torch::nn::Module& module, const FromModuleOptions& options = {});

/// Options of to_module().
struct ToModuleOptions {
  bool inplace = false;     // copy into the module's tensors instead of pointing them at td's
  bool return_swap = true;  // return the values the module held before
};

/// Writes `td` into `module`: each leaf into the parameter or buffer of its name, each nested
/// level into the submodule of its name. Without `inplace` the module's tensors are pointed at
/// the leaves' storage (Tensor::set_data, as libtorch's Module::to does, so that the handles a
/// module keeps in its members see the change); with it, the leaves are copied in (no grad).
/// Returns the previous values when return_swap (a TensorDict of the same layout), else
/// nullopt. KeyError naming the key for a name the module does not have; TypeError for a
/// non-tensor entry.
std::optional<TensorDict> to_module(const TensorDict& td, torch::nn::Module& module,
                                    const ToModuleOptions& options = {});

}  // namespace tensordict

#pragma once
// TensorDictParams: a torch::nn::Module that holds a TensorDict whose leaves are its registered
// parameters and buffers, as the reference's tensordict.nn.TensorDictParams: the TensorDict a
// policy's weights live in for weight synchronisation. The leaves and the module's parameters
// are the same tensors, so a receive into params() (dist::recv, init_remote's peer, the pipe)
// writes into the parameters in place: an optimizer holding them, or the module they came from
// (from_module), sees the new values. The c10d receives bump the parameters' autograd versions
// (unlike the reference's), so a backward built before one raises instead of using them.
//
// Nested levels of the TensorDict are submodules (TensorDictParams of their own) under their
// keys, so named_parameters() gives "a.b" as the reference's flat names do. Not thread-safe for
// concurrent writes.

#include <torch/nn/module.h>

#include <memory>

#include "tensordict/module.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {

/// Options of the TensorDictParams constructor, named like the reference's keywords.
struct TensorDictParamsOptions {
  /// false (the reference's default): floating-point leaves (float16, float32, float64) become
  /// parameters requiring grad (one that already requires it keeps its setting), the others
  /// buffers. true: nothing is converted; a leaf that requires grad is a parameter, the others
  /// buffers.
  bool no_convert = false;
  /// Lock the TensorDict (the module's own writes, set() here, still work).
  bool lock = false;
};

class TensorDictParams : public torch::nn::Module {
 public:
  /// Wraps `params` (not copied: its leaves are registered as they are, converted in place as
  /// the options say). ValueError for a lazy stack or a non-tensor entry's level that cannot be
  /// registered (a key with a '.', which torch::nn::Module refuses, names it).
  explicit TensorDictParams(TensorDict params, const TensorDictParamsOptions& options = {});

  /// The reference's TensorDict.from_module(module, as_module=True): a TensorDictParams whose
  /// leaves are `module`'s own parameters and buffers (the same tensors), nothing converted.
  static std::shared_ptr<TensorDictParams> from_module(const torch::nn::Module& module,
                                                       const FromModuleOptions& options = {});

  /// The TensorDict; its leaves are this module's parameters and buffers.
  const TensorDict& params() const { return params_; }
  /// Writes `value` into the leaf at `key` in place (the registered tensor stays the same), or
  /// registers a new leaf as the constructor would convert it (nested levels that do not exist
  /// yet are refused). Works on a locked TensorDict, as the reference's writes through the
  /// module do.
  void set(const NestedKey& key, const at::Tensor& value);

 private:
  // `like`: the module whose parameters and buffers the entries are (from_module), which says
  // which is which; nullptr: by the options.
  TensorDictParams(TensorDict params, const TensorDictParamsOptions& options,
                   const torch::nn::Module* like);
  void register_entry(const std::string& key, const Value& value, const torch::nn::Module* like);
  TensorDict params_;
  TensorDictParamsOptions options_;
};

}  // namespace tensordict

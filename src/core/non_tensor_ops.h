#pragma once
// Private to the core: what the batch operations do with non-tensor entries (non_tensor.cpp).
// A NonTensorData or MetaData keeps its data and takes the new batch size; a NonTensorStack is
// moved element by element, through a tensor of element ids that the operation itself reshapes,
// indexes or stacks.

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

#include "tensordict/non_tensor.h"

namespace tensordict::detail {

/// The elements of a non-tensor entry: its plain (non-stack) members, and a tensor of the
/// entry's batch size whose every element is the index in `atoms` of the member holding it.
/// The pointers are valid while the entry lives.
struct NonTensorElements {
  std::vector<const NonTensorData*> atoms;
  at::Tensor ids;  // int64, the entry's batch size
};
NonTensorElements non_tensor_elements(const NonTensorData& nt);

/// The entry whose element at each position of `ids` is atoms[id]: a NonTensorData of batch
/// size [] for a 0-dim `ids`, else a stack along dim 0 of the entries of ids[i].
NonTensorData select_elements(const std::vector<const NonTensorData*>& atoms, const at::Tensor& ids,
                              std::optional<at::Device> device);

/// One result per new batch size: `fn` maps a tensor whose leading dims are the level's batch
/// (`level_dims` of them) to one tensor per result, as for the leaves (map_batch). A plain entry
/// keeps its data and its dims beyond the level's; a stack's elements move as fn moves them.
std::vector<NonTensorData> map_non_tensor(
    const NonTensorData& nt, size_t level_dims,
    const std::vector<std::vector<int64_t>>& new_batches,
    const std::function<std::vector<at::Tensor>(const at::Tensor&)>& fn);

/// torch.stack of non-tensor entries of one batch size along `dim` (non-negative): one MetaData
/// when every part is a MetaData of the same data (the reference's rule, with equality standing
/// for its identity test), else a NonTensorStack of the parts, as the reference stacks them.
NonTensorData stack_non_tensors(std::vector<NonTensorData> parts, int64_t dim);

/// torch.cat of non-tensor entries along `dim`: a plain entry when every part is the same plain
/// entry, else the stack of every element in the concatenated order.
NonTensorData cat_non_tensors(const std::vector<NonTensorData>& parts, int64_t dim);

}  // namespace tensordict::detail

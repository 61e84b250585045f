#pragma once
// The per-leaf order rule (docs/wire-format.md §1.2): the order in which send/recv and the
// checked transfer move a TensorDict's leaves, one message (one tag) each. Both sides derive it
// from their own TensorDict, so it is a wire format as much as a byte layout is.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "tensordict/tensor_dict.h"

namespace tensordict::wire {

/// Calls fn(path, leaf) in wire order: each level's keys sorted by code point (std::string's
/// ordering compares as unsigned char, i.e. UTF-8 byte order), nested levels at their key's
/// position, non-tensor entries left out; a lazy stack's members in stack order. `path` holds
/// the key path during each call, or is null (then no path is kept).
template <typename Fn>
void for_each_leaf(const TensorDict& td, std::vector<std::string>* path, Fn& fn) {
  const auto& entries = td.entries();
  std::vector<const TensorDict::Entry*> sorted;
  sorted.reserve(entries.size());
  for (const auto& entry : entries) {
    sorted.push_back(&entry);
  }
  // A lazy stack's members go in stack order, each with its own sorted keys (the reference's
  // LazyStackedTensorDict._send walks self.tensordicts).
  if (!td.is_lazy_stack()) {
    std::sort(sorted.begin(), sorted.end(),
              [](const auto* a, const auto* b) { return a->first < b->first; });
  }
  for (const auto* entry : sorted) {
    if (path) {
      path->push_back(entry->first);
    }
    if (entry->second.is_tensor()) {
      fn(path, entry->second.tensor());
    } else if (entry->second.is_tensordict()) {
      for_each_leaf(entry->second.tensordict(), path, fn);
    }  // a non-tensor entry takes no tag, as in the reference (docs/wire-format.md §1.2)
    if (path) {
      path->pop_back();
    }
  }
}

/// The leaves of `td` in wire order, as (key path, tensor).
std::vector<std::pair<std::vector<std::string>, at::Tensor>> leaves_in_order(const TensorDict& td);

}  // namespace tensordict::wire

#pragma once
// Private: the state behind a TensorDict handle, shared by the sources of the core.

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/WrapDimMinimal.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensordict/tensor_dict.h"

namespace tensordict::detail {

/// Changes of the entries of watched levels (TensorDictImpl::watched), in the whole process.
extern std::atomic<uint64_t> watched_changes;

struct TensorDictImpl {
  // Levels up to this many entries find keys by a scan; larger ones keep `index`. Most levels
  // on the wire are small, and a map per level is most of what building one costs.
  static constexpr size_t kScanEntries = 8;
  static constexpr size_t npos = static_cast<size_t>(-1);

  std::vector<TensorDict::Entry> entries;
  // key -> position in entries; filled exactly while entries.size() > kScanEntries.
  std::unordered_map<std::string_view, size_t> index;
  std::vector<int64_t> batch_size;
  std::optional<at::Device> device;
  bool locked = false;
  // Set on a lazy stack, whose entries are its members keyed "0", "1", ... (their batch size
  // is batch_size without stack_dim).
  struct LazyStack {
    int64_t stack_dim = 0;
    std::optional<std::string> stack_dim_name;
  };
  std::optional<LazyStack> lazy;
  std::shared_ptr<const ConsolidatedState> consolidated;
  // Bumped by every change of `entries`. With it, a consolidation checked against the views
  // once is trusted until some level's entries change, so that is_consolidated() costs one
  // comparison per level instead of a visit to every leaf (cold leaves cost ~0.1 us each).
  uint64_t generation = 0;
  // Part of some consolidation's check: a change is also counted in watched_changes.
  bool watched = false;
  // The generations of this level and its nested levels (pre-order of the metadata's
  // children) when `consolidated` last matched the views: the slice [checked_begin,
  // checked_end) of a list that the levels of one consolidation share (a level's subtree is
  // contiguous in its root's pre-order). Null: not known to match.
  std::shared_ptr<const std::vector<uint64_t>> checked_generations;
  uint32_t checked_begin = 0, checked_end = 0;
  // watched_changes when the generations last held: while it has not moved, no watched level
  // changed anywhere, and the levels need no walk (the nested benchmark has 1111 of them).
  // Atomic because a successful walk in the const is_consolidated() refreshes it.
  mutable std::atomic<uint64_t> checked_epoch{0};

  static TensorDict make(std::vector<int64_t> batch_size, std::optional<at::Device> device) {
    auto impl = std::make_shared<TensorDictImpl>();
    impl->batch_size = std::move(batch_size);
    impl->device = device;
    return TensorDict(std::move(impl));
  }
  static TensorDictImpl& of(const TensorDict& td) { return *td.impl_; }
  /// A lazy stack of `members` (non-empty, same batch size: callers checked) along the
  /// non-negative `stack_dim`.
  static TensorDict make_lazy(std::vector<TensorDict> members, int64_t stack_dim,
                              std::optional<std::string> stack_dim_name = std::nullopt);

  /// Appends or replaces an entry without validation (callers validated it).
  void put(const std::string& key, Value value) {
    changed();
    const size_t pos = position(key);
    if (pos != npos) {
      entries[pos].second = std::move(value);
      return;
    }
    // The index views the keys in entries: a reallocation moves short strings' characters.
    const bool reallocates = entries.size() == entries.capacity();
    entries.emplace_back(key, std::move(value));
    if (entries.size() > kScanEntries) {
      if (reallocates || index.empty()) {
        reindex();
      } else {
        index.emplace(entries.back().first, entries.size() - 1);
      }
    }
  }
  /// Appends entries copied from a level (whose keys are unique) without looking each up:
  /// building a level key by key costs a lookup and an index update per entry.
  void append_unique(const std::string& key, Value value) {
    entries.emplace_back(key, std::move(value));
  }
  /// Call after the last append_unique().
  void appended() {
    changed();
    reindex();
  }
  /// Removes the entry at `pos`.
  void erase_at(size_t pos) {
    changed();
    entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(pos));
    reindex();
  }
  void changed() {
    ++generation;
    if (watched) watched_changes.fetch_add(1, std::memory_order_relaxed);
  }
  size_t position(std::string_view key) const {
    if (entries.size() <= kScanEntries) {
      for (size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].first == key) return i;
      }
      return npos;
    }
    auto it = index.find(key);
    return it == index.end() ? npos : it->second;
  }
  const Value* find(std::string_view key) const {
    const size_t pos = position(key);
    return pos == npos ? nullptr : &entries[pos].second;
  }
  // Rebuilds `index` from entries (empty when they are few enough to scan).
  void reindex() {
    index.clear();
    if (entries.size() <= kScanEntries) return;
    index.reserve(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) index.emplace(entries[i].first, i);
  }
};

/// The reference's error for a change of a locked TensorDict.
inline constexpr const char* kLockedMessage =
    "Cannot modify locked TensorDict. For in-place modification, consider using the `set_()` "
    "method and make sure the key is present.";

/// The shape an entry contributes to batch checks: a leaf's sizes, a TensorDict's or a
/// non-tensor entry's batch size.
inline at::IntArrayRef entry_shape(const Value& v) {
  if (v.is_tensor()) return v.tensor().sizes();
  return v.is_tensordict() ? v.tensordict().batch_size() : v.non_tensor().batch_size();
}

/// `t` as a leaf of the kind `like` is (unbatched or not), for operations that replace a leaf.
inline Value same_kind(const Value& like, at::Tensor t) {
  return like.is_unbatched() ? Value::unbatched(std::move(t)) : Value(std::move(t));
}

/// "a tensor", "a TensorDict" or "a non-tensor entry", for messages.
const char* kind_name(const Value& v);

/// A batch index with its Ellipsis replaced by the full slices it stands for over `batch_dims`
/// batch dims (never the feature dims of leaves); IndexError for too many indices.
std::vector<at::indexing::TensorIndex> expand_ellipsis(at::ArrayRef<at::indexing::TensorIndex> idx,
                                                       int64_t batch_dims);

/// ValueError unless `shape` starts with `batch_size`, naming the key and both shapes.
void check_batch_prefix(const NestedKey& key, at::IntArrayRef shape, at::IntArrayRef batch_size);

/// `dim` as a non-negative index into `ndims` dims (negative counts from the end), as torch wraps
/// it; IndexError when out of range.
inline int64_t wrap_dim(int64_t dim, int64_t ndims) { return c10::maybe_wrap_dim(dim, ndims); }

/// Calls fn on every leaf of `td` where it lives (a lazy stack's in its members), for in-place
/// work and for reductions over every leaf.
template <typename Fn>
void each_leaf(const TensorDict& td, Fn&& fn) {
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensor()) {
      fn(value.tensor());
    } else if (value.is_tensordict()) {
      each_leaf(value.tensordict(), fn);
    }
  }
}

/// KeyError unless `a` and `b` have the same direct keys, naming the keys only one side has
/// (`what`: the operation, for the message).
void check_same_keys(const TensorDict& a, const TensorDict& b, const char* what);

// The walks the methods are built on: map_batch and map_one (tensor_dict_shape.cpp), map_leaves
// (tensor_dict_elementwise.cpp).
using LeafFn = std::function<std::vector<at::Tensor>(const at::Tensor&)>;
using LazyFn = std::function<std::vector<TensorDict>(const TensorDict&)>;
/// One TensorDict per new batch size, each leaf mapped by fn (which acts on the first
/// old_dims dims); a nested lazy stack gets lazy_fn, or is mapped as its dense stack.
std::vector<TensorDict> map_batch(const TensorDict& td, size_t old_dims,
                                  const std::vector<std::vector<int64_t>>& new_batches,
                                  const LeafFn& fn, const LazyFn& lazy_fn = nullptr);
/// map_batch with one result of batch size new_batch.
TensorDict map_one(const TensorDict& td, std::vector<int64_t> new_batch,
                   const std::function<at::Tensor(const at::Tensor&)>& fn);
/// What map_leaves does with a non-tensor entry: keep it, give it `device`, or drop it.
enum class NonTensors { kKeep, kMove, kDrop };
/// The same structure and batch size with every leaf replaced by fn's result (lazy stacks
/// member by member).
TensorDict map_leaves(const TensorDict& td, const std::function<at::Tensor(const at::Tensor&)>& fn,
                      std::optional<at::Device> device, NonTensors non_tensors = NonTensors::kKeep);

/// A lazy stack's members and stack dim (lazy_stack.cpp holds what the TensorDict methods do
/// on a lazy stack).
inline bool is_lazy(const TensorDict& td) { return TensorDictImpl::of(td).lazy.has_value(); }
inline int64_t stack_dim_of(const TensorDict& td) { return TensorDictImpl::of(td).lazy->stack_dim; }
std::vector<TensorDict> members_of(const TensorDict& td);

namespace lazy {
// The TensorDict methods on a lazy stack `td`, with the meaning lazy_stack.h gives them.
bool contains(const TensorDict& td, const NestedKey& key);
std::optional<Value> find(const TensorDict& td, const NestedKey& key);  // nullopt: absent
Value get(const TensorDict& td, const NestedKey& key);
void set(const TensorDict& td, const NestedKey& key, const Value& value);
void set_(const TensorDict& td, const NestedKey& key, const at::Tensor& tensor);
void set_non_tensor(const TensorDict& td, const NestedKey& key, const JsonValue& data);
Value pop(const TensorDict& td, const NestedKey& key);
/// The direct keys every member has, in member 0's order.
std::vector<std::string> common_keys(const TensorDict& td);
TensorDict index(const TensorDict& td, at::ArrayRef<at::indexing::TensorIndex> indices);
std::vector<TensorDict> unbind(const TensorDict& td, int64_t dim);
/// A lazy stack with fn applied to each member (same stack dim).
TensorDict map_members(const TensorDict& td,
                       const std::function<TensorDict(const TensorDict&)>& fn);
/// The dense TensorDict the stack stands for (torch.stack of every leaf).
TensorDict dense(const TensorDict& td);
std::string repr(const TensorDict& td);
}  // namespace lazy

}  // namespace tensordict::detail

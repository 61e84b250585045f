#pragma once
// TensorDict: an insertion-ordered, nested dictionary of tensors that share leading batch
// dimensions.

#include <ATen/TensorIndexing.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Scalar.h>
#include <c10/core/ScalarType.h>

#include <concepts>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "tensordict/errors.h"
#include "tensordict/json_value.h"
#include "tensordict/nested_key.h"
#include "tensordict/non_tensor.h"

namespace tensordict {

class Value;
struct ConsolidatedState;

class TestKey;  // the test hooks' passkey (set_consolidated_state)

namespace detail {
struct TensorDictImpl;
}  // namespace detail

/// Options of keys(), values() and items(), named like the reference's keywords.
struct KeysOptions {
  bool include_nested = false;  // also yield the entries of nested levels, as paths
  bool leaves_only = false;     // skip the nested TensorDicts themselves
  /// The reference's is_leaf: which entries count as leaves for leaves_only (a nested level
  /// for which it returns true is listed too, after its own entries, which include_nested
  /// still visits). Unset: tensors are the leaves.
  std::function<bool(const Value&)> is_leaf{};
};

/// Options of apply().
struct ApplyOptions {
  /// The result's batch size, for a function that changes the batch dims: the result is built
  /// leaf by leaf at that batch size (every nested level gets it). Unset: this one's.
  std::optional<std::vector<int64_t>> batch_size{};
};

/// Options of update().
struct UpdateOptions {
  bool clone = false;    // store clones of the other TensorDict's tensors
  bool inplace = false;  // copy into existing tensors (shapes and dtypes must match)
};

/// Options of select().
struct SelectOptions {
  bool inplace = false;  // drop the other keys from this TensorDict and return it
  bool strict = true;    // a missing key is a KeyError (otherwise it is skipped)
};

/// Options of repr(), as the reference's set_printoptions.
struct ReprOptions {
  bool compact = true;      // the one-line form of tensordict 0.15 (false: the detailed form)
  std::string type_name{};  // the class name shown (a tensorclass's); default: this one's
  // For a tensorclass's compact repr: fields not shown, fields shown as `key: token` after the
  // others (its unset ones, "None"), and the class names of nested levels by key ("*": all).
  std::vector<std::string> hidden{};
  std::vector<std::pair<std::string, std::string>> trailing{};
  std::vector<std::pair<std::string, std::string>> nested_names{};
};

/// Options of the reductions sum(), mean(), std(), max() and min(), named like the reference's
/// keywords. Without dims, every leaf is reduced over all of its elements (batch size []).
struct ReductionOptions {
  std::vector<int64_t> dims;  // batch dims to reduce (negative: from the end)
  bool feature = false;       // reduce every leaf's feature dims instead
  bool keepdim = false;
  std::optional<at::ScalarType> dtype{};  // sum and mean
  int64_t correction = 1;                 // std
};

/// The reduction reduce_all() applies: the reference's reduce=True of sum(), mean(), std(), max()
/// or min(), as c10d's ReduceOp names a collective's.
enum class Reduction { kSum, kMean, kStd, kMax, kMin };

/// A TensorDict is a handle: copying it copies a reference to the same dictionary, as a Python
/// variable does (and as at::Tensor does). clone() makes an independent copy. Entries keep
/// insertion order; each is a tensor (a leaf), a nested TensorDict, or a non-tensor entry
/// (NonTensorData, JSON-like data), and each starts with batch_size. A handle is not
/// thread-safe for concurrent mutation; concurrent reads are fine.
///
/// A handle may also be a lazy stack of TensorDicts (is_lazy_stack(); lazy_stack.h): the same
/// methods then read and write its members, as the reference's LazyStackedTensorDict does.
class TensorDict {
 public:
  using Entry = std::pair<std::string, Value>;

  /// An empty TensorDict with batch_size [] and no device.
  TensorDict();
  /// From entries in the given order. A key of several parts ({"a", "b"}) makes the nested
  /// levels it names, with this batch size and device, as set() does (the reference's
  /// TensorDict({("a", "b"): x})). Each value must start with its level's batch_size
  /// (ValueError naming the key otherwise). With a device, every leaf is moved there, as the
  /// reference does. Duplicate keys: the last value wins, at the first key's position.
  TensorDict(std::vector<std::pair<NestedKey, Value>> entries, at::IntArrayRef batch_size = {},
             std::optional<at::Device> device = std::nullopt);
  /// The same from entries keyed by one string each (entries() of another TensorDict). A
  /// template, so that a braced list of entries always means the constructor above.
  template <typename Entries>
    requires std::same_as<std::remove_cvref_t<Entries>, std::vector<Entry>>
  TensorDict(Entries&& entries, at::IntArrayRef batch_size = {},
             std::optional<at::Device> device = std::nullopt)
      : TensorDict(FlatEntries{}, std::vector<Entry>(std::forward<Entries>(entries)), batch_size,
                   device) {}
  /// From any map-like container of key -> Value (std::map, std::unordered_map, ...), in the
  /// container's iteration order.
  template <typename Map, typename = typename Map::mapped_type>
  explicit TensorDict(const Map& map, at::IntArrayRef batch_size = {},
                      std::optional<at::Device> device = std::nullopt)
      : TensorDict(FlatEntries{}, std::vector<Entry>(map.begin(), map.end()), batch_size, device) {}

  // ---- identity and shape ------------------------------------------------------------------
  /// True when both handles refer to the same dictionary.
  bool is_same(const TensorDict& other) const { return impl_ == other.impl_; }
  at::IntArrayRef batch_size() const;
  /// Changes the batch size; every entry must start with it (ValueError naming the key).
  TensorDict& set_batch_size(at::IntArrayRef batch_size);
  int64_t batch_dims() const;
  /// Product of the batch dims (1 for batch_size []).
  int64_t numel() const;
  std::optional<at::Device> device() const;

  // ---- entries -----------------------------------------------------------------------------
  bool contains(const NestedKey& key) const;
  /// The entry at the one-part key `key` of this level, or nullptr when absent: no KeyError and
  /// no copy, for lookups by a plain string on hot paths. Always null on a lazy stack (whose
  /// entries are its members). Valid until this level changes.
  const Value* find(std::string_view key) const;
  /// The entry at `key`; KeyError naming the missing level otherwise.
  Value get(const NestedKey& key) const;
  /// The entry at `key`, or `default_value` when any level is missing.
  Value get(const NestedKey& key, const Value& default_value) const;
  /// Sets `key`, creating missing intermediate levels (TensorDicts with this batch size and
  /// device). Replaces an existing entry in place (keeping its position). ValueError when the
  /// value's shape does not start with the batch size; RuntimeError when locked.
  TensorDict& set(const NestedKey& key, const Value& value);
  /// Copies `tensor` into the existing leaf at `key` (works on locked TensorDicts).
  TensorDict& set_(const NestedKey& key, const at::Tensor& tensor);
  /// Sets a non-tensor entry: `data` with this level's batch size and device (the level of
  /// `key`, created as set() creates it). Replaces an existing entry in place.
  TensorDict& set_non_tensor(const NestedKey& key, JsonValue data);
  /// The data of the non-tensor entry at `key` (a NonTensorStack's: its tolist()); KeyError
  /// when absent, TypeError when the entry is a tensor or a TensorDict.
  JsonValue get_non_tensor(const NestedKey& key) const;
  /// Sets a non-tensor entry as it is (NonTensorData, MetaData or NonTensorStack); its batch
  /// size must start with its level's (an empty one takes the level's). set() does the same.
  TensorDict& set_non_tensor(const NestedKey& key, NonTensorData entry);
  /// Removes the entry (KeyError if absent; RuntimeError when locked).
  TensorDict& erase(const NestedKey& key);
  /// Removes the entry and returns it.
  Value pop(const NestedKey& key);

  /// Direct entries in insertion order, without copying. A lazy stack's entries are its
  /// members, keyed "0", "1", ... (the keys its consolidated metadata gives them).
  const std::vector<Entry>& entries() const;
  /// True when this handle is a LazyStackedTensorDict (lazy_stack.h).
  bool is_lazy_stack() const;
  std::vector<NestedKey> keys(KeysOptions options = {}) const;
  std::vector<Value> values(KeysOptions options = {}) const;
  std::vector<std::pair<NestedKey, Value>> items(KeysOptions options = {}) const;
  /// The direct keys sorted by Unicode code point (byte order of UTF-8), the order in which
  /// per-leaf transfers visit a level.
  std::vector<std::string> sorted_keys() const;
  /// True when no leaf exists at any level.
  bool is_empty() const;

  // ---- locking -----------------------------------------------------------------------------
  bool is_locked() const;
  /// Locks this level and every nested level: set / erase raise until unlock_().
  TensorDict& lock_();
  TensorDict& unlock_();

  // ---- shape: the batch dims ---------------------------------------------------------------
  /// Indexes the batch dims like a tensor: integers, slices, None, Ellipsis, boolean masks and
  /// index tensors. Leaves are views wherever torch returns views.
  TensorDict index(at::ArrayRef<at::indexing::TensorIndex> indices) const;
  std::vector<TensorDict> unbind(int64_t dim = 0) const;
  TensorDict reshape(at::IntArrayRef shape) const;
  TensorDict view(at::IntArrayRef shape) const;
  TensorDict expand(at::IntArrayRef shape) const;
  TensorDict unsqueeze(int64_t dim) const;
  /// Removes every batch dim of size 1 (no dim) or the given one if it has size 1.
  TensorDict squeeze(std::optional<int64_t> dim = std::nullopt) const;
  std::vector<TensorDict> split(int64_t split_size, int64_t dim = 0) const;
  std::vector<TensorDict> split(at::IntArrayRef split_sizes, int64_t dim = 0) const;
  std::vector<TensorDict> chunk(int64_t chunks, int64_t dim = 0) const;
  /// Batch dims start_dim..end_dim merged into one.
  TensorDict flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  /// Batch dim `dim` split into `sizes` (one may be -1).
  TensorDict unflatten(int64_t dim, at::IntArrayRef sizes) const;
  TensorDict permute(at::IntArrayRef dims) const;
  TensorDict transpose(int64_t dim0, int64_t dim1) const;

  // ---- reductions and comparisons ----------------------------------------------------------
  TensorDict sum(const ReductionOptions& options = {}) const;
  TensorDict mean(const ReductionOptions& options = {}) const;
  TensorDict std(const ReductionOptions& options = {}) const;
  /// With one batch dim: the values and the indices, as torch.max(dim) gives; without dims,
  /// every leaf's maximum (indices undefined).
  std::pair<TensorDict, std::optional<TensorDict>> max(const ReductionOptions& options = {}) const;
  std::pair<TensorDict, std::optional<TensorDict>> min(const ReductionOptions& options = {}) const;
  /// The reference's reduce=True: one tensor over every leaf (sum, mean, std, max or min of
  /// all their elements; with dims, of the reduced leaves, which must then share a shape).
  at::Tensor reduce_all(Reduction op, const ReductionOptions& options = {}) const;

  /// Elementwise comparison: a TensorDict of bool tensors with the same structure.
  TensorDict operator==(const TensorDict& other) const;
  TensorDict operator!=(const TensorDict& other) const;
  TensorDict operator==(const at::Scalar& other) const;
  TensorDict operator!=(const at::Scalar& other) const;
  /// True when every element of every leaf is true (an empty TensorDict: true).
  bool all() const;
  /// True when any element of any leaf is true.
  bool any() const;
  bool allclose(const TensorDict& other, double rtol = 1e-5, double atol = 1e-8,
                bool equal_nan = false) const;

  // ---- elementwise: every leaf, one by one -------------------------------------------------
  TensorDict clone() const;
  TensorDict to(at::Device device) const;
  TensorDict to(at::ScalarType dtype) const;
  TensorDict contiguous() const;

  /// A new TensorDict with fn applied to every leaf (nested levels kept). A leaf for which fn
  /// returns an undefined tensor is left out.
  TensorDict apply(const std::function<at::Tensor(const at::Tensor&)>& fn,
                   const ApplyOptions& options = {}) const;
  /// fn(leaf, other's leaf at the same key) for every leaf; other needs every key of this.
  TensorDict apply(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& fn,
                   const TensorDict& other, const ApplyOptions& options = {}) const;
  /// fn applied to every leaf in place: each leaf is replaced by (or, when fn returns the same
  /// tensor, keeps) fn's result. Returns this TensorDict.
  TensorDict& apply_(const std::function<at::Tensor(const at::Tensor&)>& fn);
  /// apply() with the leaf's key: the full path (nested_keys) or the last part.
  TensorDict named_apply(const std::function<at::Tensor(const NestedKey&, const at::Tensor&)>& fn,
                         bool nested_keys = false) const;

  TensorDict& zero_();
  /// Fills the leaf (or every leaf of the nested TensorDict) at key with value.
  TensorDict& fill_(const NestedKey& key, const at::Scalar& value);

  /// Every leaf with `value` where `mask` (broadcast over the leaf's feature dims) is true.
  TensorDict masked_fill(const at::Tensor& mask, const at::Scalar& value) const;
  TensorDict& masked_fill_(const at::Tensor& mask, const at::Scalar& value);
  /// torch.where(condition, leaf, other's leaf) for every leaf.
  TensorDict where(const at::Tensor& condition, const TensorDict& other) const;
  TensorDict where(const at::Tensor& condition, const at::Scalar& other) const;
  TensorDict detach() const;
  TensorDict& detach_();
  TensorDict abs() const;
  TensorDict isfinite() const;

  /// In place, leaf by leaf: other may be a TensorDict with the same keys, a tensor or a scalar.
  TensorDict& add_(const TensorDict& other, const at::Scalar& alpha = 1);
  TensorDict& add_(const at::Tensor& other, const at::Scalar& alpha = 1);
  TensorDict& add_(const at::Scalar& other, const at::Scalar& alpha = 1);
  TensorDict& mul_(const TensorDict& other);
  TensorDict& mul_(const at::Tensor& other);
  TensorDict& mul_(const at::Scalar& other);
  TensorDict& lerp_(const TensorDict& end, const at::Scalar& weight);
  TensorDict& lerp_(const TensorDict& end, const TensorDict& weight);

  /// Elementwise arithmetic with a TensorDict of the same keys, or a tensor or scalar broadcast
  /// to every leaf (a new TensorDict).
  TensorDict operator+(const TensorDict& other) const;
  TensorDict operator-(const TensorDict& other) const;
  TensorDict operator*(const TensorDict& other) const;
  TensorDict operator/(const TensorDict& other) const;
  TensorDict operator+(const at::Tensor& other) const;
  TensorDict operator-(const at::Tensor& other) const;
  TensorDict operator*(const at::Tensor& other) const;
  TensorDict operator/(const at::Tensor& other) const;
  TensorDict operator+(const at::Scalar& other) const;
  TensorDict operator-(const at::Scalar& other) const;
  TensorDict operator*(const at::Scalar& other) const;
  TensorDict operator/(const at::Scalar& other) const;

  /// Every leaf in page-locked memory (needs an accelerator backend; RuntimeError otherwise).
  TensorDict pin_memory() const;
  /// Every CPU leaf moved to shared memory (as torch's share_memory_); locks the TensorDict, as
  /// the reference does.
  TensorDict& share_memory_();
  /// True when every leaf is in shared (or CUDA) memory and there is at least one.
  bool is_shared() const;

  // ---- structure: which entries, under which keys ------------------------------------------
  /// A TensorDict of the given keys only (nested keys keep their levels), sharing the leaves.
  TensorDict select(const std::vector<NestedKey>& keys, const SelectOptions& options = {}) const;
  /// A TensorDict without the given keys (missing ones are ignored), sharing the leaves.
  TensorDict exclude(const std::vector<NestedKey>& keys, bool inplace = false) const;
  /// Nested levels flattened into keys joined by `separator` ({"a", "b"} -> "a.b").
  TensorDict flatten_keys(const std::string& separator = ".") const;
  /// The inverse: keys holding `separator` become nested levels.
  TensorDict unflatten_keys(const std::string& separator = ".") const;
  /// Moves the entry at old_key to new_key (KeyError if old_key is absent; with `safe`, a
  /// KeyError if new_key exists).
  TensorDict& rename_key_(const NestedKey& old_key, const NestedKey& new_key, bool safe = false);
  /// The entry at `key`, setting `default_value` there first when it is absent.
  Value setdefault(const NestedKey& key, const Value& default_value);
  /// Sets every entry of `other` here (nested levels merged key by key).
  TensorDict& update(const TensorDict& other, UpdateOptions options = {});
  /// Copies every leaf of `other` into the existing leaf at the same key (KeyError naming a
  /// key this TensorDict lacks); with keys_to_update, only those.
  TensorDict& update_(const TensorDict& other, const std::vector<NestedKey>& keys_to_update = {});
  /// Writes `value` into the leaf at `key`, at `index` of its batch dims.
  TensorDict& set_at_(const NestedKey& key, const at::Tensor& value,
                      at::ArrayRef<at::indexing::TensorIndex> index);
  /// The leaf at `key`, indexed by `index`.
  at::Tensor get_at(const NestedKey& key, at::ArrayRef<at::indexing::TensorIndex> index) const;
  /// The same TensorDict without its non-tensor entries (at every level).
  TensorDict filter_non_tensor_data() const;
  /// A TensorDict with the same batch size and device and no leaves (with `recurse`, the same
  /// nested levels, empty).
  TensorDict empty(bool recurse = false) const;
  /// A new structure sharing the leaves (the reference's copy(), clone(recurse=False)).
  TensorDict copy() const;
  /// Copies every leaf of `src` (same keys and shapes) into this TensorDict's leaves.
  TensorDict& copy_(const TensorDict& src);

  /// The reference's repr: by default its compact form, TensorDict(batch_size=[4],
  /// fields={next: {reward: f32[1]}, obs: f32[3]}), wrapped at 80 columns; with compact =
  /// false its detailed form, TensorDict(fields={...}, batch_size=..., device=..., is_shared=...).
  std::string repr(const ReprOptions& options = {}) const;

  // ---- consolidation (consolidate.h uses these) ---------------------------------------------
  /// The flat storage state when this TensorDict was produced by consolidate() or a rebuild;
  /// nullptr otherwise.
  std::shared_ptr<const ConsolidatedState> consolidated_state() const;
  /// Test hook: a state set from outside, which is_consolidated() then checks against the
  /// entries. Only the project's tests can make the key (src/core/include/core/testing.h).
  void set_consolidated_state(const TestKey& key, std::shared_ptr<const ConsolidatedState> state);

 protected:
  explicit TensorDict(std::shared_ptr<detail::TensorDictImpl> impl) : impl_(std::move(impl)) {}

 private:
  struct FlatEntries {};
  TensorDict(FlatEntries, std::vector<Entry> entries, at::IntArrayRef batch_size,
             std::optional<at::Device> device);
  friend struct detail::TensorDictImpl;
  std::shared_ptr<detail::TensorDictImpl> impl_;
};

/// One entry of a TensorDict: a tensor leaf, a nested TensorDict or a non-tensor entry.
class Value {
 public:
  Value(at::Tensor tensor) : v_(std::move(tensor)) {}  // NOLINT: implicit on purpose
  Value(TensorDict td) : v_(std::move(td)) {}          // NOLINT
  Value(NonTensorData data) : v_(std::move(data)) {}   // NOLINT
  /// The reference's UnbatchedTensor: a leaf whose shape need not start with its level's batch
  /// size. Batch operations (index, reshape, stack, ...) pass it through whole; operations on
  /// the values (clone, to, apply) apply to it and keep it unbatched. Per-leaf transfers and
  /// the reductions move it like any leaf; consolidate() refuses it (NotImplementedError), as
  /// the reference does.
  static Value unbatched(at::Tensor tensor) {
    Value v(std::move(tensor));
    v.unbatched_ = true;
    return v;
  }

  bool is_tensor() const { return v_.index() == 0; }
  /// A tensor leaf made by unbatched().
  bool is_unbatched() const { return unbatched_; }
  bool is_tensordict() const { return v_.index() == 1; }
  bool is_non_tensor() const { return v_.index() == 2; }
  /// The tensor; TypeError when this is something else.
  const at::Tensor& tensor() const;
  /// The TensorDict; TypeError when this is something else.
  const TensorDict& tensordict() const;
  /// The non-tensor entry; TypeError when this is something else.
  const NonTensorData& non_tensor() const;

 private:
  std::variant<at::Tensor, TensorDict, NonTensorData> v_;
  bool unbatched_ = false;
};

/// Stacks TensorDicts with the same keys and batch size along a new batch dim.
TensorDict stack(at::ArrayRef<TensorDict> tds, int64_t dim = 0);
/// Concatenates TensorDicts with the same keys along an existing batch dim.
TensorDict cat(at::ArrayRef<TensorDict> tds, int64_t dim = 0);

std::ostream& operator<<(std::ostream& os, const TensorDict& td);

}  // namespace tensordict

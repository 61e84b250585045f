#pragma once
// NonTensorData: a non-tensor entry of a TensorDict, in one of the reference's three forms
// (NonTensorKind):
// - NonTensorData: JSON-like data for the whole batch (a label, an id, a config value);
// - MetaData: the same, but kept whole where the reference's MetaData is kept whole (stacking
//   equal values gives one MetaData, not a stack);
// - NonTensorStack: one member per index of `stack_dim` (stacking TensorDicts whose text
//   differs, or a list assigned to a key), each member itself a NonTensorData or a stack.
// Each carries the batch size and device of the level that holds it. Per-leaf transfers and
// reductions skip every form without consuming a tag; consolidate() records a NonTensorData or
// MetaData in its node's "non_tensors" and a stack as a "NonTensorStack" node
// (docs/wire-format.md §3.2), and rebuild() restores them, so init_remote, the collectives and
// the pipe deliver them. A value is immutable: copies share it.

#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensordict/json_value.h"

namespace tensordict {

class NonTensorData;
namespace detail {
NonTensorData empty_stack(std::vector<int64_t> batch_size, std::optional<at::Device> device);
}  // namespace detail

/// Which of the reference's non-tensor classes an entry is.
enum class NonTensorKind : uint8_t {
  kData,      // NonTensorData
  kMetaData,  // MetaData
  kStack,     // NonTensorStack
};

class NonTensorData {
 public:
  explicit NonTensorData(JsonValue data, std::vector<int64_t> batch_size = {},
                         std::optional<at::Device> device = std::nullopt,
                         NonTensorKind kind = NonTensorKind::kData);
  /// The reference's MetaData(data, batch_size, device).
  static NonTensorData metadata(JsonValue data, std::vector<int64_t> batch_size = {},
                                std::optional<at::Device> device = std::nullopt) {
    return NonTensorData(std::move(data), std::move(batch_size), device, NonTensorKind::kMetaData);
  }
  /// The reference's NonTensorStack(*members, stack_dim=, stack_dim_name=): `members` share a
  /// batch size, and the stack's is theirs with their count inserted at `stack_dim` (which may
  /// be negative, counted from their batch dims + 1). No member: batch size [0]. The device is
  /// the members' common one, if any. ValueError naming the member whose batch size differs.
  static NonTensorData stack(std::vector<NonTensorData> members, int64_t stack_dim = 0,
                             std::optional<std::string> stack_dim_name = std::nullopt);
  /// The reference's NonTensorStack.from_list: nested lists of equal lengths become nested
  /// stacks (at most `ndim` levels when given), anything else a member NonTensorData with
  /// batch size []. TypeError when `values` is not a list. A list that reuses one list many
  /// times (a pickle's memo, `[row] * n`) becomes one member per use: counted first, in
  /// O(distinct lists), and ValueError, starting with `what`, when the members would take more
  /// than 256 MiB (core::kMaxJsonExpansion) beyond one member per item of its distinct lists.
  static NonTensorData from_list(const JsonValue& values,
                                 std::optional<at::Device> device = std::nullopt,
                                 std::optional<int64_t> ndim = std::nullopt,
                                 std::string_view what = "NonTensorStack.from_list");

  NonTensorKind kind() const { return kind_; }
  bool is_stack() const { return kind_ == NonTensorKind::kStack; }
  bool is_metadata() const { return kind_ == NonTensorKind::kMetaData; }
  /// "NonTensorData", "MetaData" or "NonTensorStack".
  const char* class_name() const;

  /// The data of a NonTensorData or MetaData. A stack holds one value per element: TypeError
  /// (the reference's "Cannot get the non-unique data of a NonTensorStack") unless
  /// common_data() has one.
  const JsonValue& data() const;
  /// A stack's value when every element holds the same one (nullopt otherwise, and for an
  /// empty stack); data() for the other kinds.
  std::optional<JsonValue> common_data() const;
  /// The values, one per batch element, as nested lists following the batch dims (row-major,
  /// whatever the stack dims); a NonTensorData with batch dims repeats its data, one with
  /// batch size [] is its data. The reference's tolist().
  JsonValue tolist() const;

  at::IntArrayRef batch_size() const { return batch_size_; }
  std::optional<at::Device> device() const { return device_; }
  /// A stack's members (empty for the other kinds).
  const std::vector<NonTensorData>& members() const;
  int64_t stack_dim() const { return stack_dim_; }
  const std::optional<std::string>& stack_dim_name() const { return stack_dim_name_; }

  /// A NonTensorData or MetaData with another batch size (a stack's follows its members:
  /// ValueError).
  NonTensorData with_batch_size(std::vector<int64_t> batch_size) const;
  /// The entry's slices along batch dim `dim` (negative: from the end): a stack's members along
  /// its stack dim, stacks of the elements along another dim, and copies of a NonTensorData or
  /// MetaData without that dim.
  std::vector<NonTensorData> unbind(int64_t dim) const;
  /// The same entry on another device (a stack's members too).
  NonTensorData with_device(std::optional<at::Device> device) const;

  /// The reference's repr: NonTensorData(data=..., batch_size=torch.Size([...]), device=...)
  /// (MetaData alike), or a NonTensorStack's three lines.
  std::string repr() const;

  /// Same kind, batch size, device and data (bit for bit, NaN included), members alike.
  bool operator==(const NonTensorData& other) const;

 private:
  friend NonTensorData detail::empty_stack(std::vector<int64_t>, std::optional<at::Device>);
  NonTensorData() = default;
  JsonValue data_;
  std::vector<int64_t> batch_size_;
  std::optional<at::Device> device_;
  NonTensorKind kind_ = NonTensorKind::kData;
  std::shared_ptr<const std::vector<NonTensorData>> members_;  // kStack only
  int64_t stack_dim_ = 0;
  std::optional<std::string> stack_dim_name_;
};

}  // namespace tensordict

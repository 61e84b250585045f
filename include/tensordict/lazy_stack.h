#pragma once
// LazyStackedTensorDict: TensorDicts stacked along a new batch dim without copying their
// leaves, which may differ in shape (heterogeneous stacks), as the reference's
// LazyStackedTensorDict. It is a TensorDict handle (is_lazy_stack()), so it nests as a value,
// and every transfer takes it, with the reference's wire: per-leaf transfers visit the members
// in order, consolidate() records a "LazyStackedTensorDict" node whose children are the
// members (docs/wire-format.md §3), and rebuild() restores the stack.
//
// What the TensorDict methods do on a lazy stack:
// - keys(), items(), values(), contains(): the keys every member has, in member 0's order;
//   a nested level is the lazy stack of the members' levels. get() of a leaf stacks the
//   members' tensors (a copy; RuntimeError naming the key and the shapes when they differ).
// - set(), set_(), set_non_tensor(), erase(), pop(), fill_(), zero_(), update(): write into
//   every member (a value is unbound along the stack dim). Nothing is written unless every
//   part fits.
// - index(): an integer at the stack dim returns that member (the same handle when nothing else
//   is indexed), a slice or a 1-D index tensor a lazy stack of the chosen members; other
//   indices apply to every member. unbind() along the stack dim returns the members.
// - clone(), to(), apply(), lock_(): member by member, keeping the stack. contiguous(): the dense
//   TensorDict (an error naming the key when the members' shapes differ).
// - Operations that reshape the batch (reshape, view, expand, squeeze, unsqueeze, split) act
//   on contiguous(): a dense copy.

#include <optional>
#include <string>
#include <vector>

#include "tensordict/tensor_dict.h"

namespace tensordict {

class LazyStackedTensorDict : public TensorDict {
 public:
  /// Stacks `tensordicts` (at least one, all with the same batch size) along `stack_dim`, which
  /// may be negative (counted from batch_dims + 1). The members are shared, not copied. The
  /// stack's device is the members' common device, if any.
  explicit LazyStackedTensorDict(std::vector<TensorDict> tensordicts, int64_t stack_dim = 0,
                                 std::optional<std::string> stack_dim_name = std::nullopt);
  /// `td` as a LazyStackedTensorDict; TypeError unless td.is_lazy_stack().
  static LazyStackedTensorDict of(const TensorDict& td);

  /// The members, in stack order (handles to the same TensorDicts).
  std::vector<TensorDict> tensordicts() const;
  int64_t stack_dim() const;
  const std::optional<std::string>& stack_dim_name() const;
  /// Keys (as NestedKey paths, leaves and levels) that some members have and others lack:
  /// member i -> its keys that are not in every member.
  std::vector<std::vector<NestedKey>> exclusive_keys() const;

 private:
  explicit LazyStackedTensorDict(const TensorDict& td) : TensorDict(td) {}
};

/// LazyStackedTensorDict(tds, dim), as the reference's tensordict.lazy_stack.
LazyStackedTensorDict lazy_stack(std::vector<TensorDict> tds, int64_t dim = 0);

/// The reference's LazyStackedTensorDict.maybe_dense_stack: stack() when the TensorDicts have
/// the same keys and leaf shapes (level by level: a nested level that differs becomes a lazy
/// stack inside the dense result), else lazy_stack(). ValueError for an empty list;
/// RuntimeError when the batch sizes have different numbers of dims.
TensorDict maybe_dense_stack(const std::vector<TensorDict>& tds, int64_t dim = 0);

}  // namespace tensordict

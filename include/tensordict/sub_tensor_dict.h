#pragma once
// SubTensorDict: a view of the rows of a parent TensorDict that an index selects, as the
// reference's _SubTensorDict (what td._get_sub_tensordict(index) returns and what
// td[index] = value writes through): reads come from the parent at the index, writes land in
// the parent's storage. With basic indices (integers, slices, None, Ellipsis) the leaves of
// view() are views of the parent's, so a receive into them (dist::recv(SubTensorDict&), which
// p2p.h declares) lands in the parent without a copy; with advanced ones (index tensors, masks)
// torch can only copy, and the values are written back at the index after the receive.
//
// A SubTensorDict holds a handle to its parent (TensorDict handles share the dictionary), so it
// sees later changes of the parent; not thread-safe for concurrent writes.

#include <ATen/TensorIndexing.h>

#include <vector>

#include "tensordict/tensor_dict.h"

namespace tensordict {

class SubTensorDict {
 public:
  /// The rows of `parent` that `index` selects (the reference's idx): IndexError when the index
  /// does not fit the parent's batch size, as the parent's index() says.
  SubTensorDict(TensorDict parent, std::vector<at::indexing::TensorIndex> index);

  const TensorDict& parent() const { return parent_; }
  const std::vector<at::indexing::TensorIndex>& index() const { return index_; }
  /// True when every part of the index is an integer, a slice, None or Ellipsis: view()'s
  /// leaves then share the parent's storage.
  bool is_view() const { return is_view_; }
  at::IntArrayRef batch_size() const { return batch_size_; }

  /// parent().index(index()): views of the parent's leaves for basic indices, copies for
  /// advanced ones.
  TensorDict view() const;
  /// The entry at `key` of view() (KeyError naming the key when the parent lacks it).
  Value get(const NestedKey& key) const;
  /// Writes `tensor` into the parent's leaf at `key`, at the index (works on a locked parent).
  void set_(const NestedKey& key, const at::Tensor& tensor) const;
  /// set_() for an existing leaf; for a new key, the parent gets a leaf of zeros (a new
  /// non-tensor entry: the value for every row, as the reference does) and the rows are
  /// written. RuntimeError on a locked parent for a new key.
  void set(const NestedKey& key, const Value& value) const;
  /// Writes every leaf of `values` (view()'s keys, shapes and dtypes) into the parent at the
  /// index: what a receive into an advanced-index view does afterwards.
  void update_(const TensorDict& values) const;
  /// An independent copy of the rows (view().clone()).
  TensorDict to_tensordict() const;

 private:
  TensorDict parent_;
  std::vector<at::indexing::TensorIndex> index_;
  std::vector<int64_t> batch_size_;
  bool is_view_ = true;
};

}  // namespace tensordict

#include "tensordict/sub_tensor_dict.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "tensor_dict_impl.h"

namespace tensordict {

SubTensorDict::SubTensorDict(TensorDict parent, std::vector<at::indexing::TensorIndex> index)
    : parent_(std::move(parent)), index_(detail::expand_ellipsis(index, parent_.batch_dims())) {
  for (const auto& i : index_) {
    if (i.is_tensor()) is_view_ = false;
  }
  // The batch size the index gives, and an early IndexError for one that does not fit.
  batch_size_ = at::zeros({}, at::kByte).expand(parent_.batch_size()).index(index_).sizes().vec();
}

TensorDict SubTensorDict::view() const { return parent_.index(index_); }

Value SubTensorDict::get(const NestedKey& key) const { return view().get(key); }

void SubTensorDict::set_(const NestedKey& key, const at::Tensor& tensor) const {
  const Value v = parent_.get(key);
  TORCH_CHECK_TYPE(v.is_tensor(), "set_: key ", key.str(), " holds ", detail::kind_name(v),
                   "; set_ writes into an existing tensor");
  // Writes of received values into parameters that require grad are not autograd's business.
  at::NoGradGuard no_grad;
  if (v.is_unbatched()) {
    at::Tensor(v.tensor()).copy_(tensor);  // not indexed: the whole leaf, as the reference
    return;
  }
  TensorDict(parent_).set_at_(key, tensor, index_);
}

void SubTensorDict::set(const NestedKey& key, const Value& value) const {
  if (parent_.contains(key) && value.is_tensor() && parent_.get(key).is_tensor()) {
    set_(key, value.tensor());
    return;
  }
  TORCH_CHECK(!parent_.contains(key), "SubTensorDict.set: key ", key.str(),
              " exists and is not a tensor; replace it in the parent");
  if (!value.is_tensor()) {
    // A non-tensor entry or a TensorDict: for every row, as the reference's sub-tensordict sets
    // a new non-tensor entry in its parent.
    TORCH_CHECK_VALUE(value.is_non_tensor(), "SubTensorDict.set: a new nested TensorDict ",
                      key.str(), " cannot be written into some rows only; set it in the parent");
    TensorDict(parent_).set(key, value.non_tensor().with_batch_size({}));
    return;
  }
  const at::Tensor& t = value.tensor();
  const int64_t dims = static_cast<int64_t>(batch_size_.size());
  TD_CHECK_BATCH(t.dim() >= dims && t.sizes().slice(0, dims) == at::IntArrayRef(batch_size_),
                 "SubTensorDict.set: key ", key.str(), " has shape ", t.sizes(),
                 ", which does not start with the batch size ", at::IntArrayRef(batch_size_));
  std::vector<int64_t> shape = parent_.batch_size().vec();
  for (int64_t d = dims; d < t.dim(); ++d) shape.push_back(t.size(d));
  TensorDict(parent_).set(key, at::zeros(shape, t.options()));
  set_(key, t);
}

void SubTensorDict::update_(const TensorDict& values) const {
  for (const auto& [key, v] : values.items({.include_nested = true, .leaves_only = true})) {
    set_(key, v.tensor());
  }
}

TensorDict SubTensorDict::to_tensordict() const { return view().clone(); }

}  // namespace tensordict

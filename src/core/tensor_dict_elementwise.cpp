// Elementwise: every leaf mapped or changed in place (clone, to, apply, arithmetic, memory).

#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>

#include <cstring>

#include "tensor_dict_impl.h"

namespace tensordict {

using detail::each_leaf;
using detail::map_leaves;
using detail::NonTensors;
using detail::TensorDictImpl;

namespace detail {

// Same structure and batch size, each leaf replaced; used by clone, to, contiguous, ==.
// Non-tensor entries are kept as they are (the data is immutable, so a copy is a clone), given
// `device` (kMove, for to(device)), or left out (kDrop, for results that hold only tensors).
// A lazy stack stays one, member by member.
TensorDict map_leaves(const TensorDict& td, const std::function<at::Tensor(const at::Tensor&)>& fn,
                      std::optional<at::Device> device, NonTensors non_tensors) {
  if (td.is_lazy_stack()) {
    return detail::lazy::map_members(td, [&](const TensorDict& m) {
      return map_leaves(m, fn, device.has_value() ? device : m.device(), non_tensors);
    });
  }
  TensorDict out = TensorDictImpl::make(td.batch_size().vec(), device);
  auto& impl = TensorDictImpl::of(out);
  impl.entries.reserve(td.entries().size());
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensor()) {
      impl.append_unique(key, detail::same_kind(value, fn(value.tensor())));
    } else if (value.is_non_tensor()) {
      const NonTensorData& nt = value.non_tensor();
      if (non_tensors == NonTensors::kKeep) {
        impl.append_unique(key, value);
      } else if (non_tensors == NonTensors::kMove) {
        impl.append_unique(key, nt.with_device(device));
      }
    } else {
      const TensorDict& child = value.tensordict();
      impl.append_unique(
          key, map_leaves(child, fn, device.has_value() ? device : child.device(), non_tensors));
    }
  }
  impl.appended();
  return out;
}

}  // namespace detail

namespace {

// A mask or condition over the batch dims, viewed so that it broadcasts over a leaf's feature
// dims (the reference's expand_right).
at::Tensor expand_right(const at::Tensor& mask, const at::Tensor& leaf) {
  TORCH_CHECK(mask.dim() <= leaf.dim(), "the mask of shape ", mask.sizes(),
              " has more dims than a leaf of shape ", leaf.sizes());
  std::vector<int64_t> shape = mask.sizes().vec();
  shape.resize(static_cast<size_t>(leaf.dim()), 1);
  return mask.reshape(shape).expand(leaf.sizes());
}

TensorDict with_each(const TensorDict& td, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  return map_leaves(td, fn, td.device(), NonTensors::kKeep);
}

// apply() with ApplyOptions::batch_size: each leaf's result set at its key in a new TensorDict of
// that batch size (missing levels made with it), as the reference builds it; non-tensor entries
// are left out, as the reference's leaves are tensors.
TensorDict apply_at_batch(
    const TensorDict& td, const std::vector<int64_t>& batch_size,
    const std::function<at::Tensor(const NestedKey&, const at::Tensor&)>& fn) {
  TensorDict out(std::vector<std::pair<NestedKey, Value>>{}, batch_size, td.device());
  for (const auto& [key, value] : td.items({.include_nested = true, .leaves_only = true})) {
    at::Tensor r = fn(key, value.tensor());
    if (r.defined()) out.set(key, r);
  }
  return out;
}

}  // namespace

TensorDict TensorDict::clone() const {
  return map_leaves(*this, [](const at::Tensor& t) { return t.clone(); }, device());
}

TensorDict TensorDict::to(at::Device device) const {
  return map_leaves(
      *this, [&](const at::Tensor& t) { return t.to(device); }, device, NonTensors::kMove);
}

TensorDict TensorDict::to(at::ScalarType dtype) const {
  return map_leaves(*this, [&](const at::Tensor& t) { return t.to(dtype); }, device());
}

TensorDict TensorDict::contiguous() const {
  if (is_lazy_stack()) return detail::lazy::dense(*this);
  return map_leaves(*this, [](const at::Tensor& t) { return t.contiguous(); }, device());
}

TensorDict TensorDict::apply(const std::function<at::Tensor(const at::Tensor&)>& fn,
                             const ApplyOptions& options) const {
  if (options.batch_size) {
    return apply_at_batch(*this, *options.batch_size,
                          [&](const NestedKey&, const at::Tensor& t) { return fn(t); });
  }
  if (is_lazy_stack()) {
    return detail::lazy::map_members(*this, [&](const TensorDict& m) { return m.apply(fn); });
  }
  TensorDict out = TensorDictImpl::make(batch_size().vec(), device());
  for (const auto& [key, value] : entries()) {
    if (value.is_tensor()) {
      at::Tensor r = fn(value.tensor());
      if (r.defined()) out.set(key, detail::same_kind(value, r));
    } else if (value.is_non_tensor()) {
      out.set(key, value);  // the reference's apply passes non-tensors through
    } else {
      out.set(key, value.tensordict().apply(fn));
    }
  }
  return out;
}

TensorDict TensorDict::apply(
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& fn,
    const TensorDict& other, const ApplyOptions& options) const {
  if (options.batch_size) {
    return apply_at_batch(
        *this, *options.batch_size,
        [&](const NestedKey& key, const at::Tensor& t) { return fn(t, other.get(key).tensor()); });
  }
  if (is_lazy_stack()) {
    // Member i with other's slice i along the stack dim.
    const auto others = other.unbind(detail::stack_dim_of(*this));
    TORCH_CHECK_VALUE(others.size() == entries().size(), "apply: the other TensorDict has ",
                      others.size(), " entries along the stack dim, this lazy stack ",
                      entries().size());
    size_t i = 0;
    return detail::lazy::map_members(*this,
                                     [&](const TensorDict& m) { return m.apply(fn, others[i++]); });
  }
  TensorDict out = TensorDictImpl::make(batch_size().vec(), device());
  for (const auto& [key, value] : entries()) {
    if (value.is_non_tensor()) {
      out.set(key, value);  // passed through, as by the one-argument apply
      continue;
    }
    const Value o = other.get(key);
    if (value.is_tensor()) {
      TORCH_CHECK_TYPE(o.is_tensor(), "apply: key ", quote_key(key), " is a tensor here but ",
                       detail::kind_name(o), " in the other TensorDict");
      at::Tensor r = fn(value.tensor(), o.tensor());
      if (r.defined()) out.set(key, detail::same_kind(value, r));
    } else {
      TORCH_CHECK_TYPE(o.is_tensordict(), "apply: key ", quote_key(key),
                       " is a TensorDict here but ", detail::kind_name(o),
                       " in the other TensorDict");
      out.set(key, value.tensordict().apply(fn, o.tensordict()));
    }
  }
  return out;
}

TensorDict& TensorDict::apply_(const std::function<at::Tensor(const at::Tensor&)>& fn) {
  each_leaf(*this, [&](const at::Tensor& t) {
    const at::Tensor r = fn(t);
    if (r.defined() && !r.is_same(t)) at::Tensor(t).copy_(r);
  });
  return *this;
}

TensorDict TensorDict::named_apply(
    const std::function<at::Tensor(const NestedKey&, const at::Tensor&)>& fn,
    bool nested_keys) const {
  const auto walk = [&](const auto& self, const TensorDict& td,
                        const std::vector<std::string>& prefix) -> TensorDict {
    if (td.is_lazy_stack()) {
      return detail::lazy::map_members(td,
                                       [&](const TensorDict& m) { return self(self, m, prefix); });
    }
    TensorDict out = TensorDictImpl::make(td.batch_size().vec(), td.device());
    for (const auto& [key, value] : td.entries()) {
      std::vector<std::string> path = prefix;
      path.push_back(key);
      if (value.is_tensor()) {
        at::Tensor r = fn(nested_keys ? NestedKey(path) : NestedKey(key), value.tensor());
        if (r.defined()) out.set(key, detail::same_kind(value, r));
      } else if (value.is_tensordict()) {
        TensorDictImpl::of(out).put(key, self(self, value.tensordict(), path));
      } else {
        TensorDictImpl::of(out).put(key, value);
      }
    }
    return out;
  };
  return walk(walk, *this, {});
}

TensorDict& TensorDict::zero_() {
  for (const auto& [key, value] : entries()) {
    if (value.is_tensor()) {
      at::Tensor(value.tensor()).zero_();
    } else if (value.is_tensordict()) {
      TensorDict(value.tensordict()).zero_();
    }  // non-tensor entries are left as they are, as by the reference
  }
  return *this;
}

TensorDict& TensorDict::fill_(const NestedKey& key, const at::Scalar& value) {
  const Value v = get(key);
  TORCH_CHECK_TYPE(!v.is_non_tensor(), "fill_: key ", key.str(),
                   " holds a non-tensor entry, which cannot be filled");
  if (v.is_tensor()) {
    // set_ writes into the leaf itself, also when get() stacked it from a lazy stack's members.
    set_(key, at::scalar_tensor(value, v.tensor().options()));
  } else {
    // The level's own leaves (a lazy stack's level holds its members' levels).
    const auto fill_all = [&](const auto& self, const TensorDict& td) -> void {
      for (const auto& [k, e] : td.entries()) {
        if (e.is_tensor()) {
          at::Tensor(e.tensor()).fill_(value);
        } else if (e.is_tensordict()) {
          self(self, e.tensordict());
        }
      }
    };
    fill_all(fill_all, v.tensordict());
  }
  return *this;
}

TensorDict TensorDict::masked_fill(const at::Tensor& mask, const at::Scalar& value) const {
  return with_each(
      *this, [&](const at::Tensor& t) { return t.masked_fill(expand_right(mask, t), value); });
}

TensorDict& TensorDict::masked_fill_(const at::Tensor& mask, const at::Scalar& value) {
  if (is_lazy_stack()) {  // the mask's slice along the stack dim for each member
    const auto masks = mask.unbind(detail::stack_dim_of(*this));
    size_t i = 0;
    for (auto m : detail::members_of(*this)) m.masked_fill_(masks[i++], value);
    return *this;
  }
  for (const auto& [key, v] : entries()) {
    if (v.is_tensor()) {
      at::Tensor(v.tensor()).masked_fill_(expand_right(mask, v.tensor()), value);
    } else if (v.is_tensordict()) {
      TensorDict(v.tensordict()).masked_fill_(mask, value);
    }
  }
  return *this;
}

TensorDict TensorDict::where(const at::Tensor& condition, const TensorDict& other) const {
  return apply([&](const at::Tensor& a,
                   const at::Tensor& b) { return at::where(expand_right(condition, a), a, b); },
               other);
}

TensorDict TensorDict::where(const at::Tensor& condition, const at::Scalar& other) const {
  return with_each(
      *this, [&](const at::Tensor& t) { return at::where(expand_right(condition, t), t, other); });
}

TensorDict TensorDict::detach() const {
  return with_each(*this, [](const at::Tensor& t) { return t.detach(); });
}

TensorDict& TensorDict::detach_() {
  // torch cannot detach a view in place: such a leaf is replaced by its detached view.
  const auto walk = [](const auto& self, const TensorDict& td) -> void {
    auto& impl = TensorDictImpl::of(td);
    for (auto& [key, value] : impl.entries) {
      if (value.is_tensordict()) {
        self(self, value.tensordict());
      } else if (value.is_tensor() && value.tensor().is_view()) {
        impl.changed();
        value = detail::same_kind(value, value.tensor().detach());
      } else if (value.is_tensor()) {
        at::Tensor(value.tensor()).detach_();
      }
    }
  };
  walk(walk, *this);
  return *this;
}

TensorDict TensorDict::abs() const {
  return with_each(*this, [](const at::Tensor& t) { return t.abs(); });
}

TensorDict TensorDict::isfinite() const {
  return with_each(*this, [](const at::Tensor& t) { return t.isfinite(); });
}

// ---- arithmetic ----------------------------------------------------------------------------

TensorDict& TensorDict::add_(const TensorDict& other, const at::Scalar& alpha) {
  // Each leaf of this with other's at the same key; written where the leaves live.
  for (const auto& [key, value] : items({.include_nested = true, .leaves_only = true})) {
    at::Tensor sum = value.tensor().add(other.get(key).tensor(), alpha);
    set_(key, sum);
  }
  return *this;
}

TensorDict& TensorDict::add_(const at::Tensor& other, const at::Scalar& alpha) {
  each_leaf(*this, [&](const at::Tensor& t) { at::Tensor(t).add_(other, alpha); });
  return *this;
}

TensorDict& TensorDict::add_(const at::Scalar& other, const at::Scalar& alpha) {
  each_leaf(*this, [&](const at::Tensor& t) { at::Tensor(t).add_(other, alpha); });
  return *this;
}

TensorDict& TensorDict::mul_(const TensorDict& other) {
  for (const auto& [key, value] : items({.include_nested = true, .leaves_only = true})) {
    set_(key, value.tensor().mul(other.get(key).tensor()));
  }
  return *this;
}

TensorDict& TensorDict::mul_(const at::Tensor& other) {
  each_leaf(*this, [&](const at::Tensor& t) { at::Tensor(t).mul_(other); });
  return *this;
}

TensorDict& TensorDict::mul_(const at::Scalar& other) {
  each_leaf(*this, [&](const at::Tensor& t) { at::Tensor(t).mul_(other); });
  return *this;
}

TensorDict& TensorDict::lerp_(const TensorDict& end, const at::Scalar& weight) {
  for (const auto& [key, value] : items({.include_nested = true, .leaves_only = true})) {
    set_(key, value.tensor().lerp(end.get(key).tensor(), weight));
  }
  return *this;
}

TensorDict& TensorDict::lerp_(const TensorDict& end, const TensorDict& weight) {
  for (const auto& [key, value] : items({.include_nested = true, .leaves_only = true})) {
    set_(key, value.tensor().lerp(end.get(key).tensor(), weight.get(key).tensor()));
  }
  return *this;
}

#define TENSORDICT_ARITHMETIC(op, fn)                                                           \
  TensorDict TensorDict::operator op(const TensorDict & other) const {                          \
    return apply([](const at::Tensor& a, const at::Tensor& b) { return at::fn(a, b); }, other); \
  }                                                                                             \
  TensorDict TensorDict::operator op(const at::Tensor & other) const {                          \
    return with_each(*this, [&](const at::Tensor& a) { return at::fn(a, other); });             \
  }                                                                                             \
  TensorDict TensorDict::operator op(const at::Scalar & other) const {                          \
    return with_each(*this, [&](const at::Tensor& a) { return at::fn(a, other); });             \
  }
TENSORDICT_ARITHMETIC(+, add)
TENSORDICT_ARITHMETIC(-, sub)
TENSORDICT_ARITHMETIC(*, mul)
TENSORDICT_ARITHMETIC(/, div)
#undef TENSORDICT_ARITHMETIC

// ---- memory --------------------------------------------------------------------------------

TensorDict TensorDict::pin_memory() const {
  return with_each(*this, [](const at::Tensor& t) { return t.pin_memory(); });
}

TensorDict& TensorDict::share_memory_() {
  // torch's share_memory_: the storage moved into shared memory (the fd strategy's mapping).
  each_leaf(*this, [](const at::Tensor& t) {
    if (!t.is_cpu() || at::MapAllocator::fromDataPtr(t.storage().data_ptr()) != nullptr) return;
    const size_t n = t.storage().nbytes();
    const int flags = at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_EXCLUSIVE |
                      at::ALLOCATOR_MAPPED_KEEPFD | at::ALLOCATOR_MAPPED_UNLINK;
    auto data = at::MapAllocator::makeDataPtr(at::NewProcessWideShmHandle(), flags, n, nullptr);
    std::memcpy(data.get(), t.storage().data(), n);
    at::Tensor(t).storage().set_data_ptr_noswap(std::move(data));
  });
  return lock_();
}

bool TensorDict::is_shared() const {
  bool any = false, all = true;
  each_leaf(*this, [&](const at::Tensor& t) {
    any = true;
    all = all &&
          (t.is_cuda() ||
           (t.has_storage() && at::MapAllocator::fromDataPtr(t.storage().data_ptr()) != nullptr));
  });
  return any && all;
}

}  // namespace tensordict

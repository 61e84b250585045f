// The reference's everyday methods (docs/api-coverage.md): structure, shape, values,
// reductions, arithmetic and memory. Each is built on the walks of tensor_dict_ops.cpp, so lazy
// stacks and non-tensor entries are treated as there.

#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>
#include <c10/core/WrapDimMinimal.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "tensor_dict_impl.h"

namespace tensordict {

using detail::map_leaves;
using detail::map_one;
using detail::NonTensors;
using detail::TensorDictImpl;

namespace {

int64_t wrap(int64_t dim, int64_t ndims) { return c10::maybe_wrap_dim(dim, ndims); }

// A mask or condition over the batch dims, viewed so that it broadcasts over a leaf's feature
// dims (the reference's expand_right).
at::Tensor expand_right(const at::Tensor& mask, const at::Tensor& leaf) {
  TORCH_CHECK(mask.dim() <= leaf.dim(), "the mask of shape ", mask.sizes(),
              " has more dims than a leaf of shape ", leaf.sizes());
  std::vector<int64_t> shape = mask.sizes().vec();
  shape.resize(static_cast<size_t>(leaf.dim()), 1);
  return mask.reshape(shape).expand(leaf.sizes());
}

// Whether reading `key` goes through a lazy stack, whose leaves read as stacked copies.
bool through_lazy(const TensorDict& td, const NestedKey& key) {
  TensorDict level = td;
  for (size_t i = 0; i < key.size(); ++i) {
    if (level.is_lazy_stack()) return true;
    if (i + 1 == key.size()) break;
    const Value v = level.get(key[i]);
    if (!v.is_tensordict()) return false;
    level = v.tensordict();
  }
  return false;
}

// Every leaf of `td` where it lives (a lazy stack's in its members), for in-place work.
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

std::vector<int64_t> wrapped_dims(const std::vector<int64_t>& dims, int64_t batch_dims) {
  std::vector<int64_t> out;
  for (int64_t d : dims) out.push_back(wrap(d, batch_dims));
  std::sort(out.begin(), out.end());
  TORCH_CHECK_VALUE(std::adjacent_find(out.begin(), out.end()) == out.end(),
                    "a reduction dim appears twice in ", at::IntArrayRef(dims));
  return out;
}

// The batch size a reduction over `dims` leaves.
std::vector<int64_t> reduced_batch(at::IntArrayRef bs, const std::vector<int64_t>& dims,
                                   bool keepdim) {
  std::vector<int64_t> out;
  for (int64_t d = 0; d < static_cast<int64_t>(bs.size()); ++d) {
    const bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!reduced) {
      out.push_back(bs[d]);
    } else if (keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

// sum/mean/std leaf by leaf, over all elements, the batch dims given, or the feature dims.
TensorDict reduction(const TensorDict& td, const ReductionOptions& o,
                     const std::function<at::Tensor(const at::Tensor&, at::OptionalIntArrayRef,
                                                    bool)>& fn) {
  const int64_t bd = td.batch_dims();
  if (o.feature) {
    return map_leaves(td, [&](const at::Tensor& t) {
      if (t.dim() == bd) return t;
      std::vector<int64_t> dims(static_cast<size_t>(t.dim() - bd));
      std::iota(dims.begin(), dims.end(), bd);
      return fn(t, dims, o.keepdim);
    }, td.device(), NonTensors::kDrop);
  }
  if (o.dims.empty()) {
    return map_one(td, {}, [&](const at::Tensor& t) { return fn(t, std::nullopt, false); });
  }
  const auto dims = wrapped_dims(o.dims, bd);
  return map_one(td, reduced_batch(td.batch_size(), dims, o.keepdim),
                 [&](const at::Tensor& t) { return fn(t, dims, o.keepdim); });
}

// max/min: values (and indices with one dim).
std::pair<TensorDict, std::optional<TensorDict>> extremum(const TensorDict& td,
                                                          const ReductionOptions& o, bool is_max) {
  if (o.dims.empty() && !o.feature) {
    return {map_one(td, {}, [&](const at::Tensor& t) { return is_max ? t.max() : t.min(); }),
            std::nullopt};
  }
  TORCH_CHECK_VALUE(!o.feature && o.dims.size() == 1, is_max ? "max" : "min",
                    ": dim must be a single batch dim, got ", at::IntArrayRef(o.dims));
  const int64_t d = wrap(o.dims[0], td.batch_dims());
  const auto bs = reduced_batch(td.batch_size(), {d}, o.keepdim);
  auto parts = detail::map_batch(td, td.batch_size().size(), {bs, bs}, [&](const at::Tensor& t) {
    auto [values, indices] = is_max ? t.max(d, o.keepdim) : t.min(d, o.keepdim);
    return std::vector<at::Tensor>{values, indices};
  });
  return {parts[0], parts[1]};
}

TensorDict with_each(const TensorDict& td, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  return map_leaves(td, fn, td.device(), NonTensors::kKeep);
}

}  // namespace

// ---- structure -------------------------------------------------------------------------------

TensorDict TensorDict::select(const std::vector<NestedKey>& keys, const SelectOptions& o) const {
  if (is_lazy_stack()) {
    return detail::lazy::map_members(*this, [&](const TensorDict& m) { return m.select(keys, o); });
  }
  TensorDict out = TensorDictImpl::make(batch_size().vec(), device());
  for (const auto& key : keys) {
    if (!o.strict && !contains(key)) continue;
    // A nested level is made with its own batch size, as the source's is.
    TensorDict level = out;
    TensorDict src = *this;
    for (size_t i = 0; i + 1 < key.size(); ++i) {
      const Value v = src.get(key[i]);
      TD_CHECK_KEY(v.is_tensordict(), "select: key ", key.str(), " passes through ",
                   quote_key(key[i]), ", which is ", detail::kind_name(v));
      src = v.tensordict();
      if (!level.contains(key[i])) {
        level.set(key[i], TensorDictImpl::make(src.batch_size().vec(), src.device()));
      }
      level = level.get(key[i]).tensordict();
    }
    level.set(key.back(), src.get(key.back()));  // KeyError naming the key when absent
  }
  if (!o.inplace) return out;
  auto& impl = *impl_;  // this dictionary takes the selection's entries
  TORCH_CHECK(!impl.locked, detail::kLockedMessage);
  impl.changed();
  impl.consolidated.reset();
  impl.entries = std::move(TensorDictImpl::of(out).entries);
  impl.reindex();
  return *this;
}

TensorDict TensorDict::exclude(const std::vector<NestedKey>& keys, bool inplace) const {
  if (inplace) {
    TensorDict self = *this;
    for (const auto& key : keys) {
      if (self.contains(key)) self.erase(key);
    }
    return self;
  }
  // A copy that leaves the keys out as it goes (erasing from a copy re-indexes once per key).
  const auto walk = [&](const auto& rec, const TensorDict& td,
                        std::vector<std::string>& path) -> TensorDict {
    if (td.is_lazy_stack()) {
      return detail::lazy::map_members(td, [&](const TensorDict& m) { return rec(rec, m, path); });
    }
    const auto matches = [&](const std::string& key, bool whole) {
      for (const auto& k : keys) {
        if (whole ? k.size() != path.size() + 1 : k.size() <= path.size() + 1) continue;
        if (std::equal(path.begin(), path.end(), k.parts().begin()) && k[path.size()] == key) {
          return true;
        }
      }
      return false;
    };
    TensorDict out = TensorDictImpl::make(td.batch_size().vec(), td.device());
    auto& impl = TensorDictImpl::of(out);
    impl.entries.reserve(td.entries().size());
    for (const auto& [key, value] : td.entries()) {
      if (matches(key, true)) continue;
      if (value.is_tensordict() && matches(key, false)) {  // a key to leave out below
        path.push_back(key);
        impl.append_unique(key, rec(rec, value.tensordict(), path));
        path.pop_back();
      } else if (value.is_tensordict()) {
        impl.append_unique(key, value.tensordict().copy());
      } else {
        impl.append_unique(key, value);
      }
    }
    impl.appended();
    return out;
  };
  std::vector<std::string> path;
  return walk(walk, *this, path);
}

TensorDict TensorDict::flatten_keys(const std::string& separator) const {
  TensorDict out = TensorDictImpl::make(batch_size().vec(), device());
  for (auto& [key, value] : items({.include_nested = true})) {
    if (value.is_tensordict() && !value.tensordict().is_empty()) continue;
    std::string joined;
    for (size_t i = 0; i < key.size(); ++i) joined += (i ? separator : "") + key[i];
    TD_CHECK_KEY(!out.contains(joined), "flatten_keys: two keys flatten to ", quote_key(joined));
    TensorDictImpl::of(out).put(joined, value);
  }
  return out;
}

TensorDict TensorDict::unflatten_keys(const std::string& separator) const {
  TORCH_CHECK_VALUE(!separator.empty(), "unflatten_keys: the separator must not be empty");
  TensorDict out = TensorDictImpl::make(batch_size().vec(), device());
  for (const auto& [key, value] : entries()) {
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t at = key.find(separator); at != std::string::npos; at = key.find(separator, start)) {
      parts.push_back(key.substr(start, at - start));
      start = at + separator.size();
    }
    parts.push_back(key.substr(start));
    // A leaf where another key needs a level, or the reverse, would be overwritten: the
    // reference's KeyError (naming the deeper key) instead of losing either.
    const auto clash = [&](const std::vector<std::string>& deeper) {
      TD_CHECK_KEY(false, "Unflattening key(s) in tensordict will override an existing for "
                   "unflattened key ", NestedKey(deeper).str(), ".");
    };
    for (size_t n = 1; n < parts.size(); ++n) {
      const NestedKey prefix(std::vector<std::string>(parts.begin(), parts.begin() + n));
      if (out.contains(prefix) && !out.get(prefix).is_tensordict()) clash(parts);
    }
    if (!value.is_tensordict() && out.contains(NestedKey(parts))) {
      const Value existing = out.get(NestedKey(parts));
      if (existing.is_tensordict() && !existing.tensordict().entries().empty()) {
        auto deeper = parts;
        deeper.push_back(existing.tensordict().entries().front().first);
        clash(deeper);
      }
    }
    out.set(NestedKey(parts),
            value.is_tensordict() ? Value(value.tensordict().unflatten_keys(separator)) : value);
  }
  return out;
}

TensorDict& TensorDict::rename_key_(const NestedKey& old_key, const NestedKey& new_key, bool safe) {
  TD_CHECK_KEY(contains(old_key), "rename_key_: key ", old_key.str(), " not found");
  TD_CHECK_KEY(!safe || !contains(new_key), "key ", new_key.str(),
               " already present in TensorDict.");
  TORCH_CHECK(!is_locked(), detail::kLockedMessage);
  const Value v = get(old_key);
  set(new_key, v);
  if (!(old_key == new_key)) erase(old_key);
  return *this;
}

Value TensorDict::setdefault(const NestedKey& key, const Value& default_value) {
  if (!contains(key)) set(key, default_value);
  return get(key);
}

TensorDict& TensorDict::update_(const TensorDict& other, const std::vector<NestedKey>& keys_to_update) {
  const auto leaves = other.items({.include_nested = true, .leaves_only = true});
  for (const auto& [key, value] : leaves) {
    if (!keys_to_update.empty() &&
        std::find(keys_to_update.begin(), keys_to_update.end(), key) == keys_to_update.end()) {
      continue;
    }
    TD_CHECK_KEY(contains(key), "update_: key ", key.str(),
                 " is not in the TensorDict; update_ writes into existing leaves only");
  }
  for (const auto& [key, value] : leaves) {
    if (keys_to_update.empty() ||
        std::find(keys_to_update.begin(), keys_to_update.end(), key) != keys_to_update.end()) {
      set_(key, value.tensor());
    }
  }
  return *this;
}

TensorDict& TensorDict::set_at_(const NestedKey& key, const at::Tensor& value,
                                at::ArrayRef<at::indexing::TensorIndex> index) {
  const Value v = get(key);
  TORCH_CHECK_TYPE(v.is_tensor(), "set_at_: key ", key.str(), " holds ", detail::kind_name(v),
                   ", not a tensor");
  at::Tensor leaf = v.tensor();
  leaf.index_put_(index, value);
  // Through a lazy stack the leaf was a stacked copy: written back into the members.
  return through_lazy(*this, key) ? set_(key, leaf) : *this;
}

at::Tensor TensorDict::get_at(const NestedKey& key,
                              at::ArrayRef<at::indexing::TensorIndex> index) const {
  const Value v = get(key);
  TORCH_CHECK_TYPE(v.is_tensor(), "get_at: key ", key.str(), " holds ", detail::kind_name(v),
                   ", not a tensor");
  return v.tensor().index(index);
}

TensorDict TensorDict::filter_non_tensor_data() const {
  return map_leaves(*this, [](const at::Tensor& t) { return t; }, device(), NonTensors::kDrop);
}

TensorDict TensorDict::empty(bool recurse) const {
  if (is_lazy_stack()) {
    return detail::lazy::map_members(*this, [&](const TensorDict& m) { return m.empty(recurse); });
  }
  TensorDict out = TensorDictImpl::make(batch_size().vec(), device());
  if (!recurse) return out;
  for (const auto& [key, value] : entries()) {
    if (value.is_tensordict()) TensorDictImpl::of(out).put(key, value.tensordict().empty(true));
  }
  return out;
}

TensorDict TensorDict::copy() const {
  return map_leaves(*this, [](const at::Tensor& t) { return t; }, device());
}

TensorDict& TensorDict::copy_(const TensorDict& src) { return update_(src); }

// ---- shape -------------------------------------------------------------------------------

std::vector<TensorDict> TensorDict::chunk(int64_t chunks, int64_t dim) const {
  TORCH_CHECK_VALUE(chunks > 0, "chunk: chunks must be positive, got ", chunks);
  const int64_t n = batch_size()[wrap(dim, batch_dims())];
  return split(std::max<int64_t>((n + chunks - 1) / chunks, 1), dim);
}

TensorDict TensorDict::flatten(int64_t start_dim, int64_t end_dim) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).flatten(start_dim, end_dim);
  const int64_t bd = batch_dims();
  if (bd == 0) return copy();
  const int64_t s = wrap(start_dim, bd), e = wrap(end_dim, bd);
  TORCH_CHECK_VALUE(s <= e, "flatten: start_dim ", start_dim, " comes after end_dim ", end_dim);
  std::vector<int64_t> nb(batch_size().begin(), batch_size().begin() + s);
  nb.push_back(c10::multiply_integers(batch_size().slice(s, e - s + 1)));
  nb.insert(nb.end(), batch_size().begin() + e + 1, batch_size().end());
  return map_one(*this, nb, [&](const at::Tensor& t) { return t.flatten(s, e); });
}

TensorDict TensorDict::unflatten(int64_t dim, at::IntArrayRef sizes) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).unflatten(dim, sizes);
  const int64_t d = wrap(dim, batch_dims());
  // torch resolves a -1 and checks the product; a dummy of the batch shape tells the result.
  const auto nb = at::zeros({}, at::kByte).expand(batch_size()).unflatten(d, sizes).sizes().vec();
  return map_one(*this, nb, [&](const at::Tensor& t) { return t.unflatten(d, sizes); });
}

TensorDict TensorDict::permute(at::IntArrayRef dims) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).permute(dims);
  const int64_t bd = batch_dims();
  TORCH_CHECK_VALUE(static_cast<int64_t>(dims.size()) == bd, "permute: expected ", bd,
                    " dims for batch_size ", batch_size(), ", got ", dims);
  std::vector<int64_t> order;
  for (int64_t d : dims) order.push_back(wrap(d, bd));
  std::vector<int64_t> nb;
  for (int64_t d : order) nb.push_back(batch_size()[d]);
  auto sorted = order;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                    "permute: repeated dim in ", dims);
  return map_one(*this, nb, [&](const at::Tensor& t) {
    std::vector<int64_t> full = order;  // feature dims stay in place
    for (int64_t d = bd; d < t.dim(); ++d) full.push_back(d);
    return t.permute(full);
  });
}

TensorDict TensorDict::transpose(int64_t dim0, int64_t dim1) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).transpose(dim0, dim1);
  const int64_t bd = batch_dims();
  TORCH_CHECK_VALUE(dim0 >= -bd && dim0 < bd && dim1 >= -bd && dim1 < bd,
                    "transpose: dim0 and dim1 must be within the range of the batch dims, got ",
                    dim0, " and ", dim1, " for batch_size ", batch_size());
  const int64_t a = wrap(dim0, bd), b = wrap(dim1, bd);
  std::vector<int64_t> nb = batch_size().vec();
  std::swap(nb[a], nb[b]);
  return map_one(*this, nb, [&](const at::Tensor& t) { return t.transpose(a, b); });
}

// ---- values ------------------------------------------------------------------------------

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
      return detail::lazy::map_members(td, [&](const TensorDict& m) { return self(self, m, prefix); });
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

TensorDict TensorDict::masked_fill(const at::Tensor& mask, const at::Scalar& value) const {
  return with_each(*this, [&](const at::Tensor& t) {
    return t.masked_fill(expand_right(mask, t), value);
  });
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
  return apply([&](const at::Tensor& a, const at::Tensor& b) {
    return at::where(expand_right(condition, a), a, b);
  }, other);
}

TensorDict TensorDict::where(const at::Tensor& condition, const at::Scalar& other) const {
  return with_each(*this, [&](const at::Tensor& t) {
    return at::where(expand_right(condition, t), t, other);
  });
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

// ---- reductions ----------------------------------------------------------------------------

TensorDict TensorDict::sum(const ReductionOptions& o) const {
  return reduction(*this, o, [&](const at::Tensor& t, at::OptionalIntArrayRef dims, bool keep) {
    return dims ? t.sum(*dims, keep, o.dtype) : t.sum(o.dtype);
  });
}

TensorDict TensorDict::mean(const ReductionOptions& o) const {
  return reduction(*this, o, [&](const at::Tensor& t, at::OptionalIntArrayRef dims, bool keep) {
    return dims ? t.mean(*dims, keep, o.dtype) : t.mean(o.dtype);
  });
}

TensorDict TensorDict::std(const ReductionOptions& o) const {
  return reduction(*this, o, [&](const at::Tensor& t, at::OptionalIntArrayRef dims, bool keep) {
    return t.std(dims, at::Scalar(o.correction), keep);
  });
}

std::pair<TensorDict, std::optional<TensorDict>> TensorDict::max(const ReductionOptions& o) const {
  return extremum(*this, o, true);
}

std::pair<TensorDict, std::optional<TensorDict>> TensorDict::min(const ReductionOptions& o) const {
  return extremum(*this, o, false);
}

at::Tensor TensorDict::reduce_all(const char* op, const ReductionOptions& o) const {
  const std::string name(op);
  TORCH_CHECK_VALUE(name == "sum" || name == "mean" || name == "std" || name == "max" ||
                        name == "min",
                    "reduce_all: unknown reduction '", name, "'");
  std::vector<at::Tensor> leaves;
  each_leaf(*this, [&](const at::Tensor& t) { leaves.push_back(t); });
  TORCH_CHECK_VALUE(!leaves.empty(), name, "(reduce=True): the TensorDict has no tensor leaves");
  const int64_t bd = batch_dims();
  at::Tensor all;
  std::optional<std::vector<int64_t>> dims;
  if (!o.feature && o.dims.empty()) {
    for (auto& t : leaves) t = t.contiguous().flatten();
    all = at::cat(leaves);
  } else if (o.feature) {
    for (auto& t : leaves) t = t.dim() > bd ? t.flatten(bd, -1) : t.unsqueeze(-1);
    all = at::cat(leaves, -1);
    dims = std::vector<int64_t>{-1};
  } else {
    all = at::cat(leaves, o.dims[0]);
    dims = o.dims;
  }
  const bool keep = o.keepdim && !o.feature;
  if (name == "sum") return dims ? all.sum(*dims, keep, o.dtype) : all.sum(o.dtype);
  if (name == "mean") return dims ? all.mean(*dims, keep, o.dtype) : all.mean(o.dtype);
  if (name == "std") return all.std(dims ? at::OptionalIntArrayRef(*dims) : std::nullopt, at::Scalar(o.correction), keep);
  if (!dims) return name == "max" ? all.max() : all.min();
  TORCH_CHECK_VALUE(dims->size() == 1, name, "(reduce=True): dim must be a single dim");
  return std::get<0>(name == "max" ? all.max((*dims)[0], keep) : all.min((*dims)[0], keep));
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

#define TENSORDICT_ARITHMETIC(op, fn)                                                        \
  TensorDict TensorDict::operator op(const TensorDict& other) const {                       \
    return apply([](const at::Tensor& a, const at::Tensor& b) { return at::fn(a, b); },     \
                 other);                                                                    \
  }                                                                                         \
  TensorDict TensorDict::operator op(const at::Tensor& other) const {                       \
    return with_each(*this, [&](const at::Tensor& a) { return at::fn(a, other); });         \
  }                                                                                         \
  TensorDict TensorDict::operator op(const at::Scalar& other) const {                       \
    return with_each(*this, [&](const at::Tensor& a) { return at::fn(a, other); });         \
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
    all = all && (t.is_cuda() || (t.has_storage() &&
                                  at::MapAllocator::fromDataPtr(t.storage().data_ptr()) != nullptr));
  });
  return any && all;
}

}  // namespace tensordict

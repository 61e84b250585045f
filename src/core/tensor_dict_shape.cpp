// Shape: the batch-dim operations (index, views, split, stack, cat) and the walk they share.

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>

#include <algorithm>
#include <set>
#include <type_traits>

#include "non_tensor_ops.h"
#include "tensor_dict_impl.h"

namespace tensordict {

using detail::check_same_keys;
using detail::map_batch;
using detail::map_one;
using detail::TensorDictImpl;
using detail::wrap_dim;

namespace {

std::vector<int64_t> concat(at::IntArrayRef head, at::IntArrayRef tail) {
  std::vector<int64_t> out(head.begin(), head.end());
  out.insert(out.end(), tail.begin(), tail.end());
  return out;
}

}  // namespace

namespace detail {

std::vector<at::indexing::TensorIndex> expand_ellipsis(at::ArrayRef<at::indexing::TensorIndex> idx,
                                                       int64_t batch_dims) {
  int64_t consumed = 0;
  int64_t ellipses = 0;
  for (const auto& i : idx) {
    if (i.is_ellipsis()) {
      ++ellipses;
    } else if (i.is_tensor()) {
      consumed +=
          i.tensor().scalar_type() == at::kBool ? std::max<int64_t>(i.tensor().dim(), 1) : 1;
    } else if (i.is_integer() || i.is_slice()) {
      ++consumed;
    }
  }
  TORCH_CHECK_VALUE(ellipses <= 1, "an index can only have a single ellipsis ('...')");
  TORCH_CHECK_INDEX(consumed <= batch_dims, "too many indices for a TensorDict with ", batch_dims,
                    " batch dims: ", consumed, " were indexed");
  std::vector<at::indexing::TensorIndex> out;
  for (const auto& i : idx) {
    if (i.is_ellipsis()) {
      // Only the batch dims may be covered: the feature dims of leaves are never indexed.
      for (int64_t k = 0; k < batch_dims - consumed; ++k) out.emplace_back(at::indexing::Slice());
    } else {
      out.push_back(i);
    }
  }
  // Nothing to index (td[()], td[...] without batch dims): the identity, which torch spells
  // `...`, since Tensor::index refuses an empty list.
  if (out.empty()) out.emplace_back(at::indexing::Ellipsis);
  return out;
}

// The core of every batch operation. `fn` maps a tensor to its results (one per output
// TensorDict) by acting on its first `old_dims` dims only, so the same fn serves leaves and the
// leaves of nested levels (whose batch sizes start with ours). Output i gets batch size
// new_batches[i]; a nested level keeps its extra batch dims after them. A nested lazy stack
// gets `lazy_fn`, the same operation on a whole TensorDict, where the caller has one that keeps
// it lazy (index, unbind); otherwise its dense stack is mapped.
std::vector<TensorDict> map_batch(const TensorDict& td, size_t old_dims,
                                  const std::vector<std::vector<int64_t>>& new_batches,
                                  const LeafFn& fn, const LazyFn& lazy_fn) {
  std::vector<TensorDict> out;
  out.reserve(new_batches.size());
  for (const auto& b : new_batches) {
    out.push_back(TensorDictImpl::make(b, td.device()));
    TensorDictImpl::of(out.back()).entries.reserve(td.entries().size());
  }
  for (const auto& [key, value] : td.entries()) {
    if (value.is_unbatched()) {  // passed through whole, as the reference's UnbatchedTensor
      for (auto& o : out) TensorDictImpl::of(o).append_unique(key, value);
    } else if (value.is_tensor()) {
      std::vector<at::Tensor> parts = fn(value.tensor());
      TORCH_INTERNAL_ASSERT(parts.size() == out.size());
      for (size_t i = 0; i < out.size(); ++i)
        TensorDictImpl::of(out[i]).append_unique(key, parts[i]);
    } else if (value.is_non_tensor()) {
      auto parts =
          detail::map_non_tensor(value.non_tensor(), td.batch_size().size(), new_batches, fn);
      for (size_t i = 0; i < out.size(); ++i) {
        TensorDictImpl::of(out[i]).append_unique(key, std::move(parts[i]));
      }
    } else if (value.tensordict().is_lazy_stack() && lazy_fn) {
      auto parts = lazy_fn(value.tensordict());
      for (size_t i = 0; i < out.size(); ++i)
        TensorDictImpl::of(out[i]).append_unique(key, parts[i]);
    } else {
      const TensorDict child = value.tensordict().is_lazy_stack()
                                   ? detail::lazy::dense(value.tensordict())
                                   : value.tensordict();
      // new_batches hold this level's batch sizes: keep the child's dims beyond this level's.
      const auto extra = child.batch_size().slice(td.batch_size().size());
      std::vector<std::vector<int64_t>> child_batches;
      for (const auto& b : new_batches) child_batches.push_back(concat(b, extra));
      auto parts = map_batch(child, old_dims, child_batches, fn, lazy_fn);
      for (size_t i = 0; i < out.size(); ++i)
        TensorDictImpl::of(out[i]).append_unique(key, parts[i]);
    }
  }
  for (auto& o : out) TensorDictImpl::of(o).appended();
  return out;
}

TensorDict map_one(const TensorDict& td, std::vector<int64_t> new_batch,
                   const std::function<at::Tensor(const at::Tensor&)>& fn) {
  return map_batch(td, td.batch_size().size(), {std::move(new_batch)},
                   [&](const at::Tensor& t) { return std::vector<at::Tensor>{fn(t)}; })[0];
}

// Leaves of `a` and `b` paired by key; KeyError naming the keys only one side has.
void check_same_keys(const TensorDict& a, const TensorDict& b, const char* what) {
  const auto ka_list = a.sorted_keys(), kb_list = b.sorted_keys();
  const std::set<std::string> ka(ka_list.begin(), ka_list.end()),
      kb(kb_list.begin(), kb_list.end());
  if (ka == kb) return;
  std::string only_a, only_b;
  for (const auto& k : ka) {
    if (!kb.count(k)) only_a += (only_a.empty() ? "" : ", ") + quote_key(k);
  }
  for (const auto& k : kb) {
    if (!ka.count(k)) only_b += (only_b.empty() ? "" : ", ") + quote_key(k);
  }
  TD_CHECK_KEY(false, what, ": keys mismatch; only in the first: [", only_a,
               "], only in the second: [", only_b, "]");
}

}  // namespace detail

namespace {

// The non-tensor entry at `key` of each TensorDict (stack and cat combine them).
std::vector<NonTensorData> non_tensor_parts(at::ArrayRef<TensorDict> tds, const std::string& key,
                                            const std::string& path, const char* what) {
  std::vector<NonTensorData> parts;
  parts.reserve(tds.size());
  for (size_t i = 0; i < tds.size(); ++i) {
    const Value* v = TensorDictImpl::of(tds[i]).find(key);
    TORCH_INTERNAL_ASSERT(v != nullptr);  // the callers checked the key sets
    TORCH_CHECK_TYPE(v->is_non_tensor(), what, ": key ", path,
                     " is a non-tensor entry in tensordict 0 but ", detail::kind_name(*v),
                     " in tensordict ", i);
    parts.push_back(v->non_tensor());
  }
  return parts;
}

std::vector<int64_t> shape_after(const TensorDict& td,
                                 const std::function<at::Tensor(const at::Tensor&)>& fn) {
  // A stride-0 dummy with the batch shape tells the result's batch size without touching data.
  at::Tensor dummy = at::zeros({}, at::kByte).expand(td.batch_size());
  return fn(dummy).sizes().vec();
}

}  // namespace

TensorDict TensorDict::index(at::ArrayRef<at::indexing::TensorIndex> indices) const {
  if (is_lazy_stack()) return detail::lazy::index(*this, indices);
  const auto idx = detail::expand_ellipsis(indices, batch_dims());
  auto fn = [&](const at::Tensor& t) { return t.index(idx); };
  return map_batch(
      *this, batch_size().size(), {shape_after(*this, fn)},
      [&](const at::Tensor& t) { return std::vector<at::Tensor>{fn(t)}; },
      [&](const TensorDict& child) { return std::vector<TensorDict>{child.index(idx)}; })[0];
}

std::vector<TensorDict> TensorDict::unbind(int64_t dim) const {
  if (is_lazy_stack()) return detail::lazy::unbind(*this, dim);
  const int64_t d = wrap_dim(dim, batch_dims());
  std::vector<int64_t> b = batch_size().vec();
  const int64_t n = b[d];
  b.erase(b.begin() + d);
  return map_batch(
      *this, batch_size().size(), std::vector<std::vector<int64_t>>(n, b),
      [d](const at::Tensor& t) { return t.unbind(d); },
      [d](const TensorDict& child) { return child.unbind(d); });
}

namespace {

std::vector<int64_t> infer_batch(const TensorDict& td, at::IntArrayRef shape, const char* op) {
  std::vector<int64_t> out = shape.vec();
  int64_t known = 1;
  int64_t infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      TORCH_CHECK_VALUE(infer < 0, op, ": only one dimension can be inferred, got ", shape);
      infer = static_cast<int64_t>(i);
    } else {
      TORCH_CHECK_VALUE(out[i] >= 0, op, ": invalid shape ", shape);
      known *= out[i];
    }
  }
  const int64_t numel = td.numel();
  if (infer >= 0 && known != 0 && numel % known == 0) out[infer] = numel / known;
  TORCH_CHECK_VALUE(c10::multiply_integers(out) == numel && (infer < 0 || known != 0), op,
                    ": invalid shape ", shape, " for a batch of ", numel, " elements (batch_size ",
                    td.batch_size(), ")");
  return out;
}

}  // namespace

TensorDict TensorDict::reshape(at::IntArrayRef shape) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).reshape(shape);  // on the dense copy
  const auto nb = infer_batch(*this, shape, "reshape");
  const size_t old = batch_size().size();
  return map_one(*this, nb,
                 [&](const at::Tensor& t) { return t.reshape(concat(nb, t.sizes().slice(old))); });
}

TensorDict TensorDict::view(at::IntArrayRef shape) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).view(shape);  // on the dense copy
  const auto nb = infer_batch(*this, shape, "view");
  const size_t old = batch_size().size();
  return map_one(*this, nb,
                 [&](const at::Tensor& t) { return t.view(concat(nb, t.sizes().slice(old))); });
}

TensorDict TensorDict::expand(at::IntArrayRef shape) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).expand(shape);  // on the dense copy
  const auto b = batch_size();
  TORCH_CHECK_VALUE(shape.size() >= b.size(), "expand: the new shape ", shape,
                    " has fewer dims than the batch size ", b);
  std::vector<int64_t> nb = shape.vec();
  const size_t lead = shape.size() - b.size();
  for (size_t i = 0; i < nb.size(); ++i) {
    if (i >= lead) {
      const int64_t cur = b[i - lead];
      if (nb[i] == -1) nb[i] = cur;
      TORCH_CHECK_VALUE(nb[i] == cur || cur == 1, "expand: batch_size ", b,
                        " cannot be expanded to ", shape);
    } else {
      TORCH_CHECK_VALUE(nb[i] >= 0, "expand: invalid new leading size in ", shape);
    }
  }
  const size_t old = b.size();
  return map_one(*this, nb, [&](const at::Tensor& t) {
    std::vector<int64_t> target = concat(nb, t.sizes().slice(old));
    return t.expand(target);
  });
}

TensorDict TensorDict::unsqueeze(int64_t dim) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).unsqueeze(dim);  // on the dense copy
  const int64_t d = wrap_dim(dim, batch_dims() + 1);
  std::vector<int64_t> nb = batch_size().vec();
  nb.insert(nb.begin() + d, 1);
  return map_one(*this, nb, [d](const at::Tensor& t) { return t.unsqueeze(d); });
}

TensorDict TensorDict::squeeze(std::optional<int64_t> dim) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).squeeze(dim);  // on the dense copy
  std::vector<int64_t> dims;  // batch dims to drop, descending so that indices stay valid
  if (dim.has_value()) {
    const int64_t d = wrap_dim(*dim, batch_dims());
    if (batch_size()[d] == 1) dims.push_back(d);
  } else {
    for (int64_t d = batch_dims() - 1; d >= 0; --d) {
      if (batch_size()[d] == 1) dims.push_back(d);
    }
  }
  std::vector<int64_t> nb = batch_size().vec();
  for (int64_t d : dims) nb.erase(nb.begin() + d);
  return map_one(*this, nb, [&](const at::Tensor& t) {
    at::Tensor r = t;
    for (int64_t d : dims) r = r.squeeze(d);
    return r;
  });
}

std::vector<TensorDict> TensorDict::split(int64_t split_size, int64_t dim) const {
  TORCH_CHECK_VALUE(split_size > 0, "split: split_size must be positive, got ", split_size);
  const int64_t d = wrap_dim(dim, batch_dims());
  const int64_t n = batch_size()[d];
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < n; start += split_size)
    sizes.push_back(std::min(split_size, n - start));
  if (sizes.empty()) sizes.push_back(0);
  return split(sizes, dim);
}

std::vector<TensorDict> TensorDict::split(at::IntArrayRef split_sizes, int64_t dim) const {
  if (is_lazy_stack())
    return detail::lazy::dense(*this).split(split_sizes, dim);  // on the dense copy
  const int64_t d = wrap_dim(dim, batch_dims());
  int64_t total = 0;
  for (int64_t s : split_sizes) {
    TORCH_CHECK_VALUE(s >= 0, "split: negative size in ", split_sizes);
    total += s;
  }
  TORCH_CHECK_VALUE(total == batch_size()[d], "split: sizes ", split_sizes, " sum to ", total,
                    " but batch dim ", d, " has size ", batch_size()[d]);
  std::vector<std::vector<int64_t>> nbs;
  for (int64_t s : split_sizes) {
    std::vector<int64_t> b = batch_size().vec();
    b[d] = s;
    nbs.push_back(std::move(b));
  }
  const std::vector<int64_t> sizes = split_sizes.vec();
  return map_batch(*this, batch_size().size(), nbs,
                   [&](const at::Tensor& t) { return t.split_with_sizes(sizes, d); });
}

std::vector<TensorDict> TensorDict::chunk(int64_t chunks, int64_t dim) const {
  TORCH_CHECK_VALUE(chunks > 0, "chunk: chunks must be positive, got ", chunks);
  const int64_t n = batch_size()[wrap_dim(dim, batch_dims())];
  return split(std::max<int64_t>((n + chunks - 1) / chunks, 1), dim);
}

TensorDict TensorDict::flatten(int64_t start_dim, int64_t end_dim) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).flatten(start_dim, end_dim);
  const int64_t bd = batch_dims();
  if (bd == 0) return copy();
  const int64_t s = wrap_dim(start_dim, bd), e = wrap_dim(end_dim, bd);
  TORCH_CHECK_VALUE(s <= e, "flatten: start_dim ", start_dim, " comes after end_dim ", end_dim);
  std::vector<int64_t> nb(batch_size().begin(), batch_size().begin() + s);
  nb.push_back(c10::multiply_integers(batch_size().slice(s, e - s + 1)));
  nb.insert(nb.end(), batch_size().begin() + e + 1, batch_size().end());
  return map_one(*this, nb, [&](const at::Tensor& t) { return t.flatten(s, e); });
}

TensorDict TensorDict::unflatten(int64_t dim, at::IntArrayRef sizes) const {
  if (is_lazy_stack()) return detail::lazy::dense(*this).unflatten(dim, sizes);
  const int64_t d = wrap_dim(dim, batch_dims());
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
  for (int64_t d : dims) order.push_back(wrap_dim(d, bd));
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
  const int64_t a = wrap_dim(dim0, bd), b = wrap_dim(dim1, bd);
  std::vector<int64_t> nb = batch_size().vec();
  std::swap(nb[a], nb[b]);
  return map_one(*this, nb, [&](const at::Tensor& t) { return t.transpose(a, b); });
}

namespace {

std::vector<std::string> path_of(std::vector<std::string> prefix, const std::string& key) {
  prefix.push_back(key);
  return prefix;
}

std::string path_str(const std::vector<std::string>& prefix, const std::string& key) {
  return NestedKey(path_of(prefix, key)).str();
}

// The value at `key` in every input, which must be of the kind T (at::Tensor or TensorDict) as
// in tensordict 0.
template <typename T>
std::vector<T> parts_of(at::ArrayRef<TensorDict> tds, const std::string& key,
                        const std::vector<std::string>& prefix, const char* op) {
  constexpr bool kTensor = std::is_same_v<T, at::Tensor>;
  std::vector<T> parts;
  for (const auto& td : tds) {
    const Value v = td.get(key);
    TORCH_CHECK_TYPE(kTensor ? v.is_tensor() : v.is_tensordict(), op, ": key ",
                     path_str(prefix, key), " is a ", kTensor ? "tensor" : "TensorDict",
                     " in tensordict 0 but ", detail::kind_name(v), " in another");
    if constexpr (kTensor) {
      parts.push_back(v.tensor());
    } else {
      parts.push_back(v.tensordict());
    }
  }
  return parts;
}

// The inputs with lazy stacks replaced by their dense stacks (stack and cat make dense results).
std::vector<TensorDict> densified(at::ArrayRef<TensorDict> tds) {
  std::vector<TensorDict> out(tds.begin(), tds.end());
  for (auto& td : out) {
    if (td.is_lazy_stack()) td = detail::lazy::dense(td);
  }
  return out;
}

TensorDict stack_at(at::ArrayRef<TensorDict> inputs, int64_t dim,
                    const std::vector<std::string>& prefix) {
  TORCH_CHECK_VALUE(!inputs.empty(), "stack: expected a non-empty list of TensorDicts");
  const std::vector<TensorDict> tds = densified(inputs);
  const TensorDict& first = tds[0];
  const int64_t d = c10::maybe_wrap_dim(dim, first.batch_dims() + 1);
  std::optional<at::Device> device = first.device();
  for (size_t i = 1; i < tds.size(); ++i) {
    TORCH_CHECK_VALUE(tds[i].batch_size() == first.batch_size(), "stack: tensordict ", i,
                      " has batch_size ", tds[i].batch_size(), " but tensordict 0 has ",
                      first.batch_size());
    check_same_keys(first, tds[i], "stack");
    if (tds[i].device() != device) device = std::nullopt;
  }
  std::vector<int64_t> nb = first.batch_size().vec();
  nb.insert(nb.begin() + d, static_cast<int64_t>(tds.size()));
  TensorDict out = TensorDictImpl::make(nb, device);
  for (const auto& [key, value] : first.entries()) {
    if (value.is_non_tensor()) {
      // A stack of the entries, as the reference stacks them (one MetaData for equal ones).
      TensorDictImpl::of(out).put(
          key,
          detail::stack_non_tensors(non_tensor_parts(tds, key, path_str(prefix, key), "stack"), d));
    } else if (value.is_unbatched()) {
      TensorDictImpl::of(out).put(key, value);  // tensordict 0's, as the reference keeps it
    } else if (value.is_tensor()) {
      const auto parts = parts_of<at::Tensor>(tds, key, prefix, "stack");
      for (size_t i = 1; i < parts.size(); ++i) {
        TORCH_CHECK(parts[i].sizes() == parts[0].sizes(), "stack: key ", path_str(prefix, key),
                    " has shape ", parts[0].sizes(), " in tensordict 0 but ", parts[i].sizes(),
                    " in tensordict ", i);
      }
      TensorDictImpl::of(out).put(key, at::stack(parts, d));
    } else {
      const auto parts = parts_of<TensorDict>(tds, key, prefix, "stack");
      TensorDictImpl::of(out).put(key, stack_at(parts, d, path_of(prefix, key)));
    }
  }
  return out;
}

TensorDict cat_at(at::ArrayRef<TensorDict> inputs, int64_t dim,
                  const std::vector<std::string>& prefix) {
  TORCH_CHECK_VALUE(!inputs.empty(), "cat: expected a non-empty list of TensorDicts");
  const std::vector<TensorDict> tds = densified(inputs);
  const TensorDict& first = tds[0];
  TORCH_CHECK_VALUE(first.batch_dims() > 0,
                    "cat: TensorDicts with batch_size [] cannot be concatenated");
  const int64_t d = c10::maybe_wrap_dim(dim, first.batch_dims());
  std::vector<int64_t> nb = first.batch_size().vec();
  std::optional<at::Device> device = first.device();
  for (size_t i = 1; i < tds.size(); ++i) {
    auto b = tds[i].batch_size();
    bool ok = b.size() == nb.size();
    for (size_t k = 0; ok && k < b.size(); ++k)
      ok = (static_cast<int64_t>(k) == d) || b[k] == nb[k];
    TORCH_CHECK_VALUE(ok, "cat: tensordict ", i, " has batch_size ", b,
                      ", which differs from tensordict 0's ", first.batch_size(), " outside dim ",
                      d);
    nb[d] += b[d];
    check_same_keys(first, tds[i], "cat");
    if (tds[i].device() != device) device = std::nullopt;
  }
  TensorDict out = TensorDictImpl::make(nb, device);
  for (const auto& [key, value] : first.entries()) {
    if (value.is_non_tensor()) {
      TensorDictImpl::of(out).put(
          key,
          detail::cat_non_tensors(non_tensor_parts(tds, key, path_str(prefix, key), "cat"), d));
    } else if (value.is_unbatched()) {
      TensorDictImpl::of(out).put(key, value);
    } else if (value.is_tensor()) {
      const auto parts = parts_of<at::Tensor>(tds, key, prefix, "cat");
      TensorDictImpl::of(out).put(key, at::cat(parts, d));
    } else {
      const auto parts = parts_of<TensorDict>(tds, key, prefix, "cat");
      TensorDictImpl::of(out).put(key, cat_at(parts, d, path_of(prefix, key)));
    }
  }
  return out;
}

}  // namespace

TensorDict stack(at::ArrayRef<TensorDict> tds, int64_t dim) { return stack_at(tds, dim, {}); }

TensorDict cat(at::ArrayRef<TensorDict> tds, int64_t dim) { return cat_at(tds, dim, {}); }

}  // namespace tensordict

// Reductions (sum, mean, std, max, min, reduce_all) and comparisons (==, !=, all, any, allclose).

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "non_tensor_ops.h"
#include "tensor_dict_impl.h"

namespace tensordict {

using detail::check_same_keys;
using detail::each_leaf;
using detail::map_leaves;
using detail::map_one;
using detail::NonTensors;
using detail::TensorDictImpl;
using detail::wrap_dim;

namespace {

std::vector<int64_t> wrapped_dims(const std::vector<int64_t>& dims, int64_t batch_dims) {
  std::vector<int64_t> out;
  for (int64_t d : dims) out.push_back(wrap_dim(d, batch_dims));
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
TensorDict reduction(
    const TensorDict& td, const ReductionOptions& o,
    const std::function<at::Tensor(const at::Tensor&, at::OptionalIntArrayRef, bool)>& fn) {
  const int64_t bd = td.batch_dims();
  if (o.feature) {
    return map_leaves(
        td,
        [&](const at::Tensor& t) {
          if (t.dim() == bd) return t;
          std::vector<int64_t> dims(static_cast<size_t>(t.dim() - bd));
          std::iota(dims.begin(), dims.end(), bd);
          return fn(t, dims, o.keepdim);
        },
        td.device(), NonTensors::kDrop);
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
  const int64_t d = wrap_dim(o.dims[0], td.batch_dims());
  const auto bs = reduced_batch(td.batch_size(), {d}, o.keepdim);
  auto parts = detail::map_batch(td, td.batch_size().size(), {bs, bs}, [&](const at::Tensor& t) {
    auto [values, indices] = is_max ? t.max(d, o.keepdim) : t.min(d, o.keepdim);
    return std::vector<at::Tensor>{values, indices};
  });
  return {parts[0], parts[1]};
}

// The reference's name of a reduction (its method's), for messages.
const char* name_of(Reduction op) {
  switch (op) {
    case Reduction::kSum: return "sum";
    case Reduction::kMean: return "mean";
    case Reduction::kStd: return "std";
    case Reduction::kMax: return "max";
    case Reduction::kMin: return "min";
  }
  TORCH_CHECK_VALUE(false, "reduce_all: unknown reduction ", static_cast<int>(op));
}

}  // namespace

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

at::Tensor TensorDict::reduce_all(Reduction op, const ReductionOptions& o) const {
  const char* name = name_of(op);
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
  if (op == Reduction::kSum) return dims ? all.sum(*dims, keep, o.dtype) : all.sum(o.dtype);
  if (op == Reduction::kMean) return dims ? all.mean(*dims, keep, o.dtype) : all.mean(o.dtype);
  if (op == Reduction::kStd) {
    return all.std(dims ? at::OptionalIntArrayRef(*dims) : std::nullopt, at::Scalar(o.correction),
                   keep);
  }
  const bool is_max = op == Reduction::kMax;
  if (!dims) return is_max ? all.max() : all.min();
  TORCH_CHECK_VALUE(dims->size() == 1, name, "(reduce=True): dim must be a single dim");
  return std::get<0>(is_max ? all.max((*dims)[0], keep) : all.min((*dims)[0], keep));
}

// ---- comparisons ---------------------------------------------------------------------------

namespace {

// Two non-tensor entries element by element: a bool tensor of their batch size, as the
// reference's NonTensorData.__eq__ and NonTensorStack.__eq__ give.
at::Tensor compare_non_tensors(const NonTensorData& a, const NonTensorData& b, bool eq,
                               const char* what, const std::string& key) {
  TORCH_CHECK(a.batch_size() == b.batch_size(), what, ": the non-tensor entry ", quote_key(key),
              " has batch sizes ", a.batch_size(), " and ", b.batch_size());
  const auto options =
      at::TensorOptions().dtype(at::kBool).device(a.device().value_or(at::Device(at::kCPU)));
  if (!a.is_stack() && !b.is_stack())
    return at::full(a.batch_size(), (a.data() == b.data()) == eq, options);
  const auto ea = detail::non_tensor_elements(a), eb = detail::non_tensor_elements(b);
  const at::Tensor ia = ea.ids.contiguous(), ib = eb.ids.contiguous();
  at::Tensor out = at::empty(a.batch_size(), at::kBool);
  const int64_t* pa = ia.const_data_ptr<int64_t>();
  const int64_t* pb = ib.const_data_ptr<int64_t>();
  bool* po = out.data_ptr<bool>();
  for (int64_t i = 0; i < out.numel(); ++i) {
    po[i] = (ea.atoms[static_cast<size_t>(pa[i])]->data() ==
             eb.atoms[static_cast<size_t>(pb[i])]->data()) == eq;
  }
  return out.to(options.device());
}

// a == b (or !=) key by key (non-tensor entries by compare_non_tensors).
TensorDict compare(const TensorDict& a, const TensorDict& b, bool eq, const char* what) {
  if (a.is_lazy_stack() || b.is_lazy_stack()) {
    // Slice by slice along the lazy stack's dim, giving a lazy stack.
    const TensorDict& lazy = a.is_lazy_stack() ? a : b;
    const int64_t d = detail::stack_dim_of(lazy);
    TORCH_CHECK_VALUE(a.batch_size() == b.batch_size(), what, ": batch sizes differ, ",
                      a.batch_size(), " and ", b.batch_size());
    const auto as = a.unbind(d), bs = b.unbind(d);
    std::vector<TensorDict> parts;
    for (size_t i = 0; i < as.size(); ++i) parts.push_back(compare(as[i], bs[i], eq, what));
    return TensorDictImpl::make_lazy(std::move(parts), d);
  }
  check_same_keys(a, b, what);
  TensorDict out = TensorDictImpl::make(a.batch_size().vec(), a.device());
  for (const auto& [key, value] : a.entries()) {
    const Value& o = *TensorDictImpl::of(b).find(key);
    TORCH_CHECK_TYPE(
        value.is_tensor() == o.is_tensor() && value.is_non_tensor() == o.is_non_tensor(), what,
        ": key ", quote_key(key), " is ", detail::kind_name(value), " in the first TensorDict but ",
        detail::kind_name(o), " in the second");
    if (value.is_tensor()) {
      out.set(key, detail::same_kind(value, eq ? at::eq(value.tensor(), o.tensor())
                                               : at::ne(value.tensor(), o.tensor())));
    } else if (value.is_non_tensor()) {
      out.set(key, compare_non_tensors(value.non_tensor(), o.non_tensor(), eq, what, key));
    } else {
      out.set(key, compare(value.tensordict(), o.tensordict(), eq, what));
    }
  }
  return out;
}

}  // namespace

TensorDict TensorDict::operator==(const TensorDict& other) const {
  return compare(*this, other, true, "==");
}

TensorDict TensorDict::operator!=(const TensorDict& other) const {
  return compare(*this, other, false, "!=");
}

// Non-tensor entries are left out of a comparison with a scalar (the reference's result for
// them is an empty TensorDict, which says nothing).
TensorDict TensorDict::operator==(const at::Scalar& other) const {
  return map_leaves(
      *this, [&](const at::Tensor& t) { return at::eq(t, other); }, device(), NonTensors::kDrop);
}

TensorDict TensorDict::operator!=(const at::Scalar& other) const {
  return map_leaves(
      *this, [&](const at::Tensor& t) { return at::ne(t, other); }, device(), NonTensors::kDrop);
}

// all() and any() visit the leaves where they are (a lazy stack's in its members), so that
// nothing is stacked.
bool TensorDict::all() const {
  for (const auto& [key, v] : entries()) {
    if (v.is_tensor() ? !v.tensor().all().item<bool>()
                      : v.is_tensordict() && !v.tensordict().all()) {
      return false;
    }
  }
  return true;
}

bool TensorDict::any() const {
  for (const auto& [key, v] : entries()) {
    if (v.is_tensor() ? v.tensor().any().item<bool>() : v.is_tensordict() && v.tensordict().any()) {
      return true;
    }
  }
  return false;
}

bool TensorDict::allclose(const TensorDict& other, double rtol, double atol, bool equal_nan) const {
  if (is_lazy_stack() || other.is_lazy_stack()) {
    if (batch_size() != other.batch_size()) return false;
    // Slice by slice along a lazy stack's dim, so that heterogeneous members compare too.
    const int64_t d = detail::stack_dim_of(is_lazy_stack() ? *this : other);
    const auto mine = unbind(d), theirs = other.unbind(d);
    for (size_t i = 0; i < mine.size(); ++i) {
      if (!mine[i].allclose(theirs[i], rtol, atol, equal_nan)) return false;
    }
    return true;
  }
  // Non-tensor entries must hold equal data at the same keys.
  const auto non_tensors = [](const TensorDict& td) {
    std::vector<std::pair<NestedKey, Value>> out;
    for (auto& [k, v] : td.items({.include_nested = true})) {
      if (v.is_non_tensor()) out.emplace_back(std::move(k), std::move(v));
    }
    return out;
  };
  const auto my_nt = non_tensors(*this);
  const auto their_nt = non_tensors(other);
  if (my_nt.size() != their_nt.size()) return false;
  for (const auto& [key, value] : my_nt) {
    const Value o = other.get(key, at::Tensor());
    if (!o.is_non_tensor() || !(o.non_tensor().tolist() == value.non_tensor().tolist()))
      return false;
  }
  const auto mine = items({.include_nested = true, .leaves_only = true});
  const auto theirs = other.items({.include_nested = true, .leaves_only = true});
  if (mine.size() != theirs.size()) return false;
  for (const auto& [key, value] : mine) {
    if (!other.contains(key)) return false;
    const Value o = other.get(key);
    if (!o.is_tensor()) return false;
    const at::Tensor& a = value.tensor();
    const at::Tensor& b = o.tensor();
    if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
    if (a.scalar_type() == at::kBool || c10::isIntegralType(a.scalar_type(), false)) {
      if (!at::equal(a, b)) return false;
    } else if (!at::allclose(a, b, rtol, atol, equal_nan)) {
      return false;
    }
  }
  return true;
}

}  // namespace tensordict

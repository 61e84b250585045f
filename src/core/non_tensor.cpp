// NonTensorData in its three kinds (non_tensor.h), and the batch operations on a stack: every
// one runs on a tensor of element ids (the flat position of each element's member in a list
// of the stack's plain members) and picks the members at the resulting ids, as the reference's
// NonTensorStack._batch_op runs torch's operation on a tensor of positions.

#include "tensordict/non_tensor.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>

#include <cstdint>
#include <map>
#include <unordered_set>
#include <utility>

#include "core/json_text.h"
#include "non_tensor_ops.h"

namespace tensordict {
namespace {

std::optional<at::Device> common_device(const std::vector<NonTensorData>& members) {
  if (members.empty()) return std::nullopt;
  std::optional<at::Device> device = members.front().device();
  for (const auto& m : members) {
    if (m.device() != device) return std::nullopt;
  }
  return device;
}

// Row-major nested lists of `data` over `dims`.
JsonValue repeat(const JsonValue& data, at::IntArrayRef dims) {
  if (dims.empty()) return data;
  JsonValue::List out;
  out.reserve(static_cast<size_t>(dims[0]));
  for (int64_t i = 0; i < dims[0]; ++i) out.push_back(repeat(data, dims.slice(1)));
  return JsonValue(std::move(out));
}

// tolist() of an id tensor over the plain members `atoms`.
JsonValue values_at(const std::vector<const NonTensorData*>& atoms, const at::Tensor& ids) {
  if (ids.dim() == 0) return atoms[static_cast<size_t>(ids.item<int64_t>())]->data();
  JsonValue::List out;
  out.reserve(static_cast<size_t>(ids.size(0)));
  for (int64_t i = 0; i < ids.size(0); ++i) out.push_back(values_at(atoms, ids[i]));
  return JsonValue(std::move(out));
}

// Whether from_list makes `items` a stack of stacks: every item a list of the first's length.
bool nests(const JsonValue::List& items, std::optional<int64_t> ndim) {
  bool nested = !items.empty() && (!ndim || *ndim > 1);
  for (size_t i = 0; nested && i < items.size(); ++i) {
    nested = items[i].is_list() && items[i].as_list().size() == items[0].as_list().size();
  }
  return nested;
}

uint64_t saturating_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
uint64_t saturating_mul(uint64_t a, uint64_t b) {
  return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

// What from_list would build for a list, found without building it: its members at every
// level, each use of a shared list counted again, and the items of its distinct lists (what
// the caller's data holds). Memoized per list node and levels left, so a list referenced 32
// times at each of six levels (2^30 members) costs six visits.
class StackCount {
 public:
  uint64_t members(const JsonValue& list, std::optional<int64_t> ndim) {
    const auto key = std::make_pair(list.node(), ndim);
    if (const auto it = done_.find(key); it != done_.end()) return it->second;
    const auto& items = list.as_list();
    if (seen_.insert(list.node()).second) distinct_ = saturating_add(distinct_, items.size());
    uint64_t n = items.size();
    if (nests(items, ndim)) {
      const std::optional<int64_t> below = ndim ? std::optional(*ndim - 1) : ndim;
      for (const auto& item : items) n = saturating_add(n, members(item, below));
    }
    done_.emplace(key, n);
    return n;
  }
  uint64_t distinct() const { return distinct_; }

 private:
  uint64_t distinct_ = 0;
  std::unordered_set<const void*> seen_;
  std::map<std::pair<const void*, std::optional<int64_t>>, uint64_t> done_;
};

NonTensorData stack_from_list(const JsonValue& values, std::optional<at::Device> device,
                              std::optional<int64_t> ndim) {
  const auto& items = values.as_list();
  if (items.empty()) return detail::empty_stack({0}, device);
  const bool nested = nests(items, ndim);
  std::vector<NonTensorData> members;
  members.reserve(items.size());
  for (const auto& item : items) {
    members.push_back(nested ? stack_from_list(item, device, ndim ? std::optional(*ndim - 1) : ndim)
                             : NonTensorData(item, {}, device));
  }
  return NonTensorData::stack(std::move(members), 0);  // the members' device: `device`
}

}  // namespace

NonTensorData::NonTensorData(JsonValue data, std::vector<int64_t> batch_size,
                             std::optional<at::Device> device, NonTensorKind kind)
    : data_(std::move(data)), batch_size_(std::move(batch_size)), device_(device), kind_(kind) {
  TORCH_CHECK_VALUE(kind != NonTensorKind::kStack,
                    "NonTensorData: a NonTensorStack is made by NonTensorData::stack");
}

NonTensorData NonTensorData::stack(std::vector<NonTensorData> members, int64_t stack_dim,
                                   std::optional<std::string> stack_dim_name) {
  NonTensorData out;
  out.kind_ = NonTensorKind::kStack;
  out.stack_dim_name_ = std::move(stack_dim_name);
  if (members.empty()) {
    TORCH_CHECK_VALUE(stack_dim == 0 || stack_dim == -1, "NonTensorStack: stack dim ", stack_dim,
                      " is out of range for a stack without members");
    out.batch_size_ = {0};
    out.members_ = std::make_shared<const std::vector<NonTensorData>>();
    return out;
  }
  const at::IntArrayRef member_batch = members.front().batch_size();
  for (size_t i = 1; i < members.size(); ++i) {
    TORCH_CHECK_VALUE(members[i].batch_size() == member_batch,
                      "NonTensorStack: the members have different batch sizes, ", member_batch,
                      " (member 0) and ", members[i].batch_size(), " (member ", i,
                      "), so they cannot be stacked");
  }
  const int64_t d = c10::maybe_wrap_dim(stack_dim, static_cast<int64_t>(member_batch.size()) + 1);
  out.stack_dim_ = d;
  out.batch_size_ = member_batch.vec();
  out.batch_size_.insert(out.batch_size_.begin() + d, static_cast<int64_t>(members.size()));
  out.device_ = common_device(members);
  out.members_ = std::make_shared<const std::vector<NonTensorData>>(std::move(members));
  return out;
}

NonTensorData NonTensorData::from_list(const JsonValue& values, std::optional<at::Device> device,
                                       std::optional<int64_t> ndim, std::string_view what) {
  TORCH_CHECK_TYPE(values.is_list(), "NonTensorStack.from_list: expected a list, got ",
                   core::json_type_name(values));
  // A member per use of a shared list: a pickle of 2.7 KB referencing one list 32 times at
  // each of five levels would make 34,636,832 members (4.6 GB). Measured before any is built.
  StackCount count;
  const uint64_t members = count.members(values, ndim);
  constexpr uint64_t kMemberBytes = sizeof(NonTensorData);
  const uint64_t extra = members > count.distinct() ? members - count.distinct() : 0;
  TORCH_CHECK_VALUE(
      extra <= core::kMaxJsonExpansion / kMemberBytes, what, ": as a NonTensorStack it would have ",
      members, " members, about ", saturating_mul(members, kMemberBytes), " bytes (", kMemberBytes,
      " a member), since the list reuses shared lists (one list referenced many "
      "times): ",
      saturating_mul(extra, kMemberBytes), " bytes more than a member for each of the ",
      count.distinct(), " items of its distinct lists; the limit is ", core::kMaxJsonExpansion,
      " bytes (docs/reliability.md)");
  return stack_from_list(values, device, ndim);
}

const char* NonTensorData::class_name() const {
  switch (kind_) {
    case NonTensorKind::kData: return "NonTensorData";
    case NonTensorKind::kMetaData: return "MetaData";
    case NonTensorKind::kStack: return "NonTensorStack";
  }
  return "NonTensorData";
}

const JsonValue& NonTensorData::data() const {
  TORCH_CHECK_TYPE(!is_stack(),
                   "Cannot get the non-unique data of a NonTensorStack. Use "
                   ".tolist() instead.");
  return data_;
}

std::optional<JsonValue> NonTensorData::common_data() const {
  if (!is_stack()) return data_;
  const auto elements = detail::non_tensor_elements(*this);
  if (elements.atoms.empty()) return std::nullopt;
  const JsonValue& first = elements.atoms.front()->data();
  for (const NonTensorData* a : elements.atoms) {
    if (!core::json_identical(a->data(), first)) return std::nullopt;
  }
  return first;
}

JsonValue NonTensorData::tolist() const {
  if (!is_stack()) return repeat(data_, batch_size_);
  const auto elements = detail::non_tensor_elements(*this);
  return values_at(elements.atoms, elements.ids);
}

const std::vector<NonTensorData>& NonTensorData::members() const {
  static const std::vector<NonTensorData> kNone;
  return members_ ? *members_ : kNone;
}

NonTensorData NonTensorData::with_batch_size(std::vector<int64_t> batch_size) const {
  TORCH_CHECK_VALUE(!is_stack() || batch_size == batch_size_, "a NonTensorStack's batch size ",
                    at::IntArrayRef(batch_size_), " follows its members; it cannot become ",
                    at::IntArrayRef(batch_size));
  NonTensorData out = *this;
  out.batch_size_ = std::move(batch_size);
  return out;
}

std::vector<NonTensorData> NonTensorData::unbind(int64_t dim) const {
  TORCH_CHECK_INDEX(!batch_size_.empty(),
                    "unbind: a non-tensor entry with batch size [] has no "
                    "dim to unbind");
  const int64_t d = c10::maybe_wrap_dim(dim, static_cast<int64_t>(batch_size_.size()));
  if (is_stack() && stack_dim_ == d && !members_->empty()) return *members_;
  std::vector<NonTensorData> out;
  if (!is_stack()) {
    std::vector<int64_t> bs = batch_size_;
    const int64_t n = bs[d];
    bs.erase(bs.begin() + d);
    out.assign(static_cast<size_t>(n), with_batch_size(std::move(bs)));
    return out;
  }
  const auto elements = detail::non_tensor_elements(*this);
  for (const auto& ids : elements.ids.unbind(d)) {
    out.push_back(detail::select_elements(elements.atoms, ids, device_));
  }
  return out;
}

NonTensorData NonTensorData::with_device(std::optional<at::Device> device) const {
  NonTensorData out = *this;
  out.device_ = device;
  if (is_stack()) {
    std::vector<NonTensorData> members;
    members.reserve(members_->size());
    for (const auto& m : *members_) members.push_back(m.with_device(device));
    out.members_ = std::make_shared<const std::vector<NonTensorData>>(std::move(members));
  }
  return out;
}

bool NonTensorData::operator==(const NonTensorData& other) const {
  if (kind_ != other.kind_ || batch_size_ != other.batch_size_ || device_ != other.device_) {
    return false;
  }
  if (!is_stack()) return core::json_identical(data_, other.data_);
  return stack_dim_ == other.stack_dim_ && stack_dim_name_ == other.stack_dim_name_ &&
         *members_ == *other.members_;
}

namespace detail {

namespace {

std::vector<int64_t> concat(at::IntArrayRef head, at::IntArrayRef tail) {
  std::vector<int64_t> out(head.begin(), head.end());
  out.insert(out.end(), tail.begin(), tail.end());
  return out;
}

at::Tensor element_ids(const NonTensorData& nt, std::vector<const NonTensorData*>& atoms) {
  if (!nt.is_stack()) {
    const auto id = static_cast<int64_t>(atoms.size());
    atoms.push_back(&nt);
    return at::full(nt.batch_size(), id, at::kLong);
  }
  const auto& members = nt.members();
  if (members.empty()) return at::empty(nt.batch_size(), at::kLong);
  bool flat = true;  // the common stack: plain members of batch size [] (one tensor, not n)
  for (size_t i = 0; flat && i < members.size(); ++i) {
    flat = !members[i].is_stack() && members[i].batch_size().empty();
  }
  if (flat) {
    const auto first = static_cast<int64_t>(atoms.size());
    for (const auto& m : members) atoms.push_back(&m);
    return at::arange(first, first + static_cast<int64_t>(members.size()), at::kLong);
  }
  std::vector<at::Tensor> parts;
  parts.reserve(members.size());
  for (const auto& m : members) parts.push_back(element_ids(m, atoms));
  return at::stack(parts, nt.stack_dim());
}

// Whether every id of the block is `id`.
bool same_id(const int64_t* ids, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t id) {
  if (sizes.empty()) return *ids == id;
  for (int64_t i = 0; i < sizes[0]; ++i) {
    if (!same_id(ids + i * strides[0], sizes.slice(1), strides.slice(1), id)) return false;
  }
  return true;
}

// select_elements over a contiguous id tensor's data, without a tensor per element.
NonTensorData select_at(const std::vector<const NonTensorData*>& atoms, const int64_t* ids,
                        at::IntArrayRef sizes, at::IntArrayRef strides,
                        std::optional<at::Device> device) {
  if (sizes.empty()) {
    TORCH_INTERNAL_ASSERT(*ids >= 0 && static_cast<size_t>(*ids) < atoms.size());
    const NonTensorData& a = *atoms[static_cast<size_t>(*ids)];
    return NonTensorData(a.data(), {}, device, a.kind());
  }
  if (sizes[0] == 0) return empty_stack(sizes.vec(), device);
  // A block holding all of one member's elements is that member (an integer index along the
  // stack dim gives the member back, as the reference's lazy stack does).
  const NonTensorData& first = *atoms[static_cast<size_t>(*ids)];
  if (first.batch_size() == sizes && same_id(ids, sizes, strides, *ids)) {
    return device == first.device() ? first : first.with_device(device);
  }
  std::vector<NonTensorData> members;
  members.reserve(static_cast<size_t>(sizes[0]));
  for (int64_t i = 0; i < sizes[0]; ++i) {
    members.push_back(
        select_at(atoms, ids + i * strides[0], sizes.slice(1), strides.slice(1), device));
  }
  NonTensorData out = NonTensorData::stack(std::move(members), 0);
  return device == out.device() ? out : out.with_device(device);
}

}  // namespace

NonTensorElements non_tensor_elements(const NonTensorData& nt) {
  NonTensorElements out;
  out.ids = element_ids(nt, out.atoms);
  return out;
}

NonTensorData select_elements(const std::vector<const NonTensorData*>& atoms, const at::Tensor& ids,
                              std::optional<at::Device> device) {
  const at::Tensor c = ids.to(at::kCPU, at::kLong).contiguous();
  return select_at(atoms, c.const_data_ptr<int64_t>(), c.sizes(), c.strides(), device);
}

NonTensorData empty_stack(std::vector<int64_t> batch_size, std::optional<at::Device> device) {
  NonTensorData out = NonTensorData::stack({}, 0);
  out.batch_size_ = std::move(batch_size);  // the dims after the first have no member to hold them
  out.device_ = device;
  return out;
}

std::vector<NonTensorData> map_non_tensor(
    const NonTensorData& nt, size_t level_dims,
    const std::vector<std::vector<int64_t>>& new_batches,
    const std::function<std::vector<at::Tensor>(const at::Tensor&)>& fn) {
  std::vector<NonTensorData> out;
  out.reserve(new_batches.size());
  if (!nt.is_stack()) {
    // The data is kept; the batch size follows the level's, as the reference's NonTensorData
    // does (its extra batch dims, if any, stay after the new ones).
    const auto extra = nt.batch_size().slice(level_dims);
    for (const auto& b : new_batches) out.push_back(nt.with_batch_size(concat(b, extra)));
    return out;
  }
  const auto elements = non_tensor_elements(nt);
  for (const auto& ids : fn(elements.ids)) {
    out.push_back(select_elements(elements.atoms, ids, nt.device()));
  }
  return out;
}

NonTensorData stack_non_tensors(std::vector<NonTensorData> parts, int64_t dim) {
  TORCH_INTERNAL_ASSERT(!parts.empty());
  bool one = parts.front().is_metadata();
  for (size_t i = 1; one && i < parts.size(); ++i) {
    one = parts[i].is_metadata() && parts[i].batch_size() == parts[0].batch_size() &&
          core::json_identical(parts[i].data(), parts[0].data());
  }
  if (one) {
    std::vector<int64_t> bs = parts[0].batch_size().vec();
    bs.insert(bs.begin() + dim, static_cast<int64_t>(parts.size()));
    return parts[0].with_batch_size(std::move(bs));
  }
  return NonTensorData::stack(std::move(parts), dim);
}

NonTensorData cat_non_tensors(const std::vector<NonTensorData>& parts, int64_t dim) {
  TORCH_INTERNAL_ASSERT(!parts.empty());
  const NonTensorData& first = parts.front();
  bool same = !first.is_stack();
  for (size_t i = 1; same && i < parts.size(); ++i) {
    same = parts[i].kind() == first.kind() && core::json_identical(parts[i].data(), first.data());
  }
  if (same) {
    std::vector<int64_t> bs = first.batch_size().vec();
    for (size_t i = 1; i < parts.size(); ++i) bs[dim] += parts[i].batch_size()[dim];
    return first.with_batch_size(std::move(bs));
  }
  std::vector<const NonTensorData*> atoms;
  std::vector<at::Tensor> ids;
  std::optional<at::Device> device = first.device();
  for (const auto& p : parts) {
    ids.push_back(element_ids(p, atoms));
    if (p.device() != device) device = std::nullopt;
  }
  return select_elements(atoms, at::cat(ids, dim), device);
}

}  // namespace detail

}  // namespace tensordict

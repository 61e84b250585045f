// LazyStackedTensorDict: a TensorDict level whose entries are its members, keyed "0", "1", ...
// (tensor_dict_impl.h), and the meaning of the TensorDict methods on it (lazy_stack.h).

#include "tensordict/lazy_stack.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "non_tensor_ops.h"
#include "tensor_dict_impl.h"

namespace tensordict {

using detail::TensorDictImpl;

namespace {

std::vector<int64_t> with_dim(at::IntArrayRef sizes, int64_t dim, int64_t n) {
  std::vector<int64_t> out = sizes.vec();
  out.insert(out.begin() + dim, n);
  return out;
}

// `who`'s checks of members for a stack along dim (negative: counted from batch_dims + 1);
// returns the wrapped dim.
int64_t check_members(const std::vector<TensorDict>& tds, int64_t dim, const std::string& who) {
  TORCH_CHECK_VALUE(!tds.empty(), who, ": expected a non-empty list of TensorDicts");
  const auto bs = tds[0].batch_size();
  for (size_t i = 1; i < tds.size(); ++i) {
    TORCH_CHECK_VALUE(tds[i].batch_size() == bs, who, ": tensordict ", i, " has batch_size ",
                      tds[i].batch_size(), " but tensordict 0 has ", bs,
                      "; the members of a lazy stack share their batch size");
  }
  const auto bd = static_cast<int64_t>(bs.size());
  TORCH_CHECK(dim >= -(bd + 1) && dim <= bd, "Stack dim ", dim, " is too big for batch size ", bs,
              ".");
  return dim < 0 ? dim + bd + 1 : dim;
}

std::string key_list(const std::vector<std::string>& keys) {
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  std::string out = "[";
  for (size_t i = 0; i < sorted.size(); ++i) out += (i ? ", " : "") + quote_key(sorted[i]);
  return out + "]";
}

NestedKey tail(const NestedKey& key) {
  return NestedKey(std::vector<std::string>(key.parts().begin() + 1, key.parts().end()));
}

// The value at `key` (one part) of every member: KeyError unless all have it, TypeError unless
// all hold the same kind of value.
std::vector<Value> parts_at(const TensorDict& td, const std::string& key) {
  const auto members = detail::members_of(td);
  std::vector<Value> parts;
  parts.reserve(members.size());
  std::string missing;
  for (size_t i = 0; i < members.size(); ++i) {
    if (!members[i].contains(key)) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(i);
    } else {
      parts.push_back(members[i].get(key));
    }
  }
  TD_CHECK_KEY(missing.empty(), "key ", quote_key(key),
               " not found in LazyStackedTensorDict with keys ",
               key_list(detail::lazy::common_keys(td)),
               parts.empty() ? std::string() : " (members " + missing + " lack it)");
  for (size_t i = 1; i < parts.size(); ++i) {
    TORCH_CHECK_TYPE(parts[i].is_tensor() == parts[0].is_tensor() &&
                         parts[i].is_tensordict() == parts[0].is_tensordict(),
                     "key ", quote_key(key), " is ", detail::kind_name(parts[0]),
                     " in member 0 but ", detail::kind_name(parts[i]), " in member ", i);
  }
  return parts;
}

// The lazy stack of the members' nested levels at `key`, which must share a batch size.
TensorDict stack_levels(const TensorDict& td, const std::string& key,
                        const std::vector<Value>& parts) {
  std::vector<TensorDict> levels;
  levels.reserve(parts.size());
  for (const auto& p : parts) levels.push_back(p.tensordict());
  for (size_t i = 1; i < levels.size(); ++i) {
    TORCH_CHECK(levels[i].batch_size() == levels[0].batch_size(), "key ", quote_key(key),
                " holds TensorDicts of batch_size ", levels[0].batch_size(), " in member 0 but ",
                levels[i].batch_size(), " in member ", i, ", which cannot be stacked");
  }
  const auto& lazy = *TensorDictImpl::of(td).lazy;
  return TensorDictImpl::make_lazy(std::move(levels), lazy.stack_dim, lazy.stack_dim_name);
}

std::string shapes_list(const std::vector<Value>& parts) {
  std::string out = "[";
  for (size_t i = 0; i < parts.size(); ++i) {
    out += (i ? ", " : "") + c10::str("torch.Size(", parts[i].tensor().sizes(), ")");
  }
  return out + "]";
}

// Every member's part of `value`, a value of the stack's level at `key`: unbound along the
// stack dim. Checked before anything is written.
std::vector<Value> split_value(const TensorDict& td, const NestedKey& key, const Value& value) {
  const auto& impl = TensorDictImpl::of(td);
  const int64_t d = impl.lazy->stack_dim;
  const auto n = static_cast<int64_t>(impl.entries.size());
  std::vector<Value> parts;
  if (value.is_non_tensor()) {
    const NonTensorData& nt = value.non_tensor();
    if (nt.batch_size().empty()) {  // "this level's", as for a TensorDict
      parts.assign(n, value);
      return parts;
    }
    detail::check_batch_prefix(key, nt.batch_size(), impl.batch_size);
    for (auto& part : nt.unbind(d)) parts.emplace_back(std::move(part));
    return parts;
  }
  TORCH_CHECK_TYPE(!value.is_tensor() || value.tensor().defined(), "cannot set key ", key.str(),
                   " to an undefined tensor");
  if (value.is_unbatched()) {  // every member holds it whole
    parts.assign(n, value);
    return parts;
  }
  detail::check_batch_prefix(key, detail::entry_shape(value), impl.batch_size);
  if (value.is_tensor()) {
    for (auto& t : value.tensor().unbind(d)) parts.emplace_back(std::move(t));
  } else {
    for (auto& t : value.tensordict().unbind(d)) parts.emplace_back(std::move(t));
  }
  return parts;
}

// Throws what member.set(key, ...) would throw on the way to key's level, before any member is
// written: a locked member, or a part of the path that is not a TensorDict.
void check_writable(const TensorDict& member, const NestedKey& key) {
  TORCH_CHECK(!member.is_locked(), detail::kLockedMessage);
  std::vector<std::string> prefix;
  for (size_t i = 0; i + 1 < key.size(); ++i) {
    prefix.push_back(key[i]);
    if (!member.contains(NestedKey(prefix))) return;  // set() creates the rest
    const Value v = member.get(NestedKey(prefix));
    TD_CHECK_KEY(v.is_tensordict(), "cannot reach key ", key.str(), ": ", quote_key(key[i]), " is ",
                 detail::kind_name(v), ", not a TensorDict");
    if (v.tensordict().is_lazy_stack()) return;  // its own set() checks its members
    TORCH_CHECK(!v.tensordict().is_locked(), detail::kLockedMessage);
  }
}

}  // namespace

// ---- construction ---------------------------------------------------------------------------

TensorDict TensorDictImpl::make_lazy(std::vector<TensorDict> members, int64_t stack_dim,
                                     std::optional<std::string> stack_dim_name) {
  auto impl = std::make_shared<TensorDictImpl>();
  impl->batch_size =
      with_dim(members.front().batch_size(), stack_dim, static_cast<int64_t>(members.size()));
  impl->device = members.front().device();
  for (const auto& m : members) {
    if (m.device() != impl->device) impl->device = std::nullopt;
  }
  impl->lazy = LazyStack{stack_dim, std::move(stack_dim_name)};
  impl->entries.reserve(members.size());
  for (size_t i = 0; i < members.size(); ++i) impl->put(std::to_string(i), std::move(members[i]));
  return TensorDict(std::move(impl));
}

LazyStackedTensorDict::LazyStackedTensorDict(std::vector<TensorDict> tensordicts, int64_t stack_dim,
                                             std::optional<std::string> stack_dim_name)
    : TensorDict([&] {
        const int64_t d = check_members(tensordicts, stack_dim, "LazyStackedTensorDict");
        return TensorDictImpl::make_lazy(std::move(tensordicts), d, std::move(stack_dim_name));
      }()) {}

LazyStackedTensorDict LazyStackedTensorDict::of(const TensorDict& td) {
  TORCH_CHECK_TYPE(td.is_lazy_stack(), "expected a LazyStackedTensorDict, got a TensorDict");
  return LazyStackedTensorDict(td);
}

std::vector<TensorDict> LazyStackedTensorDict::tensordicts() const {
  return detail::members_of(*this);
}

int64_t LazyStackedTensorDict::stack_dim() const { return detail::stack_dim_of(*this); }

const std::optional<std::string>& LazyStackedTensorDict::stack_dim_name() const {
  return TensorDictImpl::of(*this).lazy->stack_dim_name;
}

std::vector<std::vector<NestedKey>> LazyStackedTensorDict::exclusive_keys() const {
  const auto members = tensordicts();
  std::vector<std::vector<NestedKey>> out(members.size());
  const auto common = keys({.include_nested = true});
  for (size_t i = 0; i < members.size(); ++i) {
    for (auto& k : members[i].keys({.include_nested = true})) {
      if (std::find(common.begin(), common.end(), k) == common.end())
        out[i].push_back(std::move(k));
    }
  }
  return out;
}

LazyStackedTensorDict lazy_stack(std::vector<TensorDict> tds, int64_t dim) {
  return LazyStackedTensorDict(std::move(tds), dim);
}

namespace {

// Whether the TensorDicts hold the same keys, each of one kind with (tensors) one shape: what
// stack() needs at this level (nested levels decide for themselves).
bool same_layout(const std::vector<TensorDict>& tds) {
  const TensorDict& first = tds.front();
  if (first.is_lazy_stack()) return false;
  for (size_t i = 1; i < tds.size(); ++i) {
    const TensorDict& td = tds[i];
    if (td.is_lazy_stack() || td.batch_size() != first.batch_size() ||
        td.entries().size() != first.entries().size()) {
      return false;
    }
    for (const auto& [key, v0] : first.entries()) {
      const Value* v = td.find(key);
      if (v == nullptr || v->is_tensor() != v0.is_tensor() ||
          v->is_tensordict() != v0.is_tensordict() || v->is_unbatched() != v0.is_unbatched()) {
        return false;
      }
      // The reference compares _shape(): a tensor's (unbatched ones too), else the batch size
      // (a nested level's or a non-tensor entry's) -- a nested level of another batch size
      // makes the whole stack lazy, and could not be a member of a nested lazy stack anyway.
      if (v0.is_tensor() ? v->tensor().sizes() != v0.tensor().sizes()
                         : detail::entry_shape(*v) != detail::entry_shape(v0)) {
        return false;
      }
    }
  }
  return true;
}

// Every leaf of `td`, over the members of lazy stacks (the count of the reference's
// tree_leaves).
int64_t count_leaves(const TensorDict& td) {
  int64_t n = 0;
  for (const auto& [key, v] : td.entries())
    n += v.is_tensordict() ? count_leaves(v.tensordict()) : 1;
  return n;
}

// The reference's rule for lazy stacks only: with the same keys, as many members and as many
// leaves, the members are stacked (maybe densely) member by member and the result is a lazy
// stack of those, its stack dim moved past the new dim; otherwise a lazy stack of the stacks.
TensorDict stack_lazy_stacks(const std::vector<TensorDict>& tds, int64_t dim) {
  std::vector<LazyStackedTensorDict> lazy;
  for (const auto& td : tds) lazy.push_back(LazyStackedTensorDict::of(td));
  const auto keys = [](const TensorDict& td) {
    auto k = td.keys();
    std::vector<std::string> out;
    for (const auto& key : k) out.push_back(key.str());
    std::sort(out.begin(), out.end());
    return out;
  };
  const size_t members = lazy[0].tensordicts().size();
  const int64_t leaves = count_leaves(tds[0]);
  for (size_t i = 1; i < tds.size(); ++i) {
    if (keys(tds[i]) != keys(tds[0]) || lazy[i].tensordicts().size() != members ||
        count_leaves(tds[i]) != leaves) {
      return lazy_stack(tds, dim);
    }
  }
  int64_t d = c10::maybe_wrap_dim(dim, tds[0].batch_dims() + 1);
  int64_t stack_dim = lazy[0].stack_dim();
  if (d <= stack_dim) {
    ++stack_dim;
  } else {
    --d;
  }
  std::vector<TensorDict> stacked;
  for (size_t m = 0; m < members; ++m) {
    std::vector<TensorDict> column;
    for (const auto& l : lazy) column.push_back(l.tensordicts()[m]);
    stacked.push_back(maybe_dense_stack(column, d));
  }
  return LazyStackedTensorDict(std::move(stacked), stack_dim);
}

}  // namespace

TensorDict maybe_dense_stack(const std::vector<TensorDict>& tds, int64_t dim) {
  TORCH_CHECK_VALUE(!tds.empty(), "list_of_tensordicts cannot be empty");
  for (size_t i = 1; i < tds.size(); ++i) {
    TORCH_CHECK(tds[i].batch_dims() == tds[0].batch_dims(),
                "Lazy stacking of tensordicts "
                "requires them to have congruent batch dimensions, got td[",
                i, "].batch_dims=", tds[i].batch_dims(),
                " and td[0].batch_dims=", tds[0].batch_dims());
  }
  if (std::all_of(tds.begin(), tds.end(),
                  [](const TensorDict& td) { return td.is_lazy_stack(); }) &&
      std::all_of(tds.begin(), tds.end(),
                  [&](const TensorDict& td) { return td.batch_size() == tds[0].batch_size(); })) {
    return stack_lazy_stacks(tds, dim);
  }
  if (!same_layout(tds)) return lazy_stack(tds, dim);
  const int64_t d = c10::maybe_wrap_dim(dim, tds[0].batch_dims() + 1);
  std::vector<int64_t> bs = tds[0].batch_size().vec();
  bs.insert(bs.begin() + d, static_cast<int64_t>(tds.size()));
  std::optional<at::Device> device = tds[0].device();
  for (const auto& td : tds) {
    if (td.device() != device) device = std::nullopt;
  }
  TensorDict out = TensorDictImpl::make(bs, device);
  for (const auto& [key, v0] : tds[0].entries()) {
    std::vector<Value> parts;
    for (const auto& td : tds) parts.push_back(*td.find(key));
    if (v0.is_unbatched()) {
      TensorDictImpl::of(out).put(key, v0);  // tensordict 0's, as stack() keeps it
    } else if (v0.is_tensor()) {
      std::vector<at::Tensor> tensors;
      for (const auto& p : parts) tensors.push_back(p.tensor());
      TensorDictImpl::of(out).put(key, at::stack(tensors, d));
    } else if (v0.is_non_tensor()) {
      std::vector<NonTensorData> entries;
      for (const auto& p : parts) entries.push_back(p.non_tensor());
      TensorDictImpl::of(out).put(key, detail::stack_non_tensors(std::move(entries), d));
    } else {
      std::vector<TensorDict> levels;
      for (const auto& p : parts) levels.push_back(p.tensordict());
      TensorDictImpl::of(out).put(key, maybe_dense_stack(levels, d));
    }
  }
  return out;
}

namespace detail {

std::vector<TensorDict> members_of(const TensorDict& td) {
  std::vector<TensorDict> out;
  out.reserve(td.entries().size());
  for (const auto& [key, value] : td.entries()) out.push_back(value.tensordict());
  return out;
}

namespace lazy {

namespace {

// Members shared by several stacks (stack([td, td]), stacks of stacks that share members) are
// asked once per outermost query: the answers are kept, by level and key, until it returns.
// Without this, a chain of n stacks of two shared members costs 2^n (repr of 60 such levels
// would never end).
struct QueryCache {
  std::unordered_map<const TensorDictImpl*, std::vector<std::string>> keys;
  std::map<std::pair<const TensorDictImpl*, std::string>, bool> contains;
};
thread_local QueryCache* t_cache = nullptr;

// Installs a cache for the outermost query on this thread; nested queries use it.
class CacheScope {
 public:
  CacheScope() {
    if (t_cache == nullptr) t_cache = &own_.emplace();
  }
  ~CacheScope() {
    if (own_) t_cache = nullptr;
  }
  CacheScope(const CacheScope&) = delete;
  CacheScope& operator=(const CacheScope&) = delete;

 private:
  std::optional<QueryCache> own_;
};

std::vector<std::string> direct_keys(const TensorDict& td) {
  if (td.is_lazy_stack()) return common_keys(td);
  std::vector<std::string> keys;
  keys.reserve(td.entries().size());
  for (const auto& e : td.entries()) keys.push_back(e.first);
  return keys;
}

}  // namespace

std::vector<std::string> common_keys(const TensorDict& td) {
  const CacheScope scope;
  const TensorDictImpl* self = &TensorDictImpl::of(td);
  if (auto it = t_cache->keys.find(self); it != t_cache->keys.end()) return it->second;
  const auto members = members_of(td);
  std::vector<std::string> out;
  for (auto& key : direct_keys(members.front())) {
    bool everywhere = true;
    for (size_t i = 1; i < members.size() && everywhere; ++i) everywhere = members[i].contains(key);
    if (everywhere) out.push_back(std::move(key));
  }
  t_cache->keys.emplace(self, out);
  return out;
}

bool contains(const TensorDict& td, const NestedKey& key) {
  const CacheScope scope;
  auto at = std::make_pair(&TensorDictImpl::of(td), key.str());
  if (auto it = t_cache->contains.find(at); it != t_cache->contains.end()) return it->second;
  bool all = true;
  for (const auto& m : members_of(td)) {
    if (!m.contains(key)) {
      all = false;
      break;
    }
  }
  t_cache->contains.emplace(std::move(at), all);
  return all;
}

std::optional<Value> find(const TensorDict& td, const NestedKey& key) {
  if (!contains(td, key)) return std::nullopt;
  return get(td, key);
}

Value get(const TensorDict& td, const NestedKey& key) {
  const auto& impl = TensorDictImpl::of(td);
  const int64_t d = impl.lazy->stack_dim;
  const std::vector<Value> parts = parts_at(td, key.front());
  const Value& first = parts.front();
  if (key.size() > 1) {
    TD_CHECK_KEY(first.is_tensordict(), "cannot reach key ", key.str(), ": ",
                 quote_key(key.front()), " is ", kind_name(first), ", not a TensorDict");
    return stack_levels(td, key.front(), parts).get(tail(key));
  }
  if (first.is_tensordict()) return stack_levels(td, key.front(), parts);
  if (first.is_non_tensor()) {
    // The members' entries stacked, as the reference's lazy stack reads them.
    std::vector<NonTensorData> entries;
    entries.reserve(parts.size());
    for (const auto& p : parts) {
      TORCH_CHECK_TYPE(p.is_non_tensor(), "key ", quote_key(key.front()),
                       " holds a non-tensor entry in member 0 but ", kind_name(p),
                       " in another member");
      entries.push_back(p.non_tensor());
    }
    return detail::stack_non_tensors(std::move(entries), d);
  }
  if (first.is_unbatched()) return first;  // member 0's, as the reference reads it
  std::vector<at::Tensor> tensors;
  tensors.reserve(parts.size());
  for (const auto& p : parts) {
    TORCH_CHECK(p.tensor().sizes() == first.tensor().sizes(),
                "Failed to stack tensors within a tensordict under the key ",
                quote_key(key.front()), ": their shapes are ", shapes_list(parts),
                ". Read each member's value from tensordicts() instead.");
    tensors.push_back(p.tensor());
  }
  return at::stack(tensors, d);
}

void set(const TensorDict& td, const NestedKey& key, const Value& value) {
  auto& impl = TensorDictImpl::of(td);
  TORCH_CHECK(!impl.locked, detail::kLockedMessage);
  const auto parts = split_value(td, key, value);
  const auto members = members_of(td);
  for (const auto& m : members) check_writable(m, key);
  impl.consolidated.reset();
  for (size_t i = 0; i < members.size(); ++i) TensorDict(members[i]).set(key, parts[i]);
}

void set_(const TensorDict& td, const NestedKey& key, const at::Tensor& tensor) {
  const auto members = members_of(td);
  const int64_t d = stack_dim_of(td);
  std::vector<Value> current;
  for (const auto& m : members) {
    current.push_back(m.get(key));
    TORCH_CHECK_TYPE(current.back().is_tensor(), "set_: key ", key.str(), " holds ",
                     kind_name(current.back()), "; set_ writes into an existing tensor");
  }
  if (tensor.dim() == 0) {  // a scalar fills every member's leaf, whatever its shape
    for (const auto& c : current) at::Tensor(c.tensor()).copy_(tensor);
    return;
  }
  const auto shape0 = current.front().tensor().sizes();
  for (const auto& c : current) {
    TORCH_CHECK_VALUE(c.tensor().sizes() == shape0, "set_: key ", key.str(),
                      " has different shapes in the members of the lazy stack: ",
                      shapes_list(current), "; write each member's value instead");
  }
  const auto stacked = with_dim(shape0, d, static_cast<int64_t>(members.size()));
  TORCH_CHECK_VALUE(at::is_expandable_to(tensor.sizes(), stacked), "set_: key ", key.str(),
                    " has shape ", at::IntArrayRef(stacked), " but the new value has shape ",
                    tensor.sizes());
  const auto parts = tensor.expand(stacked).unbind(d);
  for (size_t i = 0; i < members.size(); ++i) at::Tensor(current[i].tensor()).copy_(parts[i]);
}

void set_non_tensor(const TensorDict& td, const NestedKey& key, const JsonValue& data) {
  auto& impl = TensorDictImpl::of(td);
  TORCH_CHECK(!impl.locked, detail::kLockedMessage);
  const auto members = members_of(td);
  for (const auto& m : members) check_writable(m, key);
  impl.consolidated.reset();
  for (const auto& m : members) TensorDict(m).set_non_tensor(key, data);
}

Value pop(const TensorDict& td, const NestedKey& key) {
  auto& impl = TensorDictImpl::of(td);
  const Value out = get(td, key);  // every member has it
  TORCH_CHECK(!impl.locked, detail::kLockedMessage);
  const auto members = members_of(td);
  for (const auto& m : members) check_writable(m, key);
  impl.consolidated.reset();
  for (const auto& m : members) TensorDict(m).pop(key);
  return out;
}

TensorDict index(const TensorDict& td, at::ArrayRef<at::indexing::TensorIndex> indices) {
  using at::indexing::TensorIndex;
  const auto members = members_of(td);
  const int64_t d = stack_dim_of(td);
  const int64_t n = static_cast<int64_t>(members.size());
  const int64_t bd = td.batch_dims();
  // Ellipsis expanded over the batch dims, as TensorDict::index does.
  int64_t consumed = 0;
  bool ellipsis = false;
  for (const auto& i : indices) {
    if (i.is_ellipsis()) {
      TORCH_CHECK_VALUE(!ellipsis, "an index can only have a single ellipsis ('...')");
      ellipsis = true;
    } else if (i.is_tensor()) {
      // A boolean mask over several dims, or a second index tensor, mixes the stack dim
      // with others: the dense stack answers it.
      if (i.tensor().dim() != 1) return dense(td).index(indices);
      ++consumed;
    } else if (i.is_integer() || i.is_slice()) {
      ++consumed;
    }
  }
  TORCH_CHECK_INDEX(consumed <= bd, "too many indices for a TensorDict with ", bd,
                    " batch dims: ", consumed, " were indexed");
  std::vector<TensorIndex> before, after;
  std::optional<TensorIndex> at_stack;
  int64_t dim = 0, out_dims = 0, tensors = 0;
  for (const auto& i : indices) {
    std::vector<TensorIndex> expanded;
    if (i.is_ellipsis()) {
      for (int64_t k = 0; k < bd - consumed; ++k) expanded.emplace_back(at::indexing::Slice());
    } else {
      expanded.push_back(i);
    }
    for (auto& e : expanded) {
      tensors += e.is_tensor();
      if (e.is_none() || (!e.is_integer() && !e.is_slice() && !e.is_tensor())) {
        // None adds a dim; True/False as an index act like it, and consume no batch dim.
        (at_stack ? after : before).push_back(e);
        if (!at_stack) ++out_dims;
        continue;
      }
      if (dim == d) {
        at_stack = e;
      } else {
        (at_stack ? after : before).push_back(e);
        if (!at_stack && !e.is_integer()) ++out_dims;
      }
      ++dim;
    }
  }
  if (tensors > 1) return dense(td).index(indices);
  const auto member_index = [&](const TensorDict& m) {
    if (before.empty() && after.empty()) return m;
    std::vector<TensorIndex> idx = before;
    idx.insert(idx.end(), after.begin(), after.end());
    return m.index(idx);
  };
  std::vector<int64_t> chosen;
  if (!at_stack || at_stack->is_slice()) {
    const auto s = at_stack ? at_stack->slice() : at::indexing::Slice();
    const int64_t step = s.step().expect_int();
    TORCH_CHECK_VALUE(step > 0, "slice step must be positive");
    int64_t start = s.start().expect_int(), stop = s.stop().expect_int();
    start = start < 0 ? std::max<int64_t>(start + n, 0) : std::min(start, n);
    stop = stop < 0 ? std::max<int64_t>(stop + n, 0) : std::min(stop, n);
    for (int64_t k = start; k < stop; k += step) chosen.push_back(k);
  } else if (at_stack->is_integer()) {
    int64_t k = at_stack->integer().expect_int();
    TORCH_CHECK_INDEX(k >= -n && k < n, "index ", k, " is out of bounds for dimension ", d,
                      " with size ", n);
    return member_index(members[k < 0 ? k + n : k]);
  } else {
    at::Tensor t = at_stack->tensor();
    if (t.scalar_type() == at::kBool) {
      TORCH_CHECK_INDEX(t.numel() == n, "the boolean mask of size ", t.numel(),
                        " does not match the stack dim of size ", n);
      t = t.nonzero().flatten();
    }
    TORCH_CHECK_INDEX(at::isIntegralType(t.scalar_type(), false),
                      "tensors used as indices must "
                      "be long, int, byte or bool tensors");
    t = t.to(at::kCPU, at::kLong);
    for (int64_t k :
         std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel())) {
      TORCH_CHECK_INDEX(k >= -n && k < n, "index ", k, " is out of bounds for dimension ", d,
                        " with size ", n);
      chosen.push_back(k < 0 ? k + n : k);
    }
  }
  TORCH_CHECK_INDEX(!chosen.empty(),
                    "indexing the stack dim of a LazyStackedTensorDict selected "
                    "no member; a lazy stack needs at least one");
  std::vector<TensorDict> picked;
  picked.reserve(chosen.size());
  for (int64_t k : chosen) picked.push_back(member_index(members[k]));
  return TensorDictImpl::make_lazy(std::move(picked), out_dims,
                                   TensorDictImpl::of(td).lazy->stack_dim_name);
}

std::vector<TensorDict> unbind(const TensorDict& td, int64_t dim) {
  const int64_t d = stack_dim_of(td);
  const int64_t u = c10::maybe_wrap_dim(dim, td.batch_dims());
  if (u == d) return members_of(td);
  const int64_t member_dim = u < d ? u : u - 1;
  const int64_t new_stack = u < d ? d - 1 : d;
  std::vector<std::vector<TensorDict>> pieces;  // pieces[j]: every member's j-th slice
  for (const auto& m : members_of(td)) {
    auto parts = m.unbind(member_dim);
    pieces.resize(parts.size());
    for (size_t j = 0; j < parts.size(); ++j) pieces[j].push_back(std::move(parts[j]));
  }
  std::vector<TensorDict> out;
  out.reserve(pieces.size());
  for (auto& p : pieces) {
    out.push_back(TensorDictImpl::make_lazy(std::move(p), new_stack,
                                            TensorDictImpl::of(td).lazy->stack_dim_name));
  }
  return out;
}

TensorDict map_members(const TensorDict& td,
                       const std::function<TensorDict(const TensorDict&)>& fn) {
  std::vector<TensorDict> out;
  for (const auto& m : members_of(td)) out.push_back(fn(m));
  const auto& lazy = *TensorDictImpl::of(td).lazy;
  return TensorDictImpl::make_lazy(std::move(out), lazy.stack_dim, lazy.stack_dim_name);
}

TensorDict dense(const TensorDict& td) {
  TensorDict out = TensorDictImpl::make(td.batch_size().vec(), td.device());
  for (const auto& key : common_keys(td)) {
    Value v = get(td, key);
    if (v.is_tensordict()) v = v.tensordict().is_lazy_stack() ? dense(v.tensordict()) : v;
    TensorDictImpl::of(out).put(key, std::move(v));
  }
  return out;
}

}  // namespace lazy
}  // namespace detail
}  // namespace tensordict

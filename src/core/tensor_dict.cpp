#include "tensordict/tensor_dict.h"

#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <limits>
#include <unordered_set>

#include "tensor_dict_impl.h"

namespace tensordict {

using detail::kLockedMessage;
using detail::TensorDictImpl;

namespace detail {

std::atomic<uint64_t> watched_changes{0};

void check_batch_prefix(const NestedKey& key, at::IntArrayRef shape, at::IntArrayRef batch_size) {
  const bool ok = shape.size() >= batch_size.size() &&
                  std::equal(batch_size.begin(), batch_size.end(), shape.begin());
  TD_CHECK_BATCH(ok, "batch size mismatch: key ", key.str(), " has shape ", shape,
                 ", which does not start with ", batch_size);
}

const char* kind_name(const Value& v) {
  return v.is_tensor() ? "a tensor" : v.is_tensordict() ? "a TensorDict" : "a non-tensor entry";
}

}  // namespace detail

namespace {

std::string key_list(const TensorDictImpl& impl) {
  std::vector<std::string> keys;
  keys.reserve(impl.entries.size());
  for (const auto& e : impl.entries) keys.push_back(e.first);
  std::sort(keys.begin(), keys.end());
  std::string out = "[";
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", " : "") + quote_key(keys[i]);
  return out + "]";
}

// Whether `level` is `td` or one of its nested levels (lazy stacks' members included). Before
// an insertion the levels form no cycle, so the walk ends; `seen` makes it linear in the
// distinct levels when a level is shared (else a chain of stacks of one shared member costs
// 2^depth).
bool contains_level(const TensorDict& td, const TensorDictImpl* level,
                    std::unordered_set<const TensorDictImpl*>& seen) {
  const TensorDictImpl* self = &TensorDictImpl::of(td);
  if (self == level) return true;
  if (!seen.insert(self).second) return false;
  if (td.is_lazy_stack()) {
    for (const auto& m : detail::members_of(td)) {
      if (contains_level(m, level, seen)) return true;
    }
    return false;
  }
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensordict() && contains_level(value.tensordict(), level, seen)) return true;
  }
  return false;
}

// Brings a value into a level: checks the batch prefix and moves it to the level's device, as
// the reference does on set. A TensorDict that holds the level (directly or through any chain)
// is refused, so that no walk over the levels can loop.
Value admit(const TensorDictImpl& level, const NestedKey& full_key, const Value& value) {
  TORCH_CHECK_TYPE(!value.is_tensor() || value.tensor().defined(), "cannot set key ",
                   full_key.str(), " to an undefined tensor");
  // No fixed shape to check against the batch size (torch raises an internal error on asking).
  TORCH_CHECK_TYPE(!value.is_tensor() || !value.tensor().is_nested(), "cannot set key ",
                   full_key.str(), " to a nested (jagged) tensor: a leaf needs a fixed shape");
  if (value.is_non_tensor()) {
    // An empty batch size means "this level's", as the reference's assignment of a raw value.
    const NonTensorData& nt = value.non_tensor();
    std::vector<int64_t> bs = nt.batch_size().empty() ? level.batch_size : nt.batch_size().vec();
    detail::check_batch_prefix(full_key, bs, level.batch_size);
    if (bs.size() == nt.batch_size().size() && (!level.device || nt.device() == level.device)) {
      return value;
    }
    const NonTensorData sized =
        bs.size() == nt.batch_size().size() ? nt : nt.with_batch_size(std::move(bs));
    return level.device ? sized.with_device(level.device) : sized;
  }
  if (value.is_unbatched()) {  // no batch check, as the reference's UnbatchedTensor
    const at::Tensor& t = value.tensor();
    if (level.device && t.device() != *level.device) return Value::unbatched(t.to(*level.device));
    return value;
  }
  detail::check_batch_prefix(full_key, detail::entry_shape(value), level.batch_size);
  if (value.is_tensor()) {
    const at::Tensor& t = value.tensor();
    if (level.device && t.device() != *level.device) return t.to(*level.device);
    return value;
  }
  const TensorDict& td = value.tensordict();
  std::unordered_set<const TensorDictImpl*> seen;
  TORCH_CHECK_VALUE(!contains_level(td, &level, seen),
                    "Cannot set a tensordict inside itself (key ", full_key.str(),
                    "): tensordicts that contain themselves are not supported.");
  if (level.device && td.device() != level.device) return td.to(*level.device);
  return value;
}

// The level holding `key`'s last part, walking through nested TensorDicts. With `create`,
// missing levels are made (clearing consolidated state on the way, since the layout changes).
// `impl` is nullptr when a level is missing and `create` is false. A lazy stack on the way ends
// the walk there (`handle` is it, `depth` the parts of key that reach it): the caller hands
// the rest of the key to the lazy stack's own methods.
struct Level {
  TensorDictImpl* impl = nullptr;
  const TensorDict* handle = nullptr;
  size_t depth = 0;
  bool lazy() const { return impl != nullptr && impl->lazy.has_value(); }
};

Level walk(const TensorDict& root, const NestedKey& key, bool create, bool for_write) {
  Level at{&TensorDictImpl::of(root), &root, 0};
  for (size_t i = 0; i + 1 < key.size(); ++i) {
    if (at.lazy()) return at;
    TensorDictImpl* level = at.impl;
    if (for_write) {
      TORCH_CHECK(!level->locked, kLockedMessage);
      level->consolidated.reset();
    }
    const Value* v = level->find(key[i]);
    if (v == nullptr) {
      if (!create) return {};
      TensorDict child = TensorDictImpl::make(level->batch_size, level->device);
      level->put(key[i], child);
      v = level->find(key[i]);
    }
    if (!v->is_tensordict()) {
      TD_CHECK_KEY(!for_write && !create, "cannot reach key ", key.str(), ": ", quote_key(key[i]),
                   " is ", detail::kind_name(*v), ", not a TensorDict");
      return {};
    }
    at = {&TensorDictImpl::of(v->tensordict()), &v->tensordict(), i + 1};
  }
  return at;
}

// The parts of `key` from `from` on.
NestedKey tail(const NestedKey& key, size_t from) {
  return NestedKey(std::vector<std::string>(key.parts().begin() + static_cast<std::ptrdiff_t>(from),
                                            key.parts().end()));
}

// What leaves_only keeps: is_leaf's choice, else tensors (non-tensor entries are no leaves for
// the reference's _default_is_leaf either).
bool is_leaf(const KeysOptions& opts, const Value& value) {
  return opts.is_leaf ? opts.is_leaf(value) : value.is_tensor();
}

void collect(const TensorDict& td, const KeysOptions& opts, const std::vector<std::string>& prefix,
             bool with_values, std::vector<std::pair<NestedKey, Value>>& out) {
  if (detail::is_lazy(td)) {
    // The keys every member has; a nested level is the stack of the members' levels, and a
    // leaf's value is stacked only when values are asked for.
    // The kind of an entry is read from the first member that is no stack: asking a stack of
    // stacks would stack its leaves, 2^depth of them when members are shared.
    TensorDict probe = td;
    while (detail::is_lazy(probe)) probe = detail::members_of(probe).front();
    for (const auto& key : detail::lazy::common_keys(td)) {
      std::vector<std::string> path = prefix;
      path.push_back(key);
      const Value first = probe.get(key);
      if (!first.is_tensordict()) {
        if (!opts.leaves_only || is_leaf(opts, first)) {
          out.emplace_back(NestedKey(std::move(path)),
                           with_values ? detail::lazy::get(td, key) : first);
        }
        continue;
      }
      const Value level = detail::lazy::get(td, key);  // a lazy stack of views: no copy
      if (opts.include_nested) collect(level.tensordict(), opts, path, with_values, out);
      if (!opts.leaves_only || is_leaf(opts, level)) {
        out.emplace_back(NestedKey(std::move(path)), level);
      }
    }
    return;
  }
  for (const auto& [key, value] : td.entries()) {
    std::vector<std::string> path = prefix;
    path.push_back(key);
    // The reference yields a nested level's keys before the level itself, and enters it
    // whatever is_leaf says.
    if (value.is_tensordict() && opts.include_nested) {
      collect(value.tensordict(), opts, path, with_values, out);
    }
    if (!opts.leaves_only || is_leaf(opts, value)) {
      out.emplace_back(NestedKey(std::move(path)), value);
    }
  }
}

}  // namespace

// ---- Value ---------------------------------------------------------------------------------

const at::Tensor& Value::tensor() const {
  TORCH_CHECK_TYPE(is_tensor(), "expected a tensor entry, got ", detail::kind_name(*this));
  return std::get<0>(v_);
}

const TensorDict& Value::tensordict() const {
  TORCH_CHECK_TYPE(is_tensordict(), "expected a TensorDict entry, got ", detail::kind_name(*this));
  return std::get<1>(v_);
}

const NonTensorData& Value::non_tensor() const {
  TORCH_CHECK_TYPE(is_non_tensor(), "expected a non-tensor entry, got ", detail::kind_name(*this));
  return std::get<2>(v_);
}

// ---- construction and shape ------------------------------------------------------------------

TensorDict::TensorDict() : TensorDict(std::make_shared<TensorDictImpl>()) {}

namespace {

// No negative dimension, and a number of elements int64 holds (torch refuses such a tensor
// too), so that numel() and every shape computation stay exact.
void check_batch_size(at::IntArrayRef batch_size) {
  for (int64_t d : batch_size) {
    TORCH_CHECK_VALUE(d >= 0, "batch_size ", batch_size, " has a negative dimension");
  }
  uint64_t numel = 0;
  TORCH_CHECK_VALUE(!c10::safe_multiplies_u64(batch_size, &numel) &&
                        numel <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                    "batch_size ", batch_size, " has more elements than int64 can count");
}

std::shared_ptr<TensorDictImpl> empty_impl(at::IntArrayRef batch_size,
                                           std::optional<at::Device> device, size_t entries) {
  check_batch_size(batch_size);
  auto impl = std::make_shared<TensorDictImpl>();
  impl->batch_size = batch_size.vec();
  impl->device = device;
  impl->entries.reserve(entries);
  return impl;
}

}  // namespace

TensorDict::TensorDict(FlatEntries, std::vector<Entry> entries, at::IntArrayRef batch_size,
                       std::optional<at::Device> device)
    : TensorDict(empty_impl(batch_size, device, entries.size())) {
  for (auto& [key, value] : entries) impl_->put(key, admit(*impl_, NestedKey(key), value));
}

TensorDict::TensorDict(std::vector<std::pair<NestedKey, Value>> entries, at::IntArrayRef batch_size,
                       std::optional<at::Device> device)
    : TensorDict(empty_impl(batch_size, device, entries.size())) {
  for (auto& [key, value] : entries) set(key, value);
}

at::IntArrayRef TensorDict::batch_size() const { return impl_->batch_size; }

TensorDict& TensorDict::set_batch_size(at::IntArrayRef batch_size) {
  TORCH_CHECK(!impl_->lazy,
              "set_batch_size: the batch size of a LazyStackedTensorDict is its "
              "members' with the stack dim; modifying it is not permitted (call contiguous() for "
              "a dense TensorDict first)");
  check_batch_size(batch_size);
  for (const auto& [key, value] : impl_->entries) {
    if (value.is_unbatched()) continue;
    detail::check_batch_prefix(NestedKey(key), detail::entry_shape(value), batch_size);
  }
  impl_->batch_size = batch_size.vec();
  return *this;
}

int64_t TensorDict::batch_dims() const { return static_cast<int64_t>(impl_->batch_size.size()); }

int64_t TensorDict::numel() const { return c10::multiply_integers(impl_->batch_size); }

std::optional<at::Device> TensorDict::device() const { return impl_->device; }

// ---- entries -----------------------------------------------------------------------------------

const Value* TensorDict::find(std::string_view key) const {
  return impl_->lazy ? nullptr : impl_->find(key);
}

bool TensorDict::contains(const NestedKey& key) const {
  const Level level = walk(*this, key, false, false);
  if (level.lazy()) return detail::lazy::contains(*level.handle, tail(key, level.depth));
  return level.impl != nullptr && level.impl->find(key.back()) != nullptr;
}

Value TensorDict::get(const NestedKey& key) const {
  const TensorDictImpl* level = impl_.get();
  const TensorDict* handle = this;
  for (size_t i = 0; i < key.size(); ++i) {
    if (level->lazy) return detail::lazy::get(*handle, tail(key, i));
    const Value* v = level->find(key[i]);
    TD_CHECK_KEY(v != nullptr, "key ", key.str(), " not found in TensorDict with keys ",
                 key_list(*level));
    if (i + 1 == key.size()) return *v;
    TD_CHECK_KEY(v->is_tensordict(), "key ", key.str(), " not found: ", quote_key(key[i]), " is ",
                 detail::kind_name(*v), ", not a TensorDict");
    handle = &v->tensordict();
    level = &TensorDictImpl::of(*handle);
  }
  TORCH_INTERNAL_ASSERT(false);
}

Value TensorDict::get(const NestedKey& key, const Value& default_value) const {
  const Level level = walk(*this, key, false, false);
  if (level.lazy()) {
    auto v = detail::lazy::find(*level.handle, tail(key, level.depth));
    return v ? *v : default_value;
  }
  const Value* v = level.impl ? level.impl->find(key.back()) : nullptr;
  return v ? *v : default_value;
}

TensorDict& TensorDict::set(const NestedKey& key, const Value& value) {
  const Level at = walk(*this, key, true, true);
  if (at.lazy()) {
    detail::lazy::set(*at.handle, tail(key, at.depth), value);
    return *this;
  }
  TensorDictImpl* level = at.impl;
  TORCH_CHECK(!level->locked, kLockedMessage);
  Value admitted = admit(*level, key, value);
  level->consolidated.reset();
  level->put(key.back(), std::move(admitted));
  return *this;
}

TensorDict& TensorDict::set_non_tensor(const NestedKey& key, JsonValue data) {
  const Level at = walk(*this, key, true, true);
  if (at.lazy()) {
    detail::lazy::set_non_tensor(*at.handle, tail(key, at.depth), data);
    return *this;
  }
  TensorDictImpl* level = at.impl;
  TORCH_CHECK(!level->locked, kLockedMessage);
  level->consolidated.reset();
  level->put(key.back(), NonTensorData(std::move(data), level->batch_size, level->device));
  return *this;
}

TensorDict& TensorDict::set_non_tensor(const NestedKey& key, NonTensorData entry) {
  return set(key, Value(std::move(entry)));
}

JsonValue TensorDict::get_non_tensor(const NestedKey& key) const {
  const Level at = walk(*this, key, false, false);
  const auto data = [&](const Value& v) {
    TORCH_CHECK_TYPE(v.is_non_tensor(), "get_non_tensor: key ", key.str(), " holds ",
                     detail::kind_name(v), ", not a non-tensor entry");
    const NonTensorData& nt = v.non_tensor();
    return nt.is_stack() ? nt.tolist() : nt.data();
  };
  if (at.lazy()) return data(detail::lazy::get(*at.handle, tail(key, at.depth)));
  const TensorDictImpl* level = at.impl;
  const Value* v = level ? level->find(key.back()) : nullptr;
  TD_CHECK_KEY(v != nullptr, "key ", key.str(), " not found in TensorDict with keys ",
               key_list(level ? *level : *impl_));
  return data(*v);
}

TensorDict& TensorDict::set_(const NestedKey& key, const at::Tensor& tensor) {
  const Level at = walk(*this, key, false, false);
  if (at.lazy()) {
    detail::lazy::set_(*at.handle, tail(key, at.depth), tensor);
    return *this;
  }
  const Value current = get(key);
  TORCH_CHECK_TYPE(current.is_tensor(), "set_: key ", key.str(), " holds ",
                   detail::kind_name(current), "; set_ writes into an existing tensor");
  const at::Tensor& dst = current.tensor();
  TORCH_CHECK_VALUE(
      tensor.sizes() == dst.sizes() || at::is_expandable_to(tensor.sizes(), dst.sizes()),
      "set_: key ", key.str(), " has shape ", dst.sizes(), " but the new value has shape ",
      tensor.sizes());
  dst.copy_(tensor);
  return *this;
}

TensorDict& TensorDict::erase(const NestedKey& key) {
  pop(key);
  return *this;
}

Value TensorDict::pop(const NestedKey& key) {
  const Level at = walk(*this, key, false, true);
  if (at.lazy()) return detail::lazy::pop(*at.handle, tail(key, at.depth));
  TensorDictImpl* level = at.impl;
  TD_CHECK_KEY(level != nullptr && level->find(key.back()) != nullptr, "key ", key.str(),
               " not found in TensorDict with keys ", key_list(level ? *level : *impl_));
  TORCH_CHECK(!level->locked, kLockedMessage);
  const size_t pos = level->position(key.back());
  Value out = level->entries[pos].second;
  level->erase_at(pos);
  level->consolidated.reset();
  return out;
}

const std::vector<TensorDict::Entry>& TensorDict::entries() const { return impl_->entries; }

bool TensorDict::is_lazy_stack() const { return impl_->lazy.has_value(); }

std::vector<std::pair<NestedKey, Value>> TensorDict::items(KeysOptions options) const {
  std::vector<std::pair<NestedKey, Value>> out;
  collect(*this, options, {}, /*with_values=*/true, out);
  return out;
}

std::vector<NestedKey> TensorDict::keys(KeysOptions options) const {
  std::vector<std::pair<NestedKey, Value>> items;
  collect(*this, options, {}, /*with_values=*/false, items);
  std::vector<NestedKey> out;
  out.reserve(items.size());
  for (auto& [k, v] : items) out.push_back(std::move(k));
  return out;
}

std::vector<Value> TensorDict::values(KeysOptions options) const {
  std::vector<Value> out;
  for (auto& [k, v] : items(options)) out.push_back(std::move(v));
  return out;
}

std::vector<std::string> TensorDict::sorted_keys() const {
  if (impl_->lazy) {
    auto keys = detail::lazy::common_keys(*this);
    std::sort(keys.begin(), keys.end());
    return keys;
  }
  // Sorting views moves 16 bytes a swap instead of a string. Bytes compare as UTF-8 code
  // points do, which is Python's order.
  std::vector<std::string_view> order;
  order.reserve(impl_->entries.size());
  for (const auto& e : impl_->entries) order.emplace_back(e.first);
  std::sort(order.begin(), order.end());
  return {order.begin(), order.end()};
}

bool TensorDict::is_empty() const {
  // A lazy stack's entries are its members: empty when every member is.
  for (const auto& [key, value] : impl_->entries) {
    // A non-tensor entry counts, as in the reference's TensorDict.is_empty.
    if (!value.is_tensordict() || !value.tensordict().is_empty()) return false;
  }
  return true;
}

// ---- locking ---------------------------------------------------------------------------------

bool TensorDict::is_locked() const { return impl_->locked; }

TensorDict& TensorDict::lock_() {
  impl_->locked = true;
  for (auto& [key, value] : impl_->entries) {
    if (value.is_tensordict()) TensorDict(value.tensordict()).lock_();
  }
  return *this;
}

TensorDict& TensorDict::unlock_() {
  impl_->locked = false;
  for (auto& [key, value] : impl_->entries) {
    if (value.is_tensordict()) TensorDict(value.tensordict()).unlock_();
  }
  return *this;
}

// ---- consolidation state ------------------------------------------------------------------------

std::shared_ptr<const ConsolidatedState> TensorDict::consolidated_state() const {
  return impl_->consolidated;
}

void TensorDict::set_consolidated_state(const TestKey& /*key*/,
                                        std::shared_ptr<const ConsolidatedState> state) {
  impl_->consolidated = std::move(state);
  impl_->checked_generations.reset();  // a state from outside is checked on first use
}

}  // namespace tensordict

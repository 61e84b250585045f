// Structure: which entries a TensorDict holds, under which keys (select, exclude, update, copy).

#include <ATen/ATen.h>

#include <algorithm>

#include "tensor_dict_impl.h"

namespace tensordict {

using detail::map_leaves;
using detail::NonTensors;
using detail::TensorDictImpl;

namespace {

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

}  // namespace

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
    for (size_t at = key.find(separator); at != std::string::npos;
         at = key.find(separator, start)) {
      parts.push_back(key.substr(start, at - start));
      start = at + separator.size();
    }
    parts.push_back(key.substr(start));
    // A leaf where another key needs a level, or the reverse, would be overwritten: the
    // reference's KeyError (naming the deeper key) instead of losing either.
    const auto clash = [&](const std::vector<std::string>& deeper) {
      TD_CHECK_KEY(false,
                   "Unflattening key(s) in tensordict will override an existing for "
                   "unflattened key ",
                   NestedKey(deeper).str(), ".");
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

TensorDict& TensorDict::update(const TensorDict& other, UpdateOptions options) {
  std::vector<Entry> stacked;  // a lazy stack's direct entries are read (stacked) first
  if (other.is_lazy_stack()) {
    for (const auto& key : detail::lazy::common_keys(other)) {
      stacked.emplace_back(key, detail::lazy::get(other, key));
    }
  }
  for (const auto& [key, value] : other.is_lazy_stack() ? stacked : other.entries()) {
    const Value mine = get(key, at::Tensor());
    const bool have = !mine.is_tensor() || mine.tensor().defined();
    if (value.is_non_tensor()) {
      // An equal entry is left alone: no write, so a locked or consolidated TensorDict stays so.
      const bool same = have && mine.is_non_tensor() && mine.non_tensor() == value.non_tensor();
      if (!same) set(key, value);
    } else if (value.is_tensordict()) {
      if (have && mine.is_tensordict()) {
        TensorDict(mine.tensordict()).update(value.tensordict(), options);
      } else {
        set(key, options.clone ? value.tensordict().clone() : value.tensordict());
      }
    } else if (options.inplace && have && mine.is_tensor()) {
      set_(key, value.tensor());
    } else {
      set(key, detail::same_kind(value, options.clone ? value.tensor().clone() : value.tensor()));
    }
  }
  return *this;
}

TensorDict& TensorDict::update_(const TensorDict& other,
                                const std::vector<NestedKey>& keys_to_update) {
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

}  // namespace tensordict

#pragma once
// An insertion-ordered object type for nlohmann::basic_json that finds keys through a hash
// index. nlohmann's ordered_map (ordered_json) finds them by a linear scan, once per key
// while parsing, so a peer's object of n keys cost O(n^2): 40,000 keys took 2 s, and the
// 2^20 values our limits allow, minutes. Private to the sources that parse a peer's JSON.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace tensordict::detail {

template <class Key, class T, class IgnoredLess = std::less<Key>,
          class Allocator = std::allocator<std::pair<const Key, T>>>
class IndexedOrderedMap : public nlohmann::ordered_map<Key, T, IgnoredLess, Allocator> {
  using Base = nlohmann::ordered_map<Key, T, IgnoredLess, Allocator>;

 public:
  using typename Base::const_iterator;
  using typename Base::iterator;
  using typename Base::key_type;
  using typename Base::size_type;
  using Base::Base;

  // These hide every overload of the base (the heterogeneous ones included), so all lookups
  // and insertions basic_json makes go through the index.
  std::pair<iterator, bool> emplace(const key_type& key, T&& value) {
    if (auto it = find(key); it != this->end()) return {it, false};
    Base::Container::emplace_back(key, std::move(value));
    index_.emplace(key, this->size() - 1);
    indexed_ = this->size();
    return {std::prev(this->end()), true};
  }
  T& operator[](const key_type& key) { return emplace(key, T{}).first->second; }
  T& at(const key_type& key) {
    auto it = find(key);
    if (it == this->end()) throw std::out_of_range("key not found");
    return it->second;
  }
  const T& at(const key_type& key) const {
    auto it = find(key);
    if (it == this->end()) throw std::out_of_range("key not found");
    return it->second;
  }
  iterator find(const key_type& key) {
    const size_type i = position(key);
    return i == npos ? this->end() : this->begin() + static_cast<std::ptrdiff_t>(i);
  }
  const_iterator find(const key_type& key) const {
    const size_type i = position(key);
    return i == npos ? this->end() : this->begin() + static_cast<std::ptrdiff_t>(i);
  }
  size_type count(const key_type& key) const { return position(key) == npos ? 0 : 1; }

 private:
  static constexpr size_type npos = static_cast<size_type>(-1);

  // The index is rebuilt whenever the base changed the elements behind its back (erase,
  // insert of a range, a constructor): their count no longer matches, or a hit is stale.
  size_type position(const key_type& key) const {
    if (indexed_ != this->size()) rebuild();
    auto it = index_.find(key);
    if (it != index_.end() && it->second < this->size() &&
        (this->begin() + static_cast<std::ptrdiff_t>(it->second))->first == key) {
      return it->second;
    }
    if (it != index_.end()) {
      rebuild();
      return position(key);
    }
    return npos;
  }
  void rebuild() const {
    index_.clear();
    size_type i = 0;
    for (const auto& entry : *this) index_.emplace(entry.first, i++);
    indexed_ = this->size();
  }

  mutable std::unordered_map<Key, size_type> index_;
  mutable size_type indexed_ = 0;
};

/// JSON values whose objects keep their keys in document order, with indexed lookups.
using OrderedJson = nlohmann::basic_json<IndexedOrderedMap>;

}  // namespace tensordict::detail

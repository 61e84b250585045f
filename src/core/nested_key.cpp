#include "tensordict/nested_key.h"

#include <c10/util/Exception.h>

namespace tensordict {

NestedKey::NestedKey(const char* key) : NestedKey(std::string(key)) {}
NestedKey::NestedKey(std::string key) { parts_.push_back(std::move(key)); }
NestedKey::NestedKey(std::string_view key) { parts_.emplace_back(key); }
NestedKey::NestedKey(std::initializer_list<std::string> parts)
    : NestedKey(std::vector<std::string>(parts)) {}
NestedKey::NestedKey(std::vector<std::string> parts) : parts_(std::move(parts)) {
  TORCH_CHECK_VALUE(!parts_.empty(), "a nested key needs at least one part, got ()");
}

NestedKey NestedKey::parent() const {
  TORCH_CHECK_VALUE(parts_.size() > 1, "key ", str(), " has no parent level");
  return NestedKey(std::vector<std::string>(parts_.begin(), parts_.end() - 1), true);
}

NestedKey NestedKey::join(const NestedKey& child) const {
  std::vector<std::string> parts = parts_;
  parts.insert(parts.end(), child.parts_.begin(), child.parts_.end());
  return NestedKey(std::move(parts), true);
}

std::string quote_key(std::string_view key) {
  const bool has_single = key.find('\'') != std::string_view::npos;
  const bool has_double = key.find('"') != std::string_view::npos;
  const char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  for (char c : key) {
    if (c == q || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    if (c == '\t') {
      out += "\\t";
      continue;
    }
    if (c == '\r') {
      out += "\\r";
      continue;
    }
    out += c;
  }
  out += q;
  return out;
}

std::string NestedKey::str() const {
  if (parts_.size() == 1) return quote_key(parts_[0]);
  std::string out = "(";
  for (size_t i = 0; i < parts_.size(); ++i) {
    if (i) out += ", ";
    out += quote_key(parts_[i]);
  }
  return out + ")";
}

}  // namespace tensordict

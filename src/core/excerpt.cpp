// Bounded quotes of a peer's text in messages (core/excerpt.h).

#include "core/excerpt.h"

#include <unordered_map>

#include "core/json_text.h"
#include "tensordict/nested_key.h"

namespace tensordict::core {
namespace {

// The largest cut <= max bytes of `s` from `from` that ends between two UTF-8 sequences (a
// continuation byte never starts the rest).
size_t utf8_cut(std::string_view s, size_t from, size_t max) {
  size_t end = from + max;
  if (end >= s.size()) return s.size();
  for (int back = 0; back < 3 && end > from && (static_cast<unsigned char>(s[end]) & 0xc0) == 0x80;
       ++back) {
    --end;
  }
  return end;
}

std::string length_suffix(size_t n) { return "...(" + std::to_string(n) + " bytes)"; }

// json.dumps' text of a value: its first kExcerptBytes kept, all of it counted.
class JsonExcerpt {
 public:
  std::string text(const JsonValue& v) {
    const size_t n = write(v);
    return n <= kExcerptBytes ? out_ : out_ + length_suffix(n);
  }

 private:
  bool full() const { return out_.size() >= kExcerptBytes; }
  void put(std::string_view s) {
    if (!full()) out_.append(s.substr(0, kExcerptBytes - out_.size()));  // ASCII: cut anywhere
  }
  // The string's JSON literal, escaped a chunk at a time (json.dumps writes ASCII only).
  size_t string(std::string_view s) {
    size_t n = 2;
    put("\"");
    std::string chunk;
    for (size_t i = 0; i < s.size();) {
      const size_t end = utf8_cut(s, i, size_t{1} << 16);
      chunk.clear();
      append_json_string(chunk, s.substr(i, end - i));
      n += chunk.size() - 2;
      put(std::string_view(chunk).substr(1, chunk.size() - 2));
      i = end;
    }
    put("\"");
    return n;
  }
  size_t write(const JsonValue& v) {
    const void* node = v.node();
    if (node != nullptr && full()) {
      if (const auto it = sizes_.find(node); it != sizes_.end()) return it->second;
    }
    size_t n = 0;
    if (v.is_string()) {
      n = string(v.as_string());
    } else if (v.is_list() || v.is_map()) {
      put(v.is_list() ? "[" : "{");
      n = 2;
      const auto item = [&](bool first) {
        if (!first) put(", ");
        n += first ? 0 : 2;
      };
      if (v.is_list()) {
        bool first = true;
        for (const auto& e : v.as_list()) {
          item(first);
          first = false;
          n += write(e);
        }
      } else {
        bool first = true;
        for (const auto& [key, e] : v.as_map()) {
          item(first);
          first = false;
          n += string(key) + 2;
          put(": ");
          n += write(e);
        }
      }
      put(v.is_list() ? "]" : "}");
    } else {
      std::string scalar;
      append_json(scalar, v, false);
      put(scalar);
      n = scalar.size();
    }
    if (node != nullptr) sizes_.emplace(node, n);
    return n;
  }

  std::string out_;
  std::unordered_map<const void*, size_t> sizes_;
};

}  // namespace

std::string excerpt(std::string_view text) {
  if (text.size() <= kExcerptBytes) return std::string(text);
  return std::string(text.substr(0, utf8_cut(text, 0, kExcerptBytes))) + length_suffix(text.size());
}

std::string quoted_excerpt(std::string_view text) { return quote_key(excerpt(text)); }

std::string key_path_excerpt(const std::vector<std::string>& path) {
  if (path.size() == 1) return quoted_excerpt(path[0]);
  std::string out = "(";
  for (size_t i = 0; i < path.size(); ++i) {
    if (i) out += ", ";
    out += quoted_excerpt(path[i]);
  }
  return out + ")";
}

std::string key_path_excerpt(const std::vector<std::string>& path, std::string_view key) {
  if (path.empty()) return quoted_excerpt(key);
  std::string out = key_path_excerpt(path);
  if (path.size() == 1) out = "(" + out + ")";
  out.insert(out.size() - 1, ", " + quoted_excerpt(key));
  return out;
}

std::string json_excerpt(const JsonValue& value) { return JsonExcerpt().text(value); }

}  // namespace tensordict::core

// JSON text as Python's json module writes and reads it (core/json_text.h).

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "core/excerpt.h"
#include "core/json_text.h"
#include "tensordict/errors.h"

namespace tensordict {
namespace core {
namespace {

// JSON's short escapes: the character after the backslash, and the one it stands for. Reading
// takes all of them; writing, as Python's json.dumps, all but "\/" (a '/' is written as is).
constexpr std::pair<char, char> kShortEscapes[] = {{'"', '"'},  {'\\', '\\'}, {'/', '/'},
                                                   {'b', '\b'}, {'f', '\f'},  {'n', '\n'},
                                                   {'r', '\r'}, {'t', '\t'}};

// What `e` after a backslash stands for, or null when it is not a short escape.
const char* unescaped(char e) {
  for (const auto& p : kShortEscapes) {
    if (p.first == e) return &p.second;
  }
  return nullptr;
}

// The short escape of `c` (the character after the backslash), or null when it has none.
const char* escaped(char c) {
  for (const auto& p : kShortEscapes) {
    if (p.second == c) return &p.first;
  }
  return nullptr;
}

void append_u_escape(std::string& out, uint32_t unit) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += "\\u";
  for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(unit >> shift) & 0xf];
}

// Decodes the UTF-8 sequence at s[i]; returns its length (0 when invalid) and the code point.
int decode_utf8(std::string_view s, size_t i, uint32_t& cp) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  const int len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
  cp = len == 4 ? c & 0x07 : len == 3 ? c & 0x0f : c & 0x1f;
  bool ok = len > 0 && c < 0xf5 && i + len <= s.size();
  for (int k = 1; ok && k < len; ++k) {
    const auto cc = static_cast<unsigned char>(s[i + k]);
    ok = (cc & 0xc0) == 0x80;
    cp = (cp << 6) | (cc & 0x3f);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  ok = ok && cp >= kMin[len] && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
  return ok ? len : 0;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

// ---- Python's repr of a str -----------------------------------------------------------------

void append_python_str_repr(std::string& out, std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out += quote;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    int len = decode_utf8(s, i, cp);
    if (len == 0) {  // not reachable for our validated strings; keep the byte visible
      cp = static_cast<unsigned char>(s[i]);
      len = 1;
    }
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad) {
      // Python escapes the characters it does not print; these are the common ones.
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[cp >> 4];
      out += kHex[cp & 15];
    } else {
      out.append(s.substr(i, static_cast<size_t>(len)));
    }
    i += static_cast<size_t>(len);
  }
  out += quote;
}

void append_python_repr(std::string& out, const JsonValue& v) {
  if (v.is_null()) {
    out += "None";
  } else if (v.is_bool()) {
    out += v.as_bool() ? "True" : "False";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    out += python_float_repr(v.as_float());
  } else if (v.is_string()) {
    append_python_str_repr(out, v.as_string());
  } else if (v.is_list()) {
    out += '[';
    bool first = true;
    for (const auto& item : v.as_list()) {
      if (!first) out += ", ";
      first = false;
      append_python_repr(out, item);
    }
    out += ']';
  } else {
    out += '{';
    bool first = true;
    for (const auto& [key, item] : v.as_map()) {
      if (!first) out += ", ";
      first = false;
      append_python_str_repr(out, key);
      out += ": ";
      append_python_repr(out, item);
    }
    out += '}';
  }
}

// ---- parser ---------------------------------------------------------------------------------

class Parser {
 public:
  // `dry`: checks and measures the text without building the values (json_bytes).
  Parser(std::string_view text, const JsonLimits& limits, const char* who, bool dry = false)
      : s_(text), limits_(limits), who_(who), dry_(dry) {}

  JsonValue run() {
    skip_ws();
    JsonValue v = value(0);
    skip_ws();
    fail_if(pos_ != s_.size(), "extra data");
    return v;
  }

  // The top-level object's members one at a time; the object itself is never built, and the
  // limits apply to each member's value on its own.
  void members(const std::function<void(std::string, JsonValue)>& each) {
    skip_ws();
    fail_if(pos_ >= s_.size() || s_[pos_] != '{', "expected an object");
    object([&](std::string key) {
      values_ = 0;
      bytes_ = 0;
      each(std::move(key), value(1));
    });
    skip_ws();
    fail_if(pos_ != s_.size(), "extra data");
  }

  size_t bytes() const { return bytes_; }

 private:
  template <typename... Args>
  void fail_if(bool cond, const Args&... args) const {
    TORCH_CHECK_VALUE(!cond, who_, ": invalid JSON: ", c10::str(args...), " at byte ", pos_, " of ",
                      s_.size());
  }
  void count() {
    ++values_;
    TORCH_CHECK_VALUE(values_ <= limits_.max_values, who_, ": more than ", limits_.max_values,
                      " JSON values");
    charge(sizeof(JsonValue));
  }
  // What the values take in memory: each value, a map entry's key beside it, and a string's
  // bytes beyond the small-string buffer.
  void charge(size_t n) {
    bytes_ += n;
    TORCH_CHECK_VALUE(bytes_ <= limits_.max_bytes, who_, ": the JSON values would take more than ",
                      limits_.max_bytes, " bytes of memory");
  }
  void charge_string(const std::string& str) {
    if (str.size() > JsonValue::kInlineString) charge(str.size() + 1 + kSharedNodeBytes);
  }
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool consume(std::string_view word) {
    if (s_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
    return false;
  }

  JsonValue value(size_t depth) {
    fail_if(pos_ >= s_.size(), "unexpected end of text");
    count();
    const char c = s_[pos_];
    switch (c) {
      case '{': return map(depth + 1);
      case '[': return list(depth + 1);
      case '"': {
        std::string str = string();
        charge_string(str);
        return dry_ ? JsonValue() : JsonValue(std::move(str));
      }
      case 'n': fail_if(!consume("null"), "expected a value"); return JsonValue();
      case 't': fail_if(!consume("true"), "expected a value"); return JsonValue(true);
      case 'f': fail_if(!consume("false"), "expected a value"); return JsonValue(false);
      case 'N':
        fail_if(!consume("NaN"), "expected a value");
        return JsonValue(std::numeric_limits<double>::quiet_NaN());
      case 'I':
        fail_if(!consume("Infinity"), "expected a value");
        return JsonValue(std::numeric_limits<double>::infinity());
      default:
        if (c == '-' && s_.substr(pos_, 9) == "-Infinity") {
          pos_ += 9;
          return JsonValue(-std::numeric_limits<double>::infinity());
        }
        return number();
    }
  }

  void enter(size_t depth) {
    TORCH_CHECK_VALUE(depth <= limits_.max_depth, who_, ": JSON nested deeper than ",
                      limits_.max_depth, " levels");
  }

  JsonValue list(size_t depth) {
    enter(depth);
    charge(kSharedNodeBytes);
    ++pos_;
    JsonValue::List items;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return JsonValue(std::move(items));
    }
    while (true) {
      skip_ws();
      if (dry_) {
        value(depth);
      } else {
        items.push_back(value(depth));
      }
      if (!another(']', "list")) return JsonValue(std::move(items));
    }
  }

  // After a list's item or an object's member: true past a ',' (another follows), false past
  // the `close` that ends it.
  bool another(char close, const char* what) {
    skip_ws();
    fail_if(pos_ >= s_.size(), "unterminated ", what);
    if (s_[pos_] == ',') {
      ++pos_;
      return true;
    }
    fail_if(s_[pos_] != close, "expected ',' or '", close, "'");
    ++pos_;
    return false;
  }

  // An object's grammar, from its '{': `member(key)` reads each member's value.
  template <typename Member>
  void object(Member&& member) {
    ++pos_;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return;
    }
    while (true) {
      skip_ws();
      fail_if(pos_ >= s_.size() || s_[pos_] != '"', "expected a key in double quotes");
      std::string key = string();
      skip_ws();
      fail_if(pos_ >= s_.size() || s_[pos_] != ':', "expected ':'");
      ++pos_;
      skip_ws();
      member(std::move(key));
      if (!another('}', "object")) return;
    }
  }

  JsonValue map(size_t depth) {
    enter(depth);
    charge(kSharedNodeBytes);
    JsonValue::Map items;
    std::unique_ptr<std::unordered_map<std::string, size_t>> index;
    object([&](std::string key) {
      charge(sizeof(JsonValue::Map::value_type) - sizeof(JsonValue));
      if (key.size() > JsonValue::kInlineString) charge(key.size() + 1);
      JsonValue v = value(depth);
      if (dry_) return;
      // json.loads builds a dict: a repeated key keeps its first position and its last value.
      size_t found = items.size();
      if (index) {
        if (auto it = index->find(key); it != index->end()) found = it->second;
      } else {
        for (size_t i = 0; i < items.size(); ++i) {
          if (items[i].first == key) found = i;
        }
      }
      if (found < items.size()) {
        items[found].second = std::move(v);
        return;
      }
      if (index) index->emplace(key, items.size());
      items.emplace_back(std::move(key), std::move(v));
      if (!index && items.size() > kScanKeys) {
        index = std::make_unique<std::unordered_map<std::string, size_t>>();
        for (size_t i = 0; i < items.size(); ++i) index->emplace(items[i].first, i);
      }
    });
    return dry_ ? JsonValue() : JsonValue(std::move(items));
  }

  uint32_t hex4() {
    fail_if(s_.size() - pos_ < 4, "truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        --pos_;
        fail_if(true, "bad \\u escape");
      }
    }
    return v;
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      // A run of plain ASCII (most keys and dtype names) is taken at once.
      size_t end = pos_;
      while (end < s_.size()) {
        const auto a = static_cast<unsigned char>(s_[end]);
        if (a < 0x20 || a >= 0x80 || a == '"' || a == '\\') break;
        ++end;
      }
      out.append(s_.data() + pos_, end - pos_);
      pos_ = end;
      fail_if(pos_ >= s_.size(), "unterminated string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c == '\\') {
        fail_if(pos_ + 1 >= s_.size(), "unterminated string");
        const char e = s_[pos_ + 1];
        pos_ += 2;
        if (const char* to = unescaped(e)) {
          out += *to;
          continue;
        }
        switch (e) {
          case 'u': {
            uint32_t cp = hex4();
            if (cp >= 0xd800 && cp <= 0xdbff && s_.substr(pos_, 2) == "\\u") {
              pos_ += 2;
              const uint32_t low = hex4();
              fail_if(low < 0xdc00 || low > 0xdfff, "unpaired surrogate in a \\u escape");
              cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
            }
            // Python would keep a lone surrogate; UTF-8 text cannot hold one.
            fail_if(cp >= 0xd800 && cp <= 0xdfff, "unpaired surrogate in a \\u escape");
            append_utf8(out, cp);
            break;
          }
          default: --pos_; fail_if(true, "invalid escape");
        }
        continue;
      }
      fail_if(c < 0x20, "control character in a string");
      uint32_t cp = 0;
      const int len = decode_utf8(s_, pos_, cp);
      fail_if(len == 0, "invalid UTF-8");
      out.append(s_.substr(pos_, static_cast<size_t>(len)));
      pos_ += static_cast<size_t>(len);
    }
  }

  JsonValue number() {
    const size_t start = pos_;
    const JsonNumber num = scan_json_number(s_.substr(pos_));
    if (num.length == 0 && s_[pos_] == '-') ++pos_;  // the error names the byte after the minus
    fail_if(num.length == 0, "expected a value");
    pos_ += num.length;
    const bool is_float = num.is_float, negative_exponent = num.negative_exponent;
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    if (!is_float) {
      int64_t v = 0;
      const auto r = std::from_chars(first, last, v);
      fail_if(r.ec != std::errc() || r.ptr != last, "the integer ",
              excerpt(std::string_view(first, static_cast<size_t>(last - first))),
              " is out of range (int64)");
      return JsonValue(v);
    }
    double d = 0;
    const auto r = std::from_chars(first, last, d);
    if (r.ec == std::errc::result_out_of_range) {
      // Python's float() gives inf on overflow and 0.0 on underflow.
      const bool negative = *first == '-';
      d = negative_exponent ? (negative ? -0.0 : 0.0)
                            : (negative ? -std::numeric_limits<double>::infinity()
                                        : std::numeric_limits<double>::infinity());
    } else {
      fail_if(r.ec != std::errc() || r.ptr != last, "bad number");
    }
    return JsonValue(d);
  }

  std::string_view s_;
  JsonLimits limits_;
  const char* who_;
  size_t pos_ = 0;
  size_t values_ = 0;
  size_t bytes_ = 0;  // what the values take (charge)
  bool dry_;
};

}  // namespace
}  // namespace core

// ---- json_text.h --------------------------------------------------------------------------------

namespace core {

bool valid_utf8(std::string_view s) {
  uint32_t cp = 0;
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {  // ASCII, the common case: no decoding
      ++i;
      continue;
    }
    const int len = decode_utf8(s, i, cp);
    if (len == 0) return false;
    i += static_cast<size_t>(len);
  }
  return true;
}

JsonNumber scan_json_number(std::string_view s) {
  const auto digit = [&](size_t i) { return i < s.size() && s[i] >= '0' && s[i] <= '9'; };
  JsonNumber n;
  size_t p = 0;
  if (p < s.size() && s[p] == '-') ++p;
  if (!digit(p)) return n;
  if (s[p] == '0') {
    ++p;
  } else {
    while (digit(p)) ++p;
  }
  if (p < s.size() && s[p] == '.' && digit(p + 1)) {
    n.is_float = true;
    ++p;
    while (digit(p)) ++p;
  }
  if (p < s.size() && (s[p] == 'e' || s[p] == 'E')) {
    size_t q = p + 1;
    const bool minus = q < s.size() && s[q] == '-';
    if (q < s.size() && (s[q] == '+' || s[q] == '-')) ++q;
    if (digit(q)) {  // "1e" or "1e+" ends before the 'e', as parse_json reads it
      n.is_float = true;
      n.negative_exponent = minus;
      p = q;
      while (digit(p)) ++p;
    }
  }
  n.length = p;
  return n;
}

void append_json_string(std::string& out, std::string_view s, const char* who) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (const char* e = c == '/' ? nullptr : escaped(static_cast<char>(c))) {
        out += '\\';
        out += *e;
      } else if (c < 0x20 || c == 0x7f) {
        append_u_escape(out, c);
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const int len = decode_utf8(s, i, cp);
    TORCH_CHECK_VALUE(len > 0, who, ": the string ", quoted_excerpt(s),
                      " is not valid UTF-8 (byte ", i, ")");
    if (cp >= 0x10000) {
      append_u_escape(out, 0xd800 + ((cp - 0x10000) >> 10));
      append_u_escape(out, 0xdc00 + ((cp - 0x10000) & 0x3ff));
    } else {
      append_u_escape(out, cp);
    }
    i += static_cast<size_t>(len);
  }
  out += '"';
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  TORCH_INTERNAL_ASSERT(r.ec == std::errc());
  // buf holds [-]d[.ddd]e[+-]xx: split it into the sign, the digits and the exponent.
  std::string_view text(buf, static_cast<size_t>(r.ptr - buf));
  std::string out;
  if (text.front() == '-') {
    out += '-';
    text.remove_prefix(1);
  }
  const size_t e = text.find('e');
  std::string digits;
  for (char c : text.substr(0, e)) {
    if (c != '.') digits += c;
  }
  int exponent = 0;
  std::from_chars(text.data() + e + 1 + (text[e + 1] == '+'), text.data() + text.size(), exponent);
  // The value is 0.DIGITS * 10^decpt; repr switches to exponent form outside (-4, 16].
  const int decpt = exponent + 1;
  const int n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (decpt >= n) {
      out += digits + std::string(static_cast<size_t>(decpt - n), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(decpt)) + "." +
             digits.substr(static_cast<size_t>(decpt));
    }
    return out;
  }
  out += digits[0];
  if (n > 1) out.append(1, '.').append(digits, 1);  // appends: `"." + substr` warns (GCC 12 -O3)
  const int shown = decpt - 1;
  out += shown < 0 ? "e-" : "e+";
  const std::string mag = std::to_string(shown < 0 ? -shown : shown);
  if (mag.size() < 2) out += '0';
  out += mag;
  return out;
}

void append_json(std::string& out, const JsonValue& v, bool sort_keys, const char* who) {
  if (v.is_null()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.as_bool() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    const double d = v.as_float();
    if (std::isnan(d)) {
      out += "NaN";
    } else if (std::isinf(d)) {
      out += d < 0 ? "-Infinity" : "Infinity";
    } else {
      out += python_float_repr(d);
    }
  } else if (v.is_string()) {
    append_json_string(out, v.as_string(), who);
  } else if (v.is_list()) {
    out += '[';
    bool first = true;
    for (const auto& item : v.as_list()) {
      if (!first) out += ", ";
      first = false;
      append_json(out, item, sort_keys, who);
    }
    out += ']';
  } else {
    const auto& map = v.as_map();
    std::vector<const std::pair<std::string, JsonValue>*> members;
    members.reserve(map.size());
    for (const auto& m : map) members.push_back(&m);
    if (sort_keys) {
      // Python sorts str keys by code point, which is UTF-8 byte order.
      std::sort(members.begin(), members.end(),
                [](const auto* a, const auto* b) { return a->first < b->first; });
    }
    out += '{';
    for (size_t i = 0; i < members.size(); ++i) {
      if (i) out += ", ";
      append_json_string(out, members[i]->first, who);
      out += ": ";
      append_json(out, members[i]->second, sort_keys, who);
    }
    out += '}';
  }
}

// ---- written out in full -----------------------------------------------------------------

JsonExpansion::JsonExpansion(size_t max_extra_bytes) : max_extra_(max_extra_bytes) {}

size_t JsonExpansion::text_bytes(const JsonValue& v) {
  const void* node = v.node();
  if (node == nullptr) return v.is_string() ? v.as_string().size() + 2 : 8;  // about its text
  if (const auto it = sizes_.find(node); it != sizes_.end()) return it->second;
  // First visit: the node's own bytes count once (held), its text each time (written).
  size_t own = 2, text = 2;
  const auto add_item = [&](const JsonValue& item, size_t extra) {
    const size_t n = text_bytes(item);
    own += extra + (item.node() == nullptr ? n : 0);  // an inline item is part of this node
    text = text > SIZE_MAX - n - extra ? SIZE_MAX : text + n + extra;
  };
  if (v.is_string()) {
    own = text = v.as_string().size() + 2;
  } else if (v.is_list()) {
    for (const auto& item : v.as_list()) add_item(item, 2);
  } else {
    for (const auto& [key, item] : v.as_map()) add_item(item, key.size() + 6);
  }
  distinct_ += own;
  sizes_.emplace(node, text);
  return text;
}

void JsonExpansion::add(const JsonValue& value, const std::function<std::string()>& what) {
  const size_t n = text_bytes(value);
  if (value.node() == nullptr) distinct_ += n;
  written_ = written_ > SIZE_MAX - n ? SIZE_MAX : written_ + n;
  TORCH_CHECK_VALUE(written_ <= distinct_ || written_ - distinct_ <= max_extra_, what(),
                    ": writing it out in full would take about ", written_,
                    " bytes, since it reuses shared values (one object referenced many times), "
                    "which is ",
                    written_ - distinct_,
                    " bytes more than the data holds; the "
                    "limit is ",
                    max_extra_, " bytes (docs/reliability.md)");
}

namespace {
size_t json_memory(const JsonValue& v, std::unordered_set<const void*>& seen) {
  size_t bytes = sizeof(JsonValue);
  if (v.node() == nullptr || !seen.insert(v.node()).second) return bytes;
  if (v.is_string()) return bytes + v.as_string().size() + 1 + kSharedNodeBytes;
  bytes += kSharedNodeBytes;
  if (v.is_list()) {
    for (const auto& item : v.as_list()) bytes += json_memory(item, seen);
  } else {
    for (const auto& [key, item] : v.as_map()) {
      bytes += sizeof(JsonValue::Map::value_type) - sizeof(JsonValue) +
               (key.size() > JsonValue::kInlineString ? key.size() + 1 : 0) +
               json_memory(item, seen);
    }
  }
  return bytes;
}
}  // namespace

size_t json_memory(const JsonValue& value) {
  std::unordered_set<const void*> seen;
  return json_memory(value, seen);
}

// ---- built from shared objects ------------------------------------------------------------

const JsonValue* SharedJsonBuilder::find(const void* id) {
  const auto it = built_.find(id);
  if (it == built_.end()) return nullptr;
  charge();
  return &it->second;
}

const JsonValue& SharedJsonBuilder::remember(const void* id, JsonValue value) {
  return built_.insert_or_assign(id, std::move(value)).first->second;
}

void SharedJsonBuilder::enter(size_t depth, const std::string& where) const {
  TORCH_CHECK_VALUE(depth <= limits_.max_depth, what_(), where.empty() ? "" : " at ", where,
                    " is nested deeper than ", limits_.max_depth, " levels");
}

void SharedJsonBuilder::charge(size_t extra) {
  const size_t n = sizeof(JsonValue) + extra;
  bytes_ = bytes_ > SIZE_MAX - n ? SIZE_MAX : bytes_ + n;
  TORCH_CHECK_VALUE(bytes_ <= limits_.max_bytes, what_(), " would take more than ",
                    limits_.max_bytes, " bytes of memory");
}

size_t SharedJsonBuilder::string_bytes(size_t n) {
  return n > JsonValue::kInlineString ? n + 1 + kSharedNodeBytes : 0;
}

size_t SharedJsonBuilder::key_bytes(size_t n) {
  return sizeof(JsonValue::Map::value_type) - sizeof(JsonValue) +
         (n > JsonValue::kInlineString ? n + 1 : 0);
}

std::string python_str(const JsonValue& value) {
  if (value.is_string()) return value.as_string();
  std::string out;
  append_python_repr(out, value);
  return out;
}

JsonValue parse_json(std::string_view text, const JsonLimits& limits, const char* who) {
  return Parser(text, limits, who).run();
}

size_t json_bytes(std::string_view text, const JsonLimits& limits, const char* who) {
  Parser p(text, limits, who, /*dry=*/true);
  p.run();
  return p.bytes();
}

void parse_json_members(std::string_view text, const JsonLimits& limits, const char* who,
                        const std::function<void(std::string, JsonValue)>& each) {
  Parser(text, limits, who).members(each);
}

const char* json_type_name(const JsonValue& value) {
  if (value.is_null()) return "NoneType";
  if (value.is_bool()) return "bool";
  if (value.is_int()) return "int";
  if (value.is_float()) return "float";
  if (value.is_string()) return "str";
  if (value.is_list()) return "list";
  return "dict";
}

bool json_identical(const JsonValue& a, const JsonValue& b) {
  if (a.is_float() && b.is_float()) {
    return std::bit_cast<uint64_t>(a.as_float()) == std::bit_cast<uint64_t>(b.as_float());
  }
  if (a.is_list() && b.is_list()) {
    const auto& x = a.as_list();
    const auto& y = b.as_list();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!json_identical(x[i], y[i])) return false;
    }
    return true;
  }
  if (a.is_map() && b.is_map()) {
    const auto& x = a.as_map();
    const auto& y = b.as_map();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].first != y[i].first || !json_identical(x[i].second, y[i].second)) return false;
    }
    return true;
  }
  return a == b;
}

}  // namespace core
}  // namespace tensordict

// Metadata <-> JSON text (docs/wire-format.md §3.2, §6.1). The writer reproduces Python's
// json.dumps byte for byte (the pipe hashes that text); the reader takes untrusted text from a
// peer and validates what it read once.

#include <algorithm>
#include <charconv>
#include <functional>
#include <limits>
#include <ostream>

#include "core/json_text.h"
#include "core/metadata.h"
#include "core/metadata_reader.h"
#include "core/metadata_tree.h"
#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"
#include "tensordict/errors.h"

namespace tensordict {
namespace {

// ---- writer -------------------------------------------------------------------------------

void append_string(std::string& out, std::string_view s) {
  core::append_json_string(out, s, "metadata_to_json");
}

void append_ints(std::string& out, const std::vector<int64_t>& v) {
  out += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(v[i]);
  }
  out += ']';
}

void append_optional(std::string& out, const std::optional<std::string>& s) {
  if (s) {
    append_string(out, *s);
  } else {
    out += "null";
  }
}

// A JSON object whose members are written by callbacks, in insertion or sorted key order.
class ObjectWriter {
 public:
  ObjectWriter(std::string& out, bool sort) : out_(out), sort_(sort) {}
  void add(std::string_view key, std::function<void()> value) {
    members_.emplace_back(key, std::move(value));
  }
  void write() {
    if (sort_) {
      // Python sorts str keys by code point, which is UTF-8 byte order.
      std::stable_sort(members_.begin(), members_.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    out_ += '{';
    for (size_t i = 0; i < members_.size(); ++i) {
      if (i) out_ += ", ";
      append_string(out_, members_[i].first);
      out_ += ": ";
      members_[i].second();
    }
    out_ += '}';
  }

 private:
  std::string& out_;
  bool sort_;
  std::vector<std::pair<std::string_view, std::function<void()>>> members_;
};

void append_node(std::string& out, const Metadata& m, bool sort, const TransportFields* transport) {
  ObjectWriter node(out, sort);
  // A class reference read from a peer's pickle is written as the TensorDict it was rebuilt as:
  // we never write class references.
  node.add("cls", [&] {
    append_string(out, core::is_class_reference_name(m.cls) ? std::string("TensorDict") : m.cls);
  });
  node.add("non_tensors", [&] {
    ObjectWriter w(out, sort);
    for (const auto& [key, nt] : m.non_tensors) {
      w.add(key, [&] {
        out += '[';
        core::append_json(out, nt.data, sort);
        out += ", ";
        append_ints(out, nt.batch_size);
        out += ", ";
        append_optional(out, nt.device);
        out += ']';
      });
    }
    w.write();
  });
  node.add("leaves", [&] {
    ObjectWriter w(out, sort);
    for (const auto& [key, l] : m.leaves) {
      w.add(key, [&] {
        out += '[';
        append_string(out, dtype_name(l.dtype));
        out += ", ";
        append_ints(out, l.shape);
        out += ", " + std::to_string(l.start) + ", " + std::to_string(l.stop) + ", " +
               std::to_string(l.pad) + "]";
      });
    }
    w.write();
  });
  node.add("cls_metadata", [&] {
    const auto& cm = m.cls_metadata;
    ObjectWriter w(out, sort);
    if (m.is_stack()) {  // the reference's LazyStackedTensorDict._reduce_get_metadata
      w.add("stack_dim", [&] { out += std::to_string(cm.stack_dim); });
      w.add("stack_dim_name", [&] { append_optional(out, cm.stack_dim_name); });
      w.add("is_locked", [&] { out += cm.is_locked ? "true" : "false"; });
      w.write();
      return;
    }
    w.add("device", [&] { append_optional(out, cm.device); });
    w.add("names", [&] {
      out += '[';
      for (size_t i = 0; i < cm.names.size(); ++i) {
        if (i) out += ", ";
        append_optional(out, cm.names[i]);
      }
      out += ']';
    });
    w.add("batch_size", [&] { append_ints(out, cm.batch_size); });
    w.add("is_locked", [&] { out += cm.is_locked ? "true" : "false"; });
    w.write();
  });
  for (const auto& [key, child] : m.children) {
    node.add(key, [&] { append_node(out, child, sort, nullptr); });
  }
  if (transport) {
    for (const auto& [key, value] : *transport) {
      node.add(key, [&] {
        std::visit(
            [&](const auto& v) {
              using T = std::decay_t<decltype(v)>;
              if constexpr (std::is_same_v<T, std::nullptr_t>) {
                out += "null";
              } else if constexpr (std::is_same_v<T, bool>) {
                out += v ? "true" : "false";
              } else if constexpr (std::is_same_v<T, int64_t>) {
                out += std::to_string(v);
              } else {
                append_string(out, v);
              }
            },
            value);
      });
    }
  }
  node.write();
}

void add_written(core::JsonExpansion& e, const Metadata& m, std::vector<std::string>& path,
                 const char* who) {
  for (const auto& [key, nt] : m.non_tensors) {
    e.add(nt.data, [&] {
      return c10::str(who, ": the non-tensor value of key ", core::path_str(path, key));
    });
  }
  for (const auto& [key, child] : m.children) {
    path.push_back(key);
    add_written(e, child, path, who);
    path.pop_back();
  }
}

}  // namespace

namespace core {
void check_written_size(const Metadata& m, const char* who) {
  JsonExpansion e;
  std::vector<std::string> path;
  add_written(e, m, path, who);
}
}  // namespace core

std::string metadata_to_json(const Metadata& metadata, bool sort_keys,
                             const TransportFields& transport) {
  core::check_written_size(metadata, "metadata JSON");
  std::string out;
  out.reserve(256 + 96 * metadata.leaves.size());
  append_node(out, metadata, sort_keys, &transport);
  return out;
}

Metadata metadata_from_json(std::string_view text, TransportFields* transport) {
  core::ValidatedMetadata v = core::read_metadata_json(text);
  return std::move(v).take(transport);
}

namespace core {
namespace {

// A parsed JSON text as metadata_reader.h reads trees.
struct JsonTraits {
  using Value = JsonValue;
  using Members = const JsonValue::Map&;
  static bool is_null(const Value& v) { return v.is_null(); }
  static bool is_bool(const Value& v) { return v.is_bool(); }
  static bool is_int(const Value& v) { return v.is_int(); }
  static bool is_number(const Value& v) { return v.is_int() || v.is_float(); }
  static bool is_string(const Value& v) { return v.is_string(); }
  static bool is_list(const Value& v) { return v.is_list(); }
  static bool is_plain_list(const Value&) { return false; }  // JSON has no tuples
  static bool is_map(const Value& v) { return v.is_map(); }
  static bool is_class_ref(const Value&) { return false; }  // JSON names no classes
  static std::string class_name(const Value&) { return {}; }
  static bool as_bool(const Value& v) { return v.as_bool(); }
  static int64_t as_int(const Value& v) { return v.as_int(); }
  static const std::string& as_string(const Value& v) { return v.as_string(); }
  static const JsonValue::List& items(const Value& v) { return v.as_list(); }
  static Members members(const Value& v) { return v.as_map(); }
  static void ignored(const Value&) {}
  static const JsonValue& to_json(const Value& v) { return v; }
  static std::string excerpt(const Value& v) { return core::json_excerpt(v); }
};

// The plain shape of a metadata text into the arena of metadata_tree.h: strings without
// escapes (views of the text), numbers that parse as parse_json's do, no NaN or Infinity, no
// repeated key, within parse_json's bounds (values counted as it counts them). Anything else
// gives up, and parse_json reads the text (and words any error).
class FastJson {
 public:
  FastJson(std::string_view text, tree::Tree& t) : s_(text), t_(t) {}

  uint32_t run() {
    ws();
    const uint32_t root = value(0);
    ws();
    if (pos_ != s_.size()) throw tree::GiveUp{};
    return root;
  }

 private:
  using Kind = tree::Kind;

  void ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  char peek() const {
    if (pos_ >= s_.size()) throw tree::GiveUp{};
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) throw tree::GiveUp{};
    ++pos_;
  }
  void word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) throw tree::GiveUp{};
    pos_ += w.size();
  }
  uint32_t add(const tree::Node& n) {
    t_.nodes.push_back(n);
    return static_cast<uint32_t>(t_.nodes.size() - 1);
  }
  uint32_t value(size_t depth) {
    if (++values_ > kMaxMetadataJsonValues) throw tree::GiveUp{};
    tree::Node n;
    switch (peek()) {
      case '{': return container(depth + 1, true);
      case '[': return container(depth + 1, false);
      case '"': return string();
      case 'n': word("null"); return add(tree::node_of(Kind::None));
      case 't':
        word("true");
        n = tree::node_of(Kind::Bool);
        n.b = true;
        return add(n);
      case 'f': word("false"); return add(tree::node_of(Kind::Bool));
      default: return number();
    }
  }
  uint32_t container(size_t depth, bool is_map) {
    if (depth > kMaxMetadataJsonDepth) throw tree::GiveUp{};
    ++pos_;
    const size_t base = stack_.size();
    const char close = is_map ? '}' : ']';
    ws();
    if (peek() == close) {
      ++pos_;
    } else {
      while (true) {
        ws();
        if (is_map) {
          if (peek() != '"') throw tree::GiveUp{};
          stack_.push_back(string());  // a key: not a value for the count
          ws();
          expect(':');
          ws();
        }
        stack_.push_back(value(depth));
        ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(close);
        break;
      }
    }
    tree::Node n = tree::node_of(is_map ? Kind::Dict : Kind::List);
    n.first = static_cast<uint32_t>(t_.kids.size());
    n.count = static_cast<uint32_t>(stack_.size() - base);
    t_.kids.insert(t_.kids.end(), stack_.begin() + static_cast<std::ptrdiff_t>(base), stack_.end());
    stack_.resize(base);
    if (is_map) tree::check_unique_keys(t_, n);
    return add(n);
  }
  uint32_t string() {
    const size_t start = ++pos_;
    bool ascii = true;
    while (true) {
      const auto c = static_cast<unsigned char>(peek());
      if (c == '"') break;
      if (c == '\\' || c < 0x20) throw tree::GiveUp{};  // escapes: parse_json decodes them
      ascii &= c < 0x80;
      ++pos_;
    }
    const std::string_view text = s_.substr(start, pos_ - start);
    ++pos_;
    if (!ascii && !valid_utf8(text)) throw tree::GiveUp{};
    tree::Node n = tree::node_of(Kind::Str);
    n.p = text.data();
    n.count = static_cast<uint32_t>(text.size());
    return add(n);
  }
  uint32_t number() {
    const JsonNumber num = scan_json_number(s_.substr(pos_));
    if (num.length == 0) throw tree::GiveUp{};
    const size_t start = pos_;
    pos_ += num.length;
    const bool is_float = num.is_float;
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    tree::Node n = tree::node_of(is_float ? Kind::Float : Kind::Int);
    const auto r = is_float ? std::from_chars(first, last, n.f) : std::from_chars(first, last, n.i);
    if (r.ec != std::errc() || r.ptr != last) throw tree::GiveUp{};  // out of range: parse_json
    return add(n);
  }

  std::string_view s_;
  tree::Tree& t_;
  size_t pos_ = 0;
  size_t values_ = 0;
  std::vector<uint32_t> stack_;
};

}  // namespace

ValidatedMetadata read_metadata_json(std::string_view text) {
  TORCH_CHECK_VALUE(text.size() <= kMaxMetadataJsonBytes, "metadata: ", text.size(),
                    " bytes of JSON, more than the limit of ", kMaxMetadataJsonBytes);
  const size_t budget = kValueBytesPerTextByte * text.size() + kValueAllowanceBytes;
  const auto over = [&](size_t limit) {
    TD_THROW(core::ValueBudgetError, "metadata: the non-tensor values would take more than ", limit,
             " bytes of memory (a reader spends at most ", kValueBytesPerTextByte,
             " bytes per byte of metadata JSON, plus ", kValueAllowanceBytes,
             ", on them, as on meta.json's); keep large data in tensors");
  };
  try {
    if (auto fast = tree::read_fast(
            text, /*json=*/true,
            [](std::string_view in, tree::Tree& t) { return FastJson(in, t).run(); }, budget)) {
      return std::move(*fast);
    }
  } catch (const tree::OverBudget& e) {
    over(e.limit);
  }
  ValidatedMetadata v = read_metadata_json_general(text);
  // The general way (a text the fast path does not take) has built the values: measured after.
  size_t bytes = 0;
  const std::function<void(const Metadata&)> walk = [&](const Metadata& m) {
    for (const auto& [key, nt] : m.non_tensors) bytes += json_memory(nt.data);
    for (const auto& [key, child] : m.children) walk(child);
  };
  walk(v.metadata());
  if (bytes > budget) over(budget);
  return v;
}

ValidatedMetadata read_metadata_json_general(std::string_view text) {
  TORCH_CHECK_VALUE(text.size() <= kMaxMetadataJsonBytes, "metadata: ", text.size(),
                    " bytes of JSON, more than the limit of ", kMaxMetadataJsonBytes);
  const JsonValue j = parse_json(
      text, JsonLimits{.max_depth = kMaxMetadataJsonDepth, .max_values = kMaxMetadataJsonValues},
      "metadata");
  TransportFields transport;
  Metadata m = reader::read_root<JsonTraits>(j, &transport, /*json=*/true);
  return validated(std::move(m), std::move(transport));
}

}  // namespace core

}  // namespace tensordict

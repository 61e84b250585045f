// Metadata <-> JSON text. The writer reproduces Python's json.dumps byte for byte (the pipe
// hashes that text); the reader takes untrusted text from a peer.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <limits>

#include "json_object.h"
#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"
#include "tensordict/nested_key.h"

namespace tensordict {
namespace {

using Json = detail::OrderedJson;  // indexed: a peer's large object parses in linear time

// ---- writer -------------------------------------------------------------------------------

void append_u_escape(std::string& out, uint32_t unit) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += "\\u";
  for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(unit >> shift) & 0xf];
}

// Python's json encoder with ensure_ascii=True: \" \\ \n \r \t \b \f, every other character
// outside ' '..'~' as \uXXXX (lowercase hex, UTF-16 surrogate pairs above U+FFFF).
void append_string(std::string& out, std::string_view s) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (c < 0x20 || c == 0x7f) {
            append_u_escape(out, c);
          } else {
            out += static_cast<char>(c);
          }
      }
      ++i;
      continue;
    }
    const int len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    uint32_t cp = len == 4 ? c & 0x07 : len == 3 ? c & 0x0f : c & 0x1f;
    bool ok = len > 0 && c < 0xf5 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      ok = (cc & 0xc0) == 0x80;
      cp = (cp << 6) | (cc & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    ok = ok && cp >= kMin[len] && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
    TORCH_CHECK_VALUE(ok, "metadata_to_json: the string ", quote_key(s),
                      " is not valid UTF-8 (byte ", i, ")");
    if (cp >= 0x10000) {
      append_u_escape(out, 0xd800 + ((cp - 0x10000) >> 10));
      append_u_escape(out, 0xdc00 + ((cp - 0x10000) & 0x3ff));
    } else {
      append_u_escape(out, cp);
    }
    i += len;
  }
  out += '"';
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

void append_json(std::string& out, const Json& j, bool sort) {
  switch (j.type()) {
    case Json::value_t::object: {
      ObjectWriter w(out, sort);
      for (const auto& [k, v] : j.items()) w.add(k, [&out, &v, sort] { append_json(out, v, sort); });
      w.write();
      break;
    }
    case Json::value_t::array:
      out += '[';
      for (size_t i = 0; i < j.size(); ++i) {
        if (i) out += ", ";
        append_json(out, j[i], sort);
      }
      out += ']';
      break;
    case Json::value_t::string:
      append_string(out, j.get_ref<const std::string&>());
      break;
    default:  // numbers, booleans, null: nlohmann formats floats as Python's repr does
      out += j.dump();
  }
}

void append_node(std::string& out, const Metadata& m, bool sort, const TransportFields* transport) {
  ObjectWriter node(out, sort);
  node.add("cls", [&] { append_string(out, m.cls); });
  node.add("non_tensors", [&] {
    ObjectWriter w(out, sort);
    for (const auto& [key, nt] : m.non_tensors) {
      w.add(key, [&] {
        out += '[';
        append_json(out, Json::parse(nt.data_json), sort);
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

// ---- reader -------------------------------------------------------------------------------

// Bounds the parsed tree (nesting and element count) while nlohmann builds it.
constexpr int kMaxJsonDepth = 2 * kMaxMetadataDepth + 16;
constexpr int64_t kMaxJsonValues = 8 * kMaxMetadataEntries;

struct Reader {
  std::vector<std::string> path;

  std::string at(std::string_view what) const {
    return c10::str(what, " of ", path.empty() ? std::string("the root") : NestedKey(path).str());
  }
  std::string at(std::string_view what, const std::string& key) const {
    auto p = path;
    p.push_back(key);
    return c10::str(what, " ", NestedKey(std::move(p)).str());
  }

  static const char* type_name(const Json& j) { return j.type_name(); }

  static int64_t as_int(const Json& j, const std::string& what) {
    TORCH_CHECK_VALUE(j.is_number_integer(), "metadata: ", what, " must be an integer, got ",
                      type_name(j), " ", j.dump());
    TORCH_CHECK_VALUE(!j.is_number_unsigned() ||
                          j.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
                      "metadata: ", what, " is out of range: ", j.dump());
    return j.get<int64_t>();
  }
  static std::vector<int64_t> as_ints(const Json& j, const std::string& what) {
    TORCH_CHECK_VALUE(j.is_array(), "metadata: ", what, " must be a list of integers, got ",
                      type_name(j));
    std::vector<int64_t> out;
    out.reserve(j.size());
    for (const auto& v : j) out.push_back(as_int(v, what));
    return out;
  }
  static std::optional<std::string> as_optional_string(const Json& j, const std::string& what) {
    if (j.is_null()) return std::nullopt;
    TORCH_CHECK_VALUE(j.is_string(), "metadata: ", what, " must be a string or null, got ",
                      type_name(j));
    return j.get<std::string>();
  }
  static const Json& object(const Json& j, const std::string& what) {
    TORCH_CHECK_VALUE(j.is_object(), "metadata: ", what, " must be an object, got ", type_name(j));
    return j;
  }

  LeafMetadata leaf(const std::string& key, const Json& j) const {
    const auto what = at("leaf", key);
    TORCH_CHECK_VALUE(j.is_array(), "metadata: ", what, " must be [dtype, shape, start, stop, pad], got ",
                      type_name(j));
    TORCH_CHECK_VALUE(j.size() != 6, "metadata: ", what,
                      " is a nested (jagged) tensor part, which is not supported");
    TORCH_CHECK_VALUE(j.size() == 5, "metadata: ", what,
                      " must be [dtype, shape, start, stop, pad], got ", j.size(), " elements");
    TORCH_CHECK_VALUE(j[0].is_string(), "metadata: the dtype of ", what, " must be a string, got ",
                      type_name(j[0]));
    const auto& name = j[0].get_ref<const std::string&>();
    const auto dtype = dtype_from_name(name);
    TORCH_CHECK_VALUE(dtype, "metadata: ", what, " has the unknown dtype ", quote_key(name));
    return LeafMetadata{*dtype, as_ints(j[1], "the shape of " + what),
                        as_int(j[2], "the start of " + what), as_int(j[3], "the stop of " + what),
                        as_int(j[4], "the pad of " + what)};
  }

  NonTensorMetadata non_tensor(const std::string& key, const Json& j) const {
    const auto what = at("non-tensor", key);
    TORCH_CHECK_VALUE(j.is_array() && j.size() == 3, "metadata: ", what,
                      " must be [data, batch_size, device]");
    std::string data;
    append_json(data, j[0], false);
    return NonTensorMetadata{std::move(data), as_ints(j[1], "the batch_size of " + what),
                             as_optional_string(j[2], "the device of " + what)};
  }

  ClsMetadata cls_metadata(const Json& j) const {
    const auto what = at("cls_metadata");
    object(j, what);
    ClsMetadata cm;
    bool has_batch_size = false, has_names = false;
    for (const auto& [k, v] : j.items()) {
      if (k == "device") {
        cm.device = as_optional_string(v, "the device in " + what);
      } else if (k == "names") {
        TORCH_CHECK_VALUE(v.is_array(), "metadata: the names in ", what, " must be a list");
        for (const auto& n : v) cm.names.push_back(as_optional_string(n, "a name in " + what));
        has_names = true;
      } else if (k == "batch_size") {
        cm.batch_size = as_ints(v, "the batch_size in " + what);
        has_batch_size = true;
      } else if (k == "is_locked") {
        TORCH_CHECK_VALUE(v.is_boolean(), "metadata: is_locked in ", what, " must be a bool, got ",
                          type_name(v));
        cm.is_locked = v.get<bool>();
      } else {
        TORCH_CHECK_VALUE(false, "metadata: ", what, " has the unexpected field ", quote_key(k));
      }
    }
    TORCH_CHECK_VALUE(has_batch_size, "metadata: ", what, " has no batch_size");
    if (!has_names) cm.names.assign(cm.batch_size.size(), std::nullopt);
    return cm;
  }

  Metadata node(const Json& j, int depth, TransportFields* transport) {
    object(j, at("the node"));
    TORCH_CHECK_VALUE(depth <= kMaxMetadataDepth, "metadata: ", at("the node"),
                      " is nested deeper than ", kMaxMetadataDepth, " levels");
    Metadata m;
    int seen = 0;  // bit per required field
    for (const auto& [k, v] : j.items()) {
      if (k == "cls") {
        TORCH_CHECK_VALUE(v.is_string(), "metadata: ", at("cls"), " must be a string, got ",
                          type_name(v));
        m.cls = v.get<std::string>();
        seen |= 1;
      } else if (k == "non_tensors") {
        for (const auto& [nk, nv] : object(v, at("non_tensors")).items()) {
          m.non_tensors.emplace_back(nk, non_tensor(nk, nv));
        }
        seen |= 2;
      } else if (k == "leaves") {
        for (const auto& [lk, lv] : object(v, at("leaves")).items()) {
          m.leaves.emplace_back(lk, leaf(lk, lv));
        }
        seen |= 4;
      } else if (k == "cls_metadata") {
        m.cls_metadata = cls_metadata(v);
        seen |= 8;
      } else if (!v.is_object() && ((depth == 0 && k.starts_with("_")) || k == "size")) {
        // Transport fields ("_total_bytes", "_storage_device", ...) and the file variant's
        // "size" are not nodes; the reference would take them for nodes and crash. A "_" key
        // that holds an object is a nested TensorDict of that name.
        if (transport && depth == 0 && k.starts_with("_")) {
          JsonScalar value = nullptr;
          if (v.is_boolean()) {
            value = v.get<bool>();
          } else if (v.is_number_integer() && !v.is_number_unsigned()) {
            value = v.get<int64_t>();
          } else if (v.is_number_unsigned()) {
            value = as_int(v, at("the transport field", k));
          } else if (v.is_string()) {
            value = v.get<std::string>();
          }
          transport->emplace_back(k, std::move(value));
        }
      } else {
        TORCH_CHECK_VALUE(v.is_object(), "metadata: ", at("the key", k),
                          " holds a ", type_name(v), ", not a nested node");
        path.push_back(k);
        auto child = node(v, depth + 1, nullptr);
        path.pop_back();
        m.children.emplace_back(k, std::move(child));
      }
    }
    TORCH_CHECK_VALUE(seen == 15, "metadata: ", at("the node"),
                      " lacks one of cls, non_tensors, leaves, cls_metadata");
    return m;
  }
};

}  // namespace

std::string metadata_to_json(const Metadata& metadata, bool sort_keys,
                             const TransportFields& transport) {
  std::string out;
  out.reserve(256 + 96 * metadata.leaves.size());
  append_node(out, metadata, sort_keys, &transport);
  return out;
}

Metadata metadata_from_json(std::string_view text, TransportFields* transport) {
  TORCH_CHECK_VALUE(text.size() <= kMaxMetadataJsonBytes, "metadata: ", text.size(),
                    " bytes of JSON, more than the limit of ", kMaxMetadataJsonBytes);
  int64_t values = 0;
  const Json::parser_callback_t bound = [&](int depth, Json::parse_event_t, Json&) {
    TORCH_CHECK_VALUE(depth <= kMaxJsonDepth, "metadata: JSON nested deeper than ", kMaxJsonDepth);
    TORCH_CHECK_VALUE(++values <= kMaxJsonValues, "metadata: more than ", kMaxJsonValues,
                      " JSON values");
    return true;
  };
  Json j;
  try {
    j = Json::parse(text.begin(), text.end(), bound);
  } catch (const Json::exception& e) {
    TORCH_CHECK_VALUE(false, "metadata: invalid JSON: ", e.what());
  }
  if (transport) transport->clear();
  Metadata m = Reader{}.node(j, 0, transport);
  metadata_storage_bytes(m);  // validates
  return m;
}

}  // namespace tensordict

// Metadata <-> JSON text. The writer reproduces Python's json.dumps byte for byte (the pipe
// hashes that text); the reader takes untrusted text from a peer.

#include <algorithm>
#include <functional>
#include <limits>
#include <ostream>

#include "json_text.h"
#include "metadata_value.h"
#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"
#include "tensordict/nested_key.h"

namespace tensordict {
namespace {

// ---- writer -------------------------------------------------------------------------------

void append_string(std::string& out, std::string_view s) {
  detail::append_json_string(out, s, "metadata_to_json");
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
    append_string(out, detail::is_class_reference_name(m.cls) ? std::string("TensorDict") : m.cls);
  });
  node.add("non_tensors", [&] {
    ObjectWriter w(out, sort);
    for (const auto& [key, nt] : m.non_tensors) {
      w.add(key, [&] {
        out += '[';
        detail::append_json(out, nt.data, sort);
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

using Json = JsonValue;

std::string short_dump(const Json& j) {
  std::string text = j.dump();
  return text.size() > 80 ? text.substr(0, 80) + "..." : text;
}

// What a check is about ("the shape of leaf a.b"), rendered only when the check fails: building
// the text for every value would cost more than reading the value.
struct What {
  const std::vector<std::string>* path;
  std::string_view what;
  const std::string* key = nullptr;  // "<what> <path.key>"; none: "<what> of <path>"
  std::string_view prefix = {};      // put before, as in "the shape of "

  What of(std::string_view p) const { return {path, what, key, p}; }
  friend std::ostream& operator<<(std::ostream& os, const What& w) {
    os << w.prefix << w.what;
    if (w.key) {
      auto p = *w.path;
      p.push_back(*w.key);
      return os << " " << NestedKey(std::move(p)).str();
    }
    return os << " of " << (w.path->empty() ? std::string("the root") : NestedKey(*w.path).str());
  }
};

struct Reader {
  std::vector<std::string> path;

  What at(std::string_view what) const { return {&path, what}; }
  What at(std::string_view what, const std::string& key) const { return {&path, what, &key}; }

  // JSON's names of the types, as the messages have always said them.
  static const char* type_name(const Json& j) {
    if (j.is_null()) return "null";
    if (j.is_bool()) return "boolean";
    if (j.is_int() || j.is_float()) return "number";
    if (j.is_string()) return "string";
    return j.is_list() ? "array" : "object";
  }

  static int64_t as_int(const Json& j, const What& what) {
    TORCH_CHECK_VALUE(j.is_int(), "metadata: ", what, " must be an integer, got ", type_name(j),
                      " ", short_dump(j));
    return j.as_int();
  }
  static std::vector<int64_t> as_ints(const Json& j, const What& what) {
    TORCH_CHECK_VALUE(j.is_list(), "metadata: ", what, " must be a list of integers, got ",
                      type_name(j));
    std::vector<int64_t> out;
    out.reserve(j.as_list().size());
    for (const auto& v : j.as_list()) out.push_back(as_int(v, what));
    return out;
  }
  static std::optional<std::string> as_optional_string(const Json& j, const What& what) {
    if (j.is_null()) return std::nullopt;
    TORCH_CHECK_VALUE(j.is_string(), "metadata: ", what, " must be a string or null, got ",
                      type_name(j));
    return j.as_string();
  }
  static const Json::Map& object(const Json& j, const What& what) {
    TORCH_CHECK_VALUE(j.is_map(), "metadata: ", what, " must be an object, got ", type_name(j));
    return j.as_map();
  }

  LeafMetadata leaf(const std::string& key, const Json& j) const {
    const auto what = at("leaf", key);
    TORCH_CHECK_VALUE(j.is_list(), "metadata: ", what, " must be [dtype, shape, start, stop, pad], got ",
                      type_name(j));
    const auto& l = j.as_list();
    TORCH_CHECK_VALUE(l.size() != 6, "metadata: ", what,
                      " is a nested (jagged) tensor part, which is not supported");
    TORCH_CHECK_VALUE(l.size() == 5, "metadata: ", what,
                      " must be [dtype, shape, start, stop, pad], got ", l.size(), " elements");
    TORCH_CHECK_VALUE(l[0].is_string(), "metadata: the dtype of ", what, " must be a string, got ",
                      type_name(l[0]));
    const auto& name = l[0].as_string();
    const auto dtype = dtype_from_name(name);
    TORCH_CHECK_VALUE(dtype, "metadata: ", what, " has the unknown dtype ", quote_key(name));
    return LeafMetadata{*dtype, as_ints(l[1], what.of("the shape of ")),
                        as_int(l[2], what.of("the start of ")), as_int(l[3], what.of("the stop of ")),
                        as_int(l[4], what.of("the pad of "))};
  }

  NonTensorMetadata non_tensor(const std::string& key, const Json& j) const {
    const auto what = at("non-tensor entry", key);
    TORCH_CHECK_VALUE(j.is_list() && j.as_list().size() == 3, "metadata: ", what,
                      " must be [data, batch_size, device], got ", type_name(j), " ",
                      short_dump(j));
    const auto& l = j.as_list();
    return NonTensorMetadata{l[0], as_ints(l[1], what.of("the batch_size of ")),
                             as_optional_string(l[2], what.of("the device of "))};
  }

  ClsMetadata cls_metadata(const Json& j) const {
    const auto what = at("cls_metadata");
    ClsMetadata cm;
    bool has_batch_size = false, has_names = false;
    for (const auto& [k, v] : object(j, what)) {
      if (k == "device") {
        cm.device = as_optional_string(v, what.of("the device in "));
      } else if (k == "names") {
        TORCH_CHECK_VALUE(v.is_list(), "metadata: the names in ", what, " must be a list");
        for (const auto& n : v.as_list()) cm.names.push_back(as_optional_string(n, what.of("a name in ")));
        has_names = true;
      } else if (k == "batch_size") {
        cm.batch_size = as_ints(v, what.of("the batch_size in "));
        has_batch_size = true;
      } else if (k == "is_locked") {
        TORCH_CHECK_VALUE(v.is_bool(), "metadata: is_locked in ", what, " must be a bool, got ",
                          type_name(v));
        cm.is_locked = v.as_bool();
      } else {
        TORCH_CHECK_VALUE(false, "metadata: ", what, " has the unexpected field ", quote_key(k));
      }
    }
    TORCH_CHECK_VALUE(has_batch_size, "metadata: ", what, " has no batch_size");
    if (!has_names) cm.names.assign(cm.batch_size.size(), std::nullopt);
    return cm;
  }

  Metadata node(const Json& j, int depth, TransportFields* transport) {
    const auto& members = object(j, at("the node"));
    TORCH_CHECK_VALUE(depth <= kMaxMetadataDepth, "metadata: ", at("the node"),
                      " is nested deeper than ", kMaxMetadataDepth, " levels");
    Metadata m;
    int seen = 0;  // bit per required field
    for (const auto& [k, v] : members) {
      if (k == "cls") {
        TORCH_CHECK_VALUE(v.is_string(), "metadata: ", at("cls"), " must be a string, got ",
                          type_name(v));
        m.cls = v.as_string();
        // A class travels as a pickled class reference (metadata_from_pickle), never as a str.
        TORCH_CHECK_VALUE(!detail::is_class_reference_name(m.cls), "metadata: ", at("cls"),
                          " is the string ", quote_key(m.cls),
                          "; only TensorDict nodes are supported");
        seen |= 1;
      } else if (k == "non_tensors") {
        for (const auto& [nk, nv] : object(v, at("non_tensors"))) {
          m.non_tensors.emplace_back(nk, non_tensor(nk, nv));
        }
        seen |= 2;
      } else if (k == "leaves") {
        for (const auto& [lk, lv] : object(v, at("leaves"))) {
          m.leaves.emplace_back(lk, leaf(lk, lv));
        }
        seen |= 4;
      } else if (k == "cls_metadata") {
        m.cls_metadata = cls_metadata(v);
        seen |= 8;
      } else if (!v.is_map() && ((depth == 0 && k.starts_with("_")) || k == "size")) {
        // Transport fields ("_total_bytes", "_storage_device", ...) and the file variant's
        // "size" are not nodes; the reference would take them for nodes and crash. A "_" key
        // that holds an object is a nested TensorDict of that name.
        if (transport && depth == 0 && k.starts_with("_")) {
          JsonScalar value = nullptr;
          if (v.is_bool()) {
            value = v.as_bool();
          } else if (v.is_int()) {
            value = v.as_int();
          } else if (v.is_string()) {
            value = v.as_string();
          }
          transport->emplace_back(k, std::move(value));
        }
      } else {
        TORCH_CHECK_VALUE(v.is_map(), "metadata: ", at("the key", k), " holds a ", type_name(v),
                          ", not a nested node");
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
  const JsonValue j = detail::parse_json(
      text, detail::JsonLimits{.max_depth = detail::kMaxMetadataJsonDepth,
                               .max_values = detail::kMaxMetadataJsonValues},
      "metadata");
  return detail::metadata_from_value(j, transport);
}

namespace detail {

Metadata metadata_from_value(const JsonValue& value, TransportFields* transport) {
  if (transport) transport->clear();
  Metadata m = Reader{}.node(value, 0, transport);
  metadata_storage_bytes(m);  // validates
  return m;
}

}  // namespace detail

}  // namespace tensordict

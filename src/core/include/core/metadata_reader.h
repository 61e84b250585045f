#pragma once
// The one reader of metadata trees, shared by the JSON codec (src/core/metadata_json.cpp) and
// the pickle codec (src/wire/metadata_pickle.cpp), so that both give the same errors for the
// same faults. `T` adapts a parsed tree (JsonValue or wire::pickle::Value): T::Value, the kind
// tests (is_null, is_bool, is_int, is_number, is_string, is_list, is_map, is_class_ref), as_bool,
// as_int, as_string, items (a list's or tuple's elements), members (a map's (key, value) pairs),
// is_plain_list (a list and not a tuple: a pickle tells them apart, JSON does not),
// class_name, to_json (a non-tensor entry's data), excerpt (a value in a message, bounded by
// core/excerpt.h) and ignored (called on each value the reader skips, which a reader that
// checks values lazily inspects there).
// Validation of the result is validate()'s (metadata_validate.cpp), done once by the caller.

#include <c10/util/Exception.h>

#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "core/excerpt.h"
#include "core/metadata.h"
#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"

namespace tensordict::core::reader {

// What a check is about ("the shape of leaf a.b"), rendered only when the check fails: building
// the text for every value would cost more than reading the value.
struct What {
  const std::vector<std::string>* path;
  std::string_view what;
  std::optional<std::string_view> key =
      std::nullopt;              // "<what> <path.key>"; none: "<what> of <path>"
  std::string_view prefix = {};  // put before, as in "the shape of "

  What of(std::string_view p) const { return {path, what, key, p}; }
  friend std::ostream& operator<<(std::ostream& os, const What& w) {
    os << w.prefix << w.what;
    if (w.key) return os << " " << key_path_excerpt(*w.path, *w.key);
    return os << " of " << (w.path->empty() ? std::string("the root") : key_path_excerpt(*w.path));
  }
};

template <typename T>
struct Reader {
  using Json = typename T::Value;

  std::vector<std::string> path;
  bool json = false;  // reading JSON text (no tuples), not a pickle

  What at(std::string_view what) const { return {&path, what}; }
  What at(std::string_view what, std::string_view key) const { return {&path, what, key}; }

  // JSON's names of the types, as the messages have always said them.
  static const char* type_name(const Json& j) {
    if (T::is_null(j)) return "null";
    if (T::is_bool(j)) return "boolean";
    if (T::is_number(j)) return "number";
    if (T::is_string(j)) return "string";
    return T::is_list(j) ? "array" : "object";
  }

  static int64_t as_int(const Json& j, const What& what) {
    TORCH_CHECK_VALUE(T::is_int(j), "metadata: ", what, " must be an integer, got ", type_name(j),
                      " ", T::excerpt(j));
    return T::as_int(j);
  }
  static std::vector<int64_t> as_ints(const Json& j, const What& what) {
    TORCH_CHECK_VALUE(T::is_list(j), "metadata: ", what, " must be a list of integers, got ",
                      type_name(j));
    std::vector<int64_t> out;
    const auto& items = T::items(j);
    out.reserve(items.size());
    for (const auto& v : items) out.push_back(as_int(v, what));
    return out;
  }
  static std::optional<std::string> as_optional_string(const Json& j, const What& what) {
    if (T::is_null(j)) return std::nullopt;
    TORCH_CHECK_VALUE(T::is_string(j), "metadata: ", what, " must be a string or null, got ",
                      type_name(j));
    return T::as_string(j);
  }
  static typename T::Members object(const Json& j, const What& what) {
    TORCH_CHECK_VALUE(T::is_map(j), "metadata: ", what, " must be an object, got ", type_name(j));
    return T::members(j);
  }

  LeafMetadata leaf(std::string_view key, const Json& j) const {
    const auto what = at("leaf", key);
    TORCH_CHECK_VALUE(T::is_list(j), "metadata: ", what,
                      " must be [dtype, shape, start, stop, pad], got ", type_name(j));
    const auto& l = T::items(j);
    TORCH_CHECK_VALUE(l.size() != 6, "metadata: ", what,
                      " is a nested (jagged) tensor part, which is not supported");
    TORCH_CHECK_VALUE(l.size() == 5, "metadata: ", what,
                      " must be [dtype, shape, start, stop, pad], got ", l.size(), " elements");
    TORCH_CHECK_VALUE(T::is_string(l[0]), "metadata: the dtype of ", what,
                      " must be a string, got ", type_name(l[0]));
    const auto& name = T::as_string(l[0]);
    const auto dtype = dtype_from_name(name);
    TORCH_CHECK_VALUE(dtype, "metadata: ", what, " has the unknown dtype ", quoted_excerpt(name));
    return LeafMetadata{
        *dtype, as_ints(l[1], what.of("the shape of ")), as_int(l[2], what.of("the start of ")),
        as_int(l[3], what.of("the stop of ")), as_int(l[4], what.of("the pad of "))};
  }

  NonTensorMetadata non_tensor(std::string_view key, const Json& j, bool json) const {
    const auto what = at("non-tensor entry", key);
    TORCH_CHECK_VALUE(T::is_list(j) && T::items(j).size() == 3, "metadata: ", what,
                      " must be [data, batch_size, device], got ", type_name(j), " ",
                      T::excerpt(j));
    const auto& l = T::items(j);
    // A pickled list (not the reference's tuple) is our MetaData (docs/wire-format.md §3.7).
    return NonTensorMetadata{T::to_json(l[0]), as_ints(l[1], what.of("the batch_size of ")),
                             as_optional_string(l[2], what.of("the device of ")),
                             !json && T::is_plain_list(j)};
  }

  // A stack's {"stack_dim", "stack_dim_name", "is_locked"} (a lazy stack's or a
  // NonTensorStack's); its batch size is derived from its members once they are read.
  ClsMetadata lazy_cls_metadata(const Json& j) const {
    const auto what = at("cls_metadata");
    ClsMetadata cm;
    bool has_stack_dim = false;
    for (const auto& [k, v] : object(j, what)) {
      if (k == "stack_dim") {
        cm.stack_dim = as_int(v, what.of("the stack_dim in "));
        has_stack_dim = true;
      } else if (k == "stack_dim_name") {
        cm.stack_dim_name = as_optional_string(v, what.of("the stack_dim_name in "));
      } else if (k == "is_locked") {
        TORCH_CHECK_VALUE(T::is_bool(v), "metadata: is_locked in ", what, " must be a bool, got ",
                          type_name(v));
        cm.is_locked = T::as_bool(v);
      } else {
        TORCH_CHECK_VALUE(false, "metadata: ", what, " of a lazy stack has the unexpected field ",
                          quoted_excerpt(k));
      }
    }
    TORCH_CHECK_VALUE(has_stack_dim, "metadata: ", what, " of a lazy stack has no stack_dim");
    return cm;
  }

  ClsMetadata cls_metadata(const Json& j) const {
    const auto what = at("cls_metadata");
    ClsMetadata cm;
    bool has_batch_size = false, has_names = false;
    for (const auto& [k, v] : object(j, what)) {
      if (k == "device") {
        cm.device = as_optional_string(v, what.of("the device in "));
      } else if (k == "names") {
        TORCH_CHECK_VALUE(T::is_list(v), "metadata: the names in ", what, " must be a list");
        for (const auto& n : T::items(v)) {
          cm.names.push_back(as_optional_string(n, what.of("a name in ")));
        }
        has_names = true;
      } else if (k == "batch_size") {
        cm.batch_size = as_ints(v, what.of("the batch_size in "));
        has_batch_size = true;
      } else if (k == "is_locked") {
        TORCH_CHECK_VALUE(T::is_bool(v), "metadata: is_locked in ", what, " must be a bool, got ",
                          type_name(v));
        cm.is_locked = T::as_bool(v);
      } else {
        TORCH_CHECK_VALUE(false, "metadata: ", what, " has the unexpected field ",
                          quoted_excerpt(k));
      }
    }
    TORCH_CHECK_VALUE(has_batch_size, "metadata: ", what, " has no batch_size");
    if (!has_names) cm.names.assign(cm.batch_size.size(), std::nullopt);
    return cm;
  }

  Metadata node(const Json& j, int depth, TransportFields* transport) {
    const auto& members = object(j, at("the node"));  // a reference or a small view
    TORCH_CHECK_VALUE(depth <= kMaxMetadataDepth, "metadata: ", at("the node"),
                      " is nested deeper than ", kMaxMetadataDepth, " levels");
    Metadata m;
    int seen = 0;  // bit per required field
    // cls_metadata's fields depend on cls, which a peer may send after it. (A scan: iterators
    // of some trees yield values by copy, so a pointer to one would not outlive its step.)
    bool lazy = false;
    for (const auto& [k, v] : members) {
      if (k == "cls") {
        lazy = T::is_string(v) &&
               (T::as_string(v) == kLazyStackCls || T::as_string(v) == kNonTensorStackCls);
        break;
      }
    }
    for (const auto& [k, v] : members) {
      if (k == "cls" && T::is_class_ref(v)) {
        m.cls = T::class_name(v);  // a pickled tensorclass node, read as a TensorDict node
        seen |= 1;
      } else if (k == "cls") {
        TORCH_CHECK_VALUE(T::is_string(v), "metadata: ", at("cls"), " must be a string, got ",
                          type_name(v));
        m.cls = T::as_string(v);
        // A class travels as a pickled class reference (metadata_from_pickle), never as a str,
        // except in the reference's files, which write str(cls): "<class 'module.Name'>".
        if (m.cls.starts_with("<class '") && m.cls.ends_with("'>") &&
            is_class_reference_name(std::string_view(m.cls).substr(8, m.cls.size() - 10))) {
          m.cls = m.cls.substr(8, m.cls.size() - 10);
        } else {
          TORCH_CHECK_VALUE(!is_class_reference_name(m.cls), "metadata: ", at("cls"),
                            " is the string ", quoted_excerpt(m.cls),
                            "; only TensorDict nodes are supported");
        }
        seen |= 1;
      } else if (k == "non_tensors") {
        for (const auto& [nk, nv] : object(v, at("non_tensors"))) {
          m.non_tensors.emplace_back(nk, non_tensor(nk, nv, json));
        }
        seen |= 2;
      } else if (k == "leaves") {
        for (const auto& [lk, lv] : object(v, at("leaves"))) {
          m.leaves.emplace_back(lk, leaf(lk, lv));
        }
        seen |= 4;
      } else if (k == "cls_metadata") {
        m.cls_metadata = lazy ? lazy_cls_metadata(v) : cls_metadata(v);
        seen |= 8;
      } else if (!T::is_map(v) && ((depth == 0 && k.starts_with("_")) || k == "size")) {
        // Transport fields ("_total_bytes", "_storage_device", ...) and the file variant's
        // "size" are not nodes; the reference would take them for nodes and crash. A "_" key
        // that holds an object is a nested TensorDict of that name.
        T::ignored(v);
        if (transport && depth == 0 && k.starts_with("_")) {
          JsonScalar value = nullptr;
          if (T::is_bool(v)) {
            value = T::as_bool(v);
          } else if (T::is_int(v)) {
            value = T::as_int(v);
          } else if (T::is_string(v)) {
            value = T::as_string(v);
          }
          transport->emplace_back(k, std::move(value));
        }
      } else {
        TORCH_CHECK_VALUE(T::is_map(v), "metadata: ", at("the key", k), " holds a ", type_name(v),
                          ", not a nested node");
        path.emplace_back(k);
        auto child = node(v, depth + 1, nullptr);
        path.pop_back();
        m.children.emplace_back(k, std::move(child));
      }
    }
    TORCH_CHECK_VALUE(seen == 15, "metadata: ", at("the node"),
                      " lacks one of cls, non_tensors, leaves, cls_metadata");
    if (m.is_stack()) {
      if (auto bs = stack_batch_size(m)) {  // otherwise validation says what is wrong
        m.cls_metadata.names.assign(bs->size(), std::nullopt);
        m.cls_metadata.batch_size = std::move(*bs);
      }
    }
    return m;
  }
};

/// The root node of a tree, with its top-level transport fields.
template <typename T>
Metadata read_root(const typename T::Value& root, TransportFields* transport, bool json) {
  Reader<T> r;
  r.json = json;
  return r.node(root, 0, transport);
}

}  // namespace tensordict::core::reader

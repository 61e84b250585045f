#pragma once
// A parsed metadata text (JSON or pickle) as an arena of 16-byte nodes, and its adapter for
// metadata_reader.h; shared by the codecs of src/core/metadata_json.cpp and
// src/wire/metadata_pickle.cpp. The fast paths of metadata_pickle.cpp and
// metadata_json.cpp parse the plain shape of a peer's metadata into it without building
// wire::pickle::Values or JsonValues (strings stay views of the input, containers are ranges of the
// arena) and give up (GiveUp) on anything else, which the general reader then reads, also
// making every error message. So a fast path accepts only what the general reader accepts,
// and builds the same metadata from it.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/json_text.h"
#include "core/metadata.h"
#include "core/metadata_reader.h"
#include "tensordict/json_value.h"

namespace tensordict::core::tree {

// The value kinds of both encodings: JSON's, plus the tuple and the class reference of a pickle
// (src/wire/metadata_pickle.cpp parses into this arena too).
enum class Kind { None, Bool, Int, Float, Str, List, Tuple, Dict, ClassRef };

// 16 bytes, so that the arena of a 1000-leaf metadata stays in cache.
struct Node {
  Kind kind = Kind::None;
  bool b = false;      // bool: its value; str: read again through a pickle memo (to_json shares it)
  uint16_t depth = 0;  // container nesting, 0 for scalars
  uint32_t count = 0;  // container: its items; str: its bytes; class ref: its Tree::refs index
  union {
    int64_t i = 0;
    double f;
    const char* p;   // str: its bytes, in the input
    uint32_t first;  // container: its items (dict: key, value, ...) in Tree::kids
  };
  std::string_view s() const { return {p, count}; }
};

inline Node node_of(Kind kind) {
  Node n;
  n.kind = kind;
  return n;
}

struct Tree {
  std::vector<Node> nodes;
  std::vector<uint32_t> kids;
  std::vector<std::pair<std::string_view, std::string_view>> refs;  // (module, qualname)
  // The JsonValue of each str node a pickle's memo reads again (marked by `b`): one value
  // however many entries reuse it, as Python's unpickler gives one object.
  mutable std::unordered_map<uint32_t, JsonValue> shared_strings;
  // The memory the non-tensor values built from this tree may take, and what they took.
  size_t max_value_bytes = SIZE_MAX;
  mutable size_t value_bytes = 0;
  // The bytes a str or class reference node holds, as the pickle budget counts them.
  size_t text_bytes(const Node& n) const {
    if (n.kind == Kind::Str) return n.count;
    if (n.kind == Kind::ClassRef) return refs[n.count].first.size() + refs[n.count].second.size();
    return 0;
  }
};

struct GiveUp {};  // not the plain shape: read it the general way
// The non-tensor values would take more than Tree::max_value_bytes: an error the general way
// would only reach after building them, so read_fast lets it through.
struct OverBudget {
  size_t limit;
};

/// GiveUp when the dict node `d` repeats a key: Python keeps the key's first place and its
/// last value, which the general reader reproduces.
inline void check_unique_keys(const Tree& t, const Node& d) {
  const uint32_t n = d.count / 2;
  const auto key = [&](uint32_t k) { return t.nodes[t.kids[d.first + 2 * k]].s(); };
  if (n <= kScanKeys) {
    for (uint32_t a = 1; a < n; ++a) {
      for (uint32_t b = 0; b < a; ++b) {
        if (key(a) == key(b)) throw GiveUp{};
      }
    }
    return;
  }
  std::unordered_set<std::string_view> seen;
  seen.reserve(n);
  for (uint32_t k = 0; k < n; ++k) {
    if (!seen.insert(key(k)).second) throw GiveUp{};
  }
}

// A node of the arena as metadata_reader.h reads trees.
struct Ref {
  const Tree* tree;
  uint32_t index;
  const Node& node() const { return tree->nodes[index]; }
};

class Items {
 public:
  Items(const Tree* t, const Node& n) : t_(t), first_(n.first), count_(n.count) {}
  size_t size() const { return count_; }
  Ref operator[](size_t i) const { return {t_, t_->kids[first_ + i]}; }
  class iterator {
   public:
    iterator(const Items& items, size_t i) : items_(items), i_(i) {}
    Ref operator*() const { return items_[i_]; }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator!=(const iterator& o) const { return i_ != o.i_; }

   private:
    const Items& items_;
    size_t i_;
  };
  iterator begin() const { return {*this, 0}; }
  iterator end() const { return {*this, count_}; }

 private:
  const Tree* t_;
  uint32_t first_, count_;
};

class Members {
 public:
  explicit Members(Items items) : items_(items) {}
  class iterator {
   public:
    iterator(const Items& items, size_t i) : items_(items), i_(i) {}
    std::pair<std::string_view, Ref> operator*() const {
      return {items_[i_].node().s(), items_[i_ + 1]};
    }
    iterator& operator++() {
      i_ += 2;
      return *this;
    }
    bool operator!=(const iterator& o) const { return i_ != o.i_; }

   private:
    const Items& items_;
    size_t i_;
  };
  iterator begin() const { return {items_, 0}; }
  iterator end() const { return {items_, items_.size()}; }

 private:
  Items items_;
};

/// What to_json(r) allocates, as parse_json's budget counts it (core/json_text.h).
inline size_t json_cost(const Ref& r) {
  const Node& n = r.node();
  size_t bytes = sizeof(JsonValue);
  if (n.kind == Kind::Str) {
    if (n.count > JsonValue::kInlineString) bytes += n.count + 1 + kSharedNodeBytes;
  } else if (n.kind == Kind::List || n.kind == Kind::Tuple || n.kind == Kind::Dict) {
    bytes += kSharedNodeBytes;
    const bool dict = n.kind == Kind::Dict;
    const Items items(r.tree, n);
    for (size_t i = 0; i < items.size(); ++i) {
      const Ref e = items[i];
      if (dict && i % 2 == 0) {  // a key, held in the map entry
        bytes += sizeof(JsonValue::Map::value_type) - sizeof(JsonValue);
        if (e.node().count > JsonValue::kInlineString) bytes += e.node().count + 1;
        continue;
      }
      bytes += json_cost(e);
    }
  }
  return bytes;
}

inline JsonValue to_json(const Ref& r) {
  const Node& n = r.node();
  switch (n.kind) {
    case Kind::None: return JsonValue();
    case Kind::Bool: return JsonValue(n.b);
    case Kind::Int: return JsonValue(n.i);
    case Kind::Float: return JsonValue(n.f);
    case Kind::Str: {
      if (!n.b) return JsonValue(n.s());
      auto [it, fresh] = r.tree->shared_strings.try_emplace(r.index);
      if (fresh) it->second = JsonValue(n.s());
      return it->second;
    }
    case Kind::List:
    case Kind::Tuple: {
      JsonValue::List out;
      out.reserve(n.count);
      for (const Ref& e : Items(r.tree, n)) out.push_back(to_json(e));
      return JsonValue(std::move(out));
    }
    case Kind::Dict: {
      JsonValue::Map out;
      out.reserve(n.count / 2);
      for (const auto& [k, e] : Members(Items(r.tree, n))) out.emplace_back(k, to_json(e));
      return JsonValue(std::move(out));
    }
    case Kind::ClassRef: throw GiveUp{};  // refused outside "cls": the general way says so
  }
  throw GiveUp{};
}

// A class reference in a value the reader skips (the general way refuses it, naming where);
// everywhere else the reader's own type checks meet it.
inline void check_class_refs(const Ref& r) {
  const Node& n = r.node();
  if (n.kind == Kind::ClassRef) throw GiveUp{};
  if (n.kind == Kind::List || n.kind == Kind::Tuple || n.kind == Kind::Dict) {
    for (const Ref& e : Items(r.tree, n)) check_class_refs(e);
  }
}

struct Traits {
  using Value = Ref;
  using Members = tree::Members;
  static bool is_null(const Ref& v) { return v.node().kind == Kind::None; }
  static bool is_bool(const Ref& v) { return v.node().kind == Kind::Bool; }
  static bool is_int(const Ref& v) { return v.node().kind == Kind::Int; }
  static bool is_number(const Ref& v) { return is_int(v) || v.node().kind == Kind::Float; }
  static bool is_string(const Ref& v) { return v.node().kind == Kind::Str; }
  static bool is_list(const Ref& v) {
    return v.node().kind == Kind::List || v.node().kind == Kind::Tuple;
  }
  static bool is_plain_list(const Ref& v) { return v.node().kind == Kind::List; }
  static bool is_map(const Ref& v) { return v.node().kind == Kind::Dict; }
  static bool is_class_ref(const Ref& v) { return v.node().kind == Kind::ClassRef; }
  static std::string class_name(const Ref& v) {
    const auto& [module, qualname] = v.tree->refs[v.node().count];
    std::string out;
    out.reserve(module.size() + 1 + qualname.size());
    return out.append(module).append(1, '.').append(qualname);
  }
  static bool as_bool(const Ref& v) { return v.node().b; }
  static int64_t as_int(const Ref& v) { return v.node().i; }
  static std::string as_string(const Ref& v) { return std::string(v.node().s()); }
  static Items items(const Ref& v) { return Items(v.tree, v.node()); }
  static Members members(const Ref& v) { return Members(Items(v.tree, v.node())); }
  static JsonValue to_json(const Ref& v) {
    if (v.tree->max_value_bytes != SIZE_MAX) {  // measured before it is built
      v.tree->value_bytes += json_cost(v);
      if (v.tree->value_bytes > v.tree->max_value_bytes) throw OverBudget{v.tree->max_value_bytes};
    }
    return tree::to_json(v);
  }
  static std::string excerpt(const Ref&) { throw GiveUp{}; }  // an error: the general way's text
  static void ignored(const Ref& v) { check_class_refs(v); }
};

/// Parses `input` (JSON text when `json`, else a pickle) into the calling thread's arena with
/// `parse(input, tree)` (the root node's index) and reads it as validated metadata; nullopt
/// where the general reader must read it
/// (the parser or the reader gave up, or failed). The arena is kept per thread: fresh pages for
/// it would cost more than the parse; one that a large input grew is given back after use.
/// `max_value_bytes` bounds the non-tensor values it builds: OverBudget past it.
template <typename Parse>
std::optional<ValidatedMetadata> read_fast(std::string_view input, bool json, Parse&& parse,
                                           size_t max_value_bytes = SIZE_MAX) {
  constexpr size_t kKeptNodes = size_t{1} << 16;
  thread_local Tree tree;
  tree.max_value_bytes = max_value_bytes;
  tree.value_bytes = 0;
  struct Reset {
    ~Reset() {
      tree.nodes.clear();
      tree.kids.clear();
      tree.refs.clear();
      tree.shared_strings.clear();
      tree.max_value_bytes = SIZE_MAX;
      if (tree.nodes.capacity() > kKeptNodes) tree = Tree{};
    }
  } reset;
  try {
    // Room for a node per input byte (a bound), reserved but untouched until used: the arena
    // never moves, so its peak is what it holds, as the readers' budgets count it.
    tree.nodes.reserve(input.size());
    tree.kids.reserve(input.size());
    const uint32_t root = parse(input, tree);
    const Ref top{&tree, root};
    if (!Traits::is_map(top)) return std::nullopt;
    TransportFields transport;
    Metadata m = reader::read_root<Traits>(top, &transport, json);
    return validated(std::move(m), std::move(transport));
  } catch (const GiveUp&) {
  } catch (const c10::Error&) {
  }
  return std::nullopt;
}

}  // namespace tensordict::core::tree

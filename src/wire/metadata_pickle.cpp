// Metadata <-> pickle (docs/wire-format.md §4.2, §4.4). Written straight from Metadata, opcode by
// opcode, the bytes Python's pickler writes for the reference's dict. Read through the restricted
// reader, then by the reader metadata_from_json uses (metadata_reader.h), so that a peer's pickle
// gets the same errors and bounds, and validated once. A node's "cls" may be a class reference
// (the reference's tensorclass nodes): the node is read as a TensorDict node and Metadata::cls
// records "module.qualname"; a class reference anywhere else is a ValueError. We never write
// class references (a node with one is written as "TensorDict").

#include "wire/metadata_pickle.h"

#include <algorithm>
#include <bit>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "core/bytes.h"
#include "core/excerpt.h"
#include "core/json_text.h"
#include "core/metadata.h"
#include "core/metadata_reader.h"
#include "core/metadata_tree.h"
#include "tensordict/dtypes.h"

namespace tensordict::wire {
namespace {

using pickle::Value;

// ---- writer -----------------------------------------------------------------------------------

// Strings leave as Python str, so they must be UTF-8 (Python's pickle would refuse them too).
void write_str(pickle::Writer& w, std::string_view s) {
  TORCH_CHECK_VALUE(core::valid_utf8(s), "metadata_to_pickle: the string ", core::quoted_excerpt(s),
                    " is not valid UTF-8");
  w.str(s);
}

void write_ints(pickle::Writer& w, const std::vector<int64_t>& v) {
  w.list_open(v.size());
  for (int64_t d : v) w.integer(d);
  w.list_close(v.size());
}

void write_optional(pickle::Writer& w, const std::optional<std::string>& s) {
  if (s) {
    write_str(w, *s);
  } else {
    w.none();
  }
}

// A non-tensor entry's data: the Python value json.loads would give (lists, str-keyed dicts).
void write_json(pickle::Writer& w, const JsonValue& j) {
  if (j.is_null()) {
    w.none();
  } else if (j.is_bool()) {
    w.boolean(j.as_bool());
  } else if (j.is_int()) {
    w.integer(j.as_int());
  } else if (j.is_float()) {
    w.floating(j.as_float());
  } else if (j.is_string()) {
    write_str(w, j.as_string());
  } else if (j.is_list()) {
    w.list_open(j.as_list().size());
    for (const auto& e : j.as_list()) write_json(w, e);
    w.list_close(j.as_list().size());
  } else {
    w.dict_open(j.as_map().size());
    for (const auto& [k, e] : j.as_map()) {
      write_str(w, k);
      write_json(w, e);
    }
    w.dict_close(j.as_map().size());
  }
}

// One node as the reference's dict: cls, non_tensors, leaves, cls_metadata, then the nested
// nodes, then (at the root) the transport fields: metadata_to_json's order.
void write_node(pickle::Writer& w, const Metadata& m, const TransportFields* transport) {
  const size_t n = 4 + m.children.size() + (transport ? transport->size() : 0);
  w.dict_open(n);
  w.str("cls");
  write_str(w, core::is_class_reference_name(m.cls) ? std::string_view("TensorDict")
                                                    : std::string_view(m.cls));
  w.str("non_tensors");
  w.dict_open(m.non_tensors.size());
  for (const auto& [key, nt] : m.non_tensors) {
    write_str(w, key);
    // A MetaData as a list, a NonTensorData as the tuple the reference writes: a Python
    // reader unpacks both alike (docs/wire-format.md §3.7).
    if (nt.metadata) {
      w.list_open(3);
    } else {
      w.tuple_open(3);
    }
    write_json(w, nt.data);
    write_ints(w, nt.batch_size);
    write_optional(w, nt.device);
    if (nt.metadata) {
      w.list_close(3);
    } else {
      w.tuple_close(3);
    }
  }
  w.dict_close(m.non_tensors.size());
  w.str("leaves");
  w.dict_open(m.leaves.size());
  for (const auto& [key, l] : m.leaves) {
    write_str(w, key);
    w.tuple_open(5);
    w.str(dtype_name(l.dtype));
    write_ints(w, l.shape);
    w.integer(l.start);
    w.integer(l.stop);
    w.integer(l.pad);
    w.tuple_close(5);
  }
  w.dict_close(m.leaves.size());
  w.str("cls_metadata");
  const auto& cm = m.cls_metadata;
  if (m.is_stack()) {  // the reference's LazyStackedTensorDict._reduce_get_metadata
    w.dict_open(3);
    w.str("stack_dim");
    w.integer(cm.stack_dim);
    w.str("stack_dim_name");
    write_optional(w, cm.stack_dim_name);
    w.str("is_locked");
    w.boolean(cm.is_locked);
    w.dict_close(3);
  } else {
    w.dict_open(4);
    w.str("device");
    write_optional(w, cm.device);
    w.str("names");
    w.list_open(cm.names.size());
    for (const auto& name : cm.names) write_optional(w, name);
    w.list_close(cm.names.size());
    w.str("batch_size");
    write_ints(w, cm.batch_size);
    w.str("is_locked");
    w.boolean(cm.is_locked);
    w.dict_close(4);
  }
  for (const auto& [key, child] : m.children) {
    write_str(w, key);
    write_node(w, child, nullptr);
  }
  if (transport) {
    for (const auto& [key, value] : *transport) {
      write_str(w, key);
      std::visit(
          [&](const auto& v) {
            using T = std::decay_t<decltype(v)>;
            if constexpr (std::is_same_v<T, std::nullptr_t>) {
              w.none();
            } else if constexpr (std::is_same_v<T, bool>) {
              w.boolean(v);
            } else if constexpr (std::is_same_v<T, int64_t>) {
              w.integer(v);
            } else {
              write_str(w, v);
            }
          },
          value);
    }
  }
  w.dict_close(n);
}

// ---- reader -----------------------------------------------------------------------------------

// One step into a peer's dict: a key, or a list position when key is null. Rendered only for
// an error message, so that walking a large tree costs no string per value.
struct Step {
  const std::string* key;
  size_t index;
};
using Path = std::vector<Step>;

// Where a value sits in a peer's dict, as Python subscripts: ["inner"]["leaves"]["q"][0].
std::string where(const Path& path) {
  std::string out;
  for (const auto& [key, index] : path) {
    out += key ? c10::str("[\"", core::excerpt(*key), "\"]") : c10::str("[", index, "]");
  }
  return out.empty() ? std::string("the top level") : out;
}

std::string class_name(const Value& ref) { return ref.ref_module() + "." + ref.ref_qualname(); }

// Refuses a class reference anywhere but a node's "cls", before anything is read: a node is the
// root or a dict under a node key other than "non_tensors", "leaves" and "cls_metadata".
void refuse_class_refs(const Value& v, Path& path, bool is_node) {
  switch (v.kind()) {
    case Value::Kind::ClassRef:
      TORCH_CHECK_VALUE(false, "metadata: the class reference ", core::excerpt(class_name(v)),
                        " at ", where(path), " is refused: only a node's \"cls\" may name a class");
    case Value::Kind::List:
    case Value::Kind::Tuple:
      for (size_t i = 0; i < v.items().size(); ++i) {
        path.push_back({nullptr, i});
        refuse_class_refs(v.items()[i], path, false);
        path.pop_back();
      }
      return;
    case Value::Kind::Dict:
      for (size_t i = 0; i < v.keys().size(); ++i) {
        const std::string& key = v.keys()[i];
        const Value& e = v.values()[i];
        if (is_node && key == "cls" && e.kind() == Value::Kind::ClassRef) continue;
        path.push_back({&key, 0});
        refuse_class_refs(e, path,
                          is_node && e.kind() == Value::Kind::Dict && key != "non_tensors" &&
                              key != "leaves" && key != "cls_metadata");
        path.pop_back();
      }
      return;
    default: return;
  }
}

// A peer's unpickled values as JSON-like values (a non-tensor entry's data, and messages):
// tuples become lists, as JSON makes them. refuse_class_refs has run: none is left here.
JsonValue to_json(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::None: return JsonValue();
    case Value::Kind::Bool: return JsonValue(v.as_bool());
    case Value::Kind::Int: return JsonValue(v.as_int());
    case Value::Kind::Float: return JsonValue(v.as_float());
    case Value::Kind::Str: return JsonValue(v.as_str());
    case Value::Kind::List:
    case Value::Kind::Tuple: {
      JsonValue::List out;
      out.reserve(v.items().size());
      for (const auto& e : v.items()) out.push_back(to_json(e));
      return JsonValue(std::move(out));
    }
    case Value::Kind::Dict: {
      JsonValue::Map out;
      out.reserve(v.keys().size());
      for (size_t i = 0; i < v.keys().size(); ++i) {
        out.emplace_back(v.keys()[i], to_json(v.values()[i]));
      }
      return JsonValue(std::move(out));
    }
    case Value::Kind::ClassRef: return JsonValue(class_name(v));  // messages only
  }
  TORCH_INTERNAL_ASSERT(false);
}

// A dict's entries as (key, value) pairs, the way metadata_reader.h iterates a map.
class DictMembers {
 public:
  explicit DictMembers(const Value& d) : d_(d) {}
  class iterator {
   public:
    iterator(const Value& d, size_t i) : d_(d), i_(i) {}
    std::pair<const std::string&, const Value&> operator*() const {
      return {d_.keys()[i_], d_.values()[i_]};
    }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator!=(const iterator& o) const { return i_ != o.i_; }

   private:
    const Value& d_;
    size_t i_;
  };
  iterator begin() const { return {d_, 0}; }
  iterator end() const { return {d_, d_.keys().size()}; }

 private:
  const Value& d_;
};

// An unpickled tree as metadata_reader.h reads trees: tuples and lists alike are JSON arrays.
struct PickleTraits {
  using Value = pickle::Value;
  using Members = DictMembers;
  using Kind = Value::Kind;
  static bool is_null(const Value& v) { return v.kind() == Kind::None; }
  static bool is_bool(const Value& v) { return v.kind() == Kind::Bool; }
  static bool is_int(const Value& v) { return v.kind() == Kind::Int; }
  static bool is_number(const Value& v) { return is_int(v) || v.kind() == Kind::Float; }
  static bool is_string(const Value& v) { return v.kind() == Kind::Str; }
  static bool is_list(const Value& v) { return v.kind() == Kind::List || v.kind() == Kind::Tuple; }
  static bool is_plain_list(const Value& v) { return v.kind() == Kind::List; }
  static bool is_map(const Value& v) { return v.kind() == Kind::Dict; }
  static bool is_class_ref(const Value& v) { return v.kind() == Kind::ClassRef; }
  static std::string class_name(const Value& v) { return wire::class_name(v); }
  static bool as_bool(const Value& v) { return v.as_bool(); }
  static int64_t as_int(const Value& v) { return v.as_int(); }
  static const std::string& as_string(const Value& v) { return v.as_str(); }
  static const std::vector<Value>& items(const Value& v) { return v.items(); }
  static Members members(const Value& v) { return DictMembers(v); }
  static void ignored(const Value&) {}  // refuse_class_refs saw every value first
  static JsonValue to_json(const Value& v) { return wire::to_json(v); }
  static std::string excerpt(const Value& v) { return core::json_excerpt(to_json(v)); }
};

// ---- fast path --------------------------------------------------------------------------------
// The metadata pickles Python's pickler and ours write, read without building pickle::Values:
// strings stay views of the input, containers are ranges of an arena, memo entries are node
// numbers. It takes only the plain shape (no class reference outside "cls", no GET of a
// container, no duplicate key, no GLOBAL), applies pickle::loads' bounds on nesting and
// values, and gives up on anything else: read_validated then reads the pickle the general way,
// which also makes every error message. It builds the same metadata from what both accept.
//
// Its memory budget counts what it really builds (a node, an arena slot, a memo slot; strings
// are views of the input), not the general reader's charges (256 bytes a value, memo copies
// whole): the reference's 6.9 MB pickle of a lazy stack of 100,000 members is charged 745 MB
// there and read here with a peak of 144 MB, the metadata built included. So it reads dicts
// the general budget refuses, within kFastBytesPerInputByte per byte of input and
// kMaxFastBytes in all (tests/python/test_hostile_inputs.py). It reads only a pickle whose
// first value is a dict; anything else goes the general way at once, under its budget.

namespace fast {

inline constexpr size_t kFastBytesPerInputByte = 24;
inline constexpr size_t kMaxFastBytes = size_t{512} << 20;

using core::tree::GiveUp;
using core::tree::Kind;
using core::tree::Node;
using core::tree::node_of;
using core::tree::Tree;

class Parser {
 public:
  Parser(std::string_view data, const pickle::Limits& limits, Tree& tree)
      : in_(data),
        limits_(limits),
        budget_(limits.max_bytes != 0
                    ? limits.max_bytes
                    : std::min(kMaxFastBytes,
                               pickle::kBaseBudgetBytes + kFastBytesPerInputByte * data.size())),
        tree_(tree) {}

  uint32_t run() {
    while (true) {
      if (!in_.has(1)) throw GiveUp{};
      const uint8_t code = in_.u8();
      switch (code) {
        case 0x80: {  // PROTO
          const uint8_t v = u8();
          if (v < 2 || v > 5) throw GiveUp{};
          break;
        }
        case 0x95: {  // FRAME
          if (le(8) > in_.left()) throw GiveUp{};
          break;
        }
        case '.':  // STOP
          if (stack_.size() != 1 || !marks_.empty() || in_.left() != 0) throw GiveUp{};
          check_unique_keys();
          return stack_.back();
        case 'N': push(Node{}); break;
        case 0x88:
        case 0x89: {  // NEWTRUE, NEWFALSE
          Node n = node_of(Kind::Bool);
          n.b = code == 0x88;
          push(n);
          break;
        }
        case 'K': push_int(static_cast<int64_t>(le(1))); break;
        case 'M': push_int(static_cast<int64_t>(le(2))); break;
        case 'J': push_int(static_cast<int32_t>(static_cast<uint32_t>(le(4)))); break;
        case 0x8a: {  // LONG1
          const uint8_t n = u8();
          if (n > 8) throw GiveUp{};
          uint64_t u = n ? le(n) : 0;
          if (n && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~uint64_t{0} << (8 * n);
          push_int(static_cast<int64_t>(u));
          break;
        }
        case 'G': {  // BINFLOAT
          if (!in_.has(8)) throw GiveUp{};
          Node n = node_of(Kind::Float);
          n.f = std::bit_cast<double>(in_.be(8));
          push(n);
          break;
        }
        case 0x8c: push_str(le(1)); break;  // SHORT_BINUNICODE
        case 'X': push_str(le(4)); break;   // BINUNICODE
        case 0x8d: push_str(le(8)); break;  // BINUNICODE8
        case ']': push(node_of(Kind::List)); break;
        case '}': push(node_of(Kind::Dict)); break;
        case ')': push(node_of(Kind::Tuple)); break;
        case '(':  // MARK
          if (marks_.size() >= limits_.max_depth * 4) throw GiveUp{};
          marks_.push_back(stack_.size());
          break;
        case 'l': collect(Kind::List, pop_mark()); break;
        case 't': collect(Kind::Tuple, pop_mark()); break;
        case 0x85:
        case 0x86:
        case 0x87: {  // TUPLE1..3
          const size_t n = code - 0x85 + 1;
          if (stack_.size() < n + floor()) throw GiveUp{};
          collect(Kind::Tuple, stack_.size() - n);
          break;
        }
        case 'a':  // APPEND
          if (stack_.size() < 2 + floor()) throw GiveUp{};
          extend(Kind::List, stack_.size() - 1);
          break;
        case 'e': extend(Kind::List, pop_mark()); break;  // APPENDS
        case 's':                                         // SETITEM
          if (stack_.size() < 3 + floor()) throw GiveUp{};
          extend(Kind::Dict, stack_.size() - 2);
          break;
        case 'u': extend(Kind::Dict, pop_mark()); break;  // SETITEMS
        case 0x93: stack_global(); break;                 // STACK_GLOBAL
        case 0x94: memo_put(memo_count_); break;          // MEMOIZE
        case 'q': memo_put(le(1)); break;                 // BINPUT
        case 'r': memo_put(le(4)); break;                 // LONG_BINPUT
        case 'h': memo_get(le(1)); break;                 // BINGET
        case 'j': memo_get(le(4)); break;                 // LONG_BINGET
        default: throw GiveUp{};
      }
    }
  }

 private:
  uint8_t u8() {
    if (!in_.has(1)) throw GiveUp{};
    return in_.u8();
  }
  uint64_t le(size_t n) {
    if (!in_.has(n)) throw GiveUp{};
    return in_.le(n);
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // pickle::loads' count of values (a GET counted again), and the node this reader makes.
  void value(bool new_node = true) {
    if (++elements_ > limits_.max_elements) throw GiveUp{};
    if (new_node) charge(sizeof(Node));
  }
  void charge(size_t bytes) {
    spent_ += bytes;
    if (spent_ > budget_) throw GiveUp{};
  }
  void push(const Node& n) {
    // Only a dict can be metadata: anything else is read the general way from the start.
    if (tree_.nodes.empty() && n.kind != Kind::Dict) throw GiveUp{};
    value();
    if (tree_.nodes.size() >= UINT32_MAX) throw GiveUp{};
    stack_.push_back(static_cast<uint32_t>(tree_.nodes.size()));
    tree_.nodes.push_back(n);
  }
  void push_int(int64_t v) {
    Node n = node_of(Kind::Int);
    n.i = v;
    push(n);
  }
  void push_str(uint64_t n) {
    if (!in_.has(n)) throw GiveUp{};
    if (n > UINT32_MAX) throw GiveUp{};
    const std::string_view text = in_.take(n);
    if (!core::valid_utf8(text)) throw GiveUp{};
    Node s = node_of(Kind::Str);
    s.p = text.data();
    s.count = static_cast<uint32_t>(n);
    push(s);
  }
  size_t pop_mark() {
    if (marks_.empty()) throw GiveUp{};
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  void adopt(Node& parent, const Node& child) {
    parent.depth = std::max<uint16_t>(parent.depth, static_cast<uint16_t>(child.depth + 1));
    if (parent.depth > limits_.max_depth) throw GiveUp{};
  }
  // Appends the nodes stack_[first, end) to container `c`'s items, one range of the arena. When
  // other containers' items were written after that range and it has no room left, it moves to
  // the end of the arena with room for as many items again: Python's pickler fills a large dict
  // or list 1000 items per SETITEMS / APPENDS, each batch writing its values' items first, and
  // a move per batch would copy a container of n items n^2 / 2000 times.
  void append_items(uint32_t c, size_t first) {
    Node& n = tree_.nodes[c];
    const size_t add = stack_.size() - first;
    const size_t count = n.count + add;
    if (count > UINT32_MAX) throw GiveUp{};
    const auto room_of = room_.find(c);
    size_t room = room_of == room_.end() ? n.count : room_of->second;  // items + free slots
    if (n.first + room != tree_.kids.size() && count > room) {
      room = n.count == 0 ? add : 2 * count;  // room only for a container filled in steps
      if (tree_.kids.size() + room > UINT32_MAX) throw GiveUp{};
      charge(sizeof(uint32_t) * room);
      const auto old = static_cast<uint32_t>(tree_.kids.size());
      tree_.kids.resize(old + room);
      std::copy_n(tree_.kids.begin() + n.first, n.count, tree_.kids.begin() + old);
      n.first = old;
    }
    if (count > room) {  // the range ends the arena: it grows there
      charge(sizeof(uint32_t) * (count - room));
      tree_.kids.resize(n.first + count);
    }
    for (size_t i = first; i < stack_.size(); ++i) {
      adopt(n, tree_.nodes[stack_[i]]);
      tree_.kids[n.first + n.count + (i - first)] = stack_[i];
    }
    n.count = static_cast<uint32_t>(count);
    if (room > count) {
      if (room_of == room_.end()) charge(kRoomEntryBytes);
      room_[c] = static_cast<uint32_t>(room);
    } else if (room_of != room_.end()) {
      room_.erase(room_of);
    }
    stack_.resize(first);
  }
  void collect(Kind kind, size_t first) {
    Node n = node_of(kind);
    value();
    n.first = static_cast<uint32_t>(tree_.kids.size());
    const auto c = static_cast<uint32_t>(tree_.nodes.size());
    tree_.nodes.push_back(n);
    append_items(c, first);
    stack_.push_back(c);
  }
  // APPEND(S) / SETITEM(S) into the container below `first`.
  void extend(Kind kind, size_t first) {
    if (first <= floor() || first == 0) throw GiveUp{};
    const uint32_t c = stack_[first - 1];
    if (tree_.nodes[c].kind != kind) throw GiveUp{};
    if (kind == Kind::Dict) {
      if ((stack_.size() - first) % 2) throw GiveUp{};
      for (size_t i = first; i < stack_.size(); i += 2) {
        if (tree_.nodes[stack_[i]].kind != Kind::Str) throw GiveUp{};
      }
    }
    append_items(c, first);
  }
  // Once, when the pickle is read: a check per SETITEMS would hash a large dict's keys again for
  // each batch of 1000.
  void check_unique_keys() const {
    for (const Node& n : tree_.nodes) {
      if (n.kind == Kind::Dict) core::tree::check_unique_keys(tree_, n);
    }
  }
  void stack_global() {
    if (stack_.size() < 2 + floor()) throw GiveUp{};
    const Node& module = tree_.nodes[stack_[stack_.size() - 2]];
    const Node& name = tree_.nodes[stack_.back()];
    if (module.kind != Kind::Str || name.kind != Kind::Str) throw GiveUp{};
    for (const auto part : {module.s(), name.s()}) {
      if (part.size() > limits_.max_name_bytes || !pickle::valid_dotted_name(part)) {
        throw GiveUp{};
      }
    }
    Node ref = node_of(Kind::ClassRef);
    ref.count = static_cast<uint32_t>(tree_.refs.size());
    tree_.refs.emplace_back(module.s(), name.s());
    stack_.resize(stack_.size() - 2);
    value();
    charge(sizeof(tree_.refs.back()));
    stack_.push_back(static_cast<uint32_t>(tree_.nodes.size()));
    tree_.nodes.push_back(ref);
  }
  void memo_put(uint64_t index) {
    if (stack_.size() <= floor() || memo_count_ >= limits_.max_elements) throw GiveUp{};
    if (index > memo_.size()) throw GiveUp{};  // Python numbers entries in order
    if (index == memo_.size()) {
      charge(sizeof(uint32_t));
      memo_.push_back(stack_.back());
      ++memo_count_;
    } else {
      memo_[index] = stack_.back();
    }
  }
  void memo_get(uint64_t index) {
    if (index >= memo_.size()) throw GiveUp{};
    const uint32_t n = memo_[index];
    const Node& v = tree_.nodes[n];
    if (v.kind == Kind::List || v.kind == Kind::Tuple || v.kind == Kind::Dict) throw GiveUp{};
    value(/*new_node=*/false);
    // A long str read again is built once (metadata_tree.h: Tree::shared_strings).
    if (v.kind == Kind::Str && v.count > JsonValue::kInlineString) tree_.nodes[n].b = true;
    stack_.push_back(n);  // the same immutable node: a str or a scalar
  }
  core::ByteReader in_;
  pickle::Limits limits_;
  size_t budget_;
  Tree& tree_;
  size_t spent_ = 0;
  size_t elements_ = 0;
  uint64_t memo_count_ = 0;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  std::vector<uint32_t> memo_;
  // The arena slots of the containers that have room past their items (append_items).
  std::unordered_map<uint32_t, uint32_t> room_;
  static constexpr size_t kRoomEntryBytes = 32;  // a node of room_, about
};

// The validated metadata of `bytes`, or nullopt where the general way must read them.
std::optional<core::ValidatedMetadata> read(std::string_view bytes) {
  return core::tree::read_fast(bytes, /*json=*/false, [](std::string_view in, Tree& tree) {
    return Parser(in, metadata_pickle_limits(), tree).run();
  });
}

}  // namespace fast

core::ValidatedMetadata read_validated(const pickle::Value& value) {
  TORCH_CHECK_VALUE(value.kind() == pickle::Value::Kind::Dict, "metadata: expected a dict, got a ",
                    pickle::Value::kind_name(value.kind()));
  Path path;
  refuse_class_refs(value, path, /*is_node=*/true);
  TransportFields transport;
  Metadata m = core::reader::read_root<PickleTraits>(value, &transport, /*json=*/false);
  return core::validated(std::move(m), std::move(transport));
}

}  // namespace

std::string metadata_pickle_bytes(const Metadata& metadata, const TransportFields& transport) {
  core::check_written_size(metadata, "metadata pickle");
  std::string out;
  out.reserve(256 + 64 * metadata.leaves.size());
  pickle::Writer w(out);
  write_node(w, metadata, &transport);
  w.finish();
  return out;
}

pickle::Value metadata_to_pickle(const Metadata& metadata, const TransportFields& transport) {
  // Our own bytes: bounded only by what the TensorDict holds.
  return pickle::loads(
      metadata_pickle_bytes(metadata, transport),
      {.max_depth = size_t{1} << 16, .max_elements = SIZE_MAX, .max_bytes = SIZE_MAX});
}

Metadata metadata_from_pickle(const pickle::Value& value, TransportFields* transport) {
  core::ValidatedMetadata v = read_validated(value);
  return std::move(v).take(transport);
}

pickle::Limits metadata_pickle_limits() {
  // The bounds of metadata_from_json, counted on the pickle's containers and values.
  return {.max_depth = core::kMaxMetadataJsonDepth, .max_elements = core::kMaxMetadataJsonValues};
}

Metadata metadata_from_pickle_bytes(std::string_view bytes, TransportFields* transport) {
  core::ValidatedMetadata v = read_metadata_pickle(bytes);
  return std::move(v).take(transport);
}

core::ValidatedMetadata read_metadata_pickle(std::string_view bytes) {
  if (auto fast = fast::read(bytes)) return std::move(*fast);
  return read_validated(pickle::loads(bytes, metadata_pickle_limits()));
}

}  // namespace tensordict::wire

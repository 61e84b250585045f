#include "wire/pickle.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <deque>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "core/bytes.h"
#include "core/excerpt.h"
#include "core/json_text.h"

namespace tensordict::wire::pickle {

using core::append_be;
using core::append_le;

// ---- Value ---------------------------------------------------------------------------------

namespace {

[[noreturn]] void wrong_kind(Value::Kind want, Value::Kind got) {
  TORCH_CHECK_VALUE(false, "pickle: expected a ", Value::kind_name(want), ", got a ",
                    Value::kind_name(got));
}

}  // namespace

const char* Value::kind_name(Kind kind) {
  switch (kind) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::Str: return "str";
    case Kind::List: return "list";
    case Kind::Tuple: return "tuple";
    case Kind::Dict: return "dict";
    case Kind::ClassRef: return "class reference";
  }
  return "?";
}

Value Value::from_bool(bool v) {
  Value r;
  r.kind_ = Kind::Bool;
  r.scalar_.b = v;
  return r;
}
Value Value::from_int(int64_t v) {
  Value r;
  r.kind_ = Kind::Int;
  r.scalar_.i = v;
  return r;
}
Value Value::from_float(double v) {
  Value r;
  r.kind_ = Kind::Float;
  r.scalar_.f = v;
  return r;
}
Value Value::from_str(std::string v) {
  Value r;
  r.kind_ = Kind::Str;
  r.s_ = std::move(v);
  return r;
}
Value Value::list(std::vector<Value> items) {
  Value r;
  r.kind_ = Kind::List;
  r.items_ = std::move(items);
  return r;
}
Value Value::tuple(std::vector<Value> items) {
  Value r;
  r.kind_ = Kind::Tuple;
  r.items_ = std::move(items);
  return r;
}
Value Value::dict() {
  Value r;
  r.kind_ = Kind::Dict;
  return r;
}
Value Value::class_ref(std::string module, std::string qualname) {
  TORCH_CHECK_VALUE(valid_dotted_name(module) && valid_dotted_name(qualname),
                    "pickle: a class reference needs dotted names for its module and qualname");
  Value r;
  r.kind_ = Kind::ClassRef;
  r.s_ = std::move(module);
  r.keys_.push_back(std::move(qualname));
  return r;
}

size_t Value::position(std::string_view key) const {
  if (keys_.size() <= core::kScanKeys) {
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] == key) return i;
    }
    return keys_.size();
  }
  if (!index_ || index_->size() != keys_.size()) {
    index_ = std::make_unique<KeyIndex>();
    index_->reserve(keys_.size());
    for (size_t i = 0; i < keys_.size(); ++i) index_->emplace(keys_[i], i);
  }
  auto it = index_->find(key);
  return it == index_->end() ? keys_.size() : it->second;
}

bool Value::as_bool() const {
  if (kind_ != Kind::Bool) wrong_kind(Kind::Bool, kind_);
  return scalar_.b;
}
int64_t Value::as_int() const {
  if (kind_ != Kind::Int) wrong_kind(Kind::Int, kind_);
  return scalar_.i;
}
double Value::as_float() const {
  if (kind_ == Kind::Int) return static_cast<double>(scalar_.i);
  if (kind_ != Kind::Float) wrong_kind(Kind::Float, kind_);
  return scalar_.f;
}
const std::string& Value::as_str() const {
  if (kind_ != Kind::Str) wrong_kind(Kind::Str, kind_);
  return s_;
}
const std::string& Value::ref_module() const {
  if (kind_ != Kind::ClassRef) wrong_kind(Kind::ClassRef, kind_);
  return s_;
}
const std::string& Value::ref_qualname() const {
  if (kind_ != Kind::ClassRef) wrong_kind(Kind::ClassRef, kind_);
  return keys_.front();
}
const std::vector<Value>& Value::items() const {
  if (kind_ != Kind::List && kind_ != Kind::Tuple) wrong_kind(Kind::List, kind_);
  return items_;
}
std::vector<Value>& Value::items() {
  if (kind_ != Kind::List && kind_ != Kind::Tuple) wrong_kind(Kind::List, kind_);
  return items_;
}
const std::vector<std::string>& Value::keys() const {
  if (kind_ != Kind::Dict) wrong_kind(Kind::Dict, kind_);
  return keys_;
}
const std::vector<Value>& Value::values() const {
  if (kind_ != Kind::Dict) wrong_kind(Kind::Dict, kind_);
  return items_;
}
const Value* Value::find(std::string_view key) const {
  if (kind_ != Kind::Dict) wrong_kind(Kind::Dict, kind_);
  const size_t i = position(key);
  return i == keys_.size() ? nullptr : &items_[i];
}
Value& Value::set(std::string key, Value value) {
  if (kind_ != Kind::Dict) wrong_kind(Kind::Dict, kind_);
  if (const size_t i = position(key); i != keys_.size()) {
    items_[i] = std::move(value);
    return items_[i];
  }
  if (index_) index_->emplace(key, keys_.size());
  keys_.push_back(std::move(key));
  items_.push_back(std::move(value));
  return items_.back();
}
std::string Value::take_str() {
  if (kind_ != Kind::Str) wrong_kind(Kind::Str, kind_);
  return std::move(s_);
}
void Value::reserve(size_t n) {
  if (kind_ == Kind::Dict) keys_.reserve(keys_.size() + n);
  items_.reserve(items_.size() + n);
}
bool Value::erase(std::string_view key) {
  if (kind_ != Kind::Dict) wrong_kind(Kind::Dict, kind_);
  const size_t pos = position(key);
  if (pos == keys_.size()) return false;
  keys_.erase(keys_.begin() + static_cast<std::ptrdiff_t>(pos));
  items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(pos));
  index_.reset();  // positions moved: rebuilt on the next lookup
  return true;
}

bool operator==(const Value& a, const Value& b) {
  if (a.kind_ != b.kind_) return false;
  switch (a.kind_) {
    case Value::Kind::None: return true;
    case Value::Kind::Bool: return a.scalar_.b == b.scalar_.b;
    case Value::Kind::Int: return a.scalar_.i == b.scalar_.i;
    case Value::Kind::Float: return a.scalar_.f == b.scalar_.f;
    case Value::Kind::Str: return a.s_ == b.s_;
    case Value::Kind::List:
    case Value::Kind::Tuple: return a.items_ == b.items_;
    case Value::Kind::Dict: return a.keys_ == b.keys_ && a.items_ == b.items_;
    case Value::Kind::ClassRef: return a.s_ == b.s_ && a.keys_ == b.keys_;
  }
  return false;
}

// ---- opcodes ----------------------------------------------------------------------------------

namespace {

namespace op {
constexpr uint8_t MARK = '(', STOP = '.', BININT = 'J', BININT1 = 'K', BININT2 = 'M', NONE = 'N',
                  BINUNICODE = 'X', APPEND = 'a', EMPTY_DICT = '}', APPENDS = 'e', BINGET = 'h',
                  LONG_BINGET = 'j', LIST = 'l', DICT = 'd', EMPTY_LIST = ']', BINPUT = 'q',
                  LONG_BINPUT = 'r', SETITEM = 's', TUPLE = 't', EMPTY_TUPLE = ')', SETITEMS = 'u',
                  BINFLOAT = 'G', PROTO = 0x80, TUPLE1 = 0x85, TUPLE2 = 0x86, TUPLE3 = 0x87,
                  NEWTRUE = 0x88, NEWFALSE = 0x89, LONG1 = 0x8a, SHORT_BINUNICODE = 0x8c,
                  BINUNICODE8 = 0x8d, MEMOIZE = 0x94, FRAME = 0x95, GLOBAL = 'c',
                  STACK_GLOBAL = 0x93;
}  // namespace op

// Opcodes that would build objects of arbitrary classes or call functions. (GLOBAL and
// STACK_GLOBAL only name a class: the reader keeps that name as an inert Kind::ClassRef, which
// nothing here can call, since every opcode that would is refused.)
const char* dangerous_name(uint8_t code) {
  switch (code) {
    case 'R': return "REDUCE";
    case 'b': return "BUILD";
    case 'i': return "INST";
    case 'o': return "OBJ";
    case 0x81: return "NEWOBJ";
    case 0x92: return "NEWOBJ_EX";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 0x82:
    case 0x83:
    case 0x84: return "EXT";
    default: return nullptr;
  }
}

// ---- writer -----------------------------------------------------------------------------------

void write_value(Writer& w, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::None: w.none(); return;
    case Value::Kind::Bool: w.boolean(v.as_bool()); return;
    case Value::Kind::Int: w.integer(v.as_int()); return;
    case Value::Kind::Float: w.floating(v.as_float()); return;
    case Value::Kind::Str: w.str(v.as_str()); return;
    case Value::Kind::List:
      w.list_open(v.items().size());
      for (const auto& item : v.items()) write_value(w, item);
      w.list_close(v.items().size());
      return;
    case Value::Kind::Tuple:
      w.tuple_open(v.items().size());
      for (const auto& item : v.items()) write_value(w, item);
      w.tuple_close(v.items().size());
      return;
    case Value::Kind::Dict:
      w.dict_open(v.keys().size());
      for (size_t i = 0; i < v.keys().size(); ++i) {
        w.str(v.keys()[i]);
        write_value(w, v.values()[i]);
      }
      w.dict_close(v.keys().size());
      return;
    case Value::Kind::ClassRef: w.class_ref(v.ref_module(), v.ref_qualname()); return;
  }
}

// ---- reader -----------------------------------------------------------------------------------

// The memo indices that some GET reads, from a first pass over the opcodes. Python memoizes
// every container, so without this each finished container would be copied into its parent
// in case a GET wanted it later: O(depth x size). An opcode this pass does not know, or a
// truncated argument, makes it answer "all": the reader then keeps every entry, and reports
// the fault itself where it finds it.
struct MemoReads {
  bool all = false;
  bool over_budget = false;  // more distinct GETs than the budget allows to index
  std::unordered_set<uint64_t> indices;
  bool contains(uint64_t i) const { return all || indices.contains(i); }
};

MemoReads memo_reads(std::string_view data, size_t max_indices) {
  MemoReads reads;
  size_t pos = 0;
  const auto le = [&](size_t n, uint64_t& v) {  // false when truncated
    if (data.size() - pos < n) return false;
    v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(data[pos + i])} << (8 * i);
    pos += n;
    return true;
  };
  const auto skip = [&](uint64_t n) {
    if (data.size() - pos < n) return false;
    pos += n;
    return true;
  };
  const auto line = [&] {
    const size_t nl = data.find('\n', pos);
    if (nl == std::string_view::npos) return false;
    pos = nl + 1;
    return true;
  };
  uint64_t v = 0;
  while (pos < data.size()) {
    bool ok = true;
    switch (static_cast<uint8_t>(data[pos++])) {
      case op::STOP: return reads;
      case op::PROTO:
      case op::BININT1:
      case op::BINPUT: ok = skip(1); break;
      case op::BININT2: ok = skip(2); break;
      case op::BININT:
      case op::LONG_BINPUT: ok = skip(4); break;
      case op::FRAME:
      case op::BINFLOAT: ok = skip(8); break;
      case op::LONG1:
      case op::SHORT_BINUNICODE: ok = le(1, v) && skip(v); break;
      case op::BINUNICODE: ok = le(4, v) && skip(v); break;
      case op::BINUNICODE8: ok = le(8, v) && skip(v); break;
      case op::GLOBAL: ok = line() && line(); break;
      case op::BINGET:
      case op::LONG_BINGET:
        ok = le(data[pos - 1] == static_cast<char>(op::BINGET) ? 1 : 4, v);
        if (ok) reads.indices.insert(v);
        if (reads.indices.size() > max_indices) {
          reads.over_budget = true;
          return reads;
        }
        break;
      case op::NONE:
      case op::NEWTRUE:
      case op::NEWFALSE:
      case op::EMPTY_LIST:
      case op::EMPTY_DICT:
      case op::EMPTY_TUPLE:
      case op::MARK:
      case op::LIST:
      case op::TUPLE:
      case op::TUPLE1:
      case op::TUPLE2:
      case op::TUPLE3:
      case op::DICT:
      case op::APPEND:
      case op::APPENDS:
      case op::SETITEM:
      case op::SETITEMS:
      case op::STACK_GLOBAL:
      case op::MEMOIZE: break;
      default: ok = false;
    }
    if (!ok) break;
  }
  reads.all = true;  // no STOP reached: let the reader find what is wrong
  return reads;
}

// The bookkeeping that bounds what a reader may build, for a value and everything inside it.
struct Cost {
  size_t depth = 0;  // container nesting, 0 for scalars
  size_t nodes = 1;  // values inside, itself included
  size_t bytes = 0;  // what the value costs in memory, everything inside included (budget)
};

// A value the memo holds for a later GET: shared with the stack, since the container may be
// filled after it was memoized. Only entries some GET reads (MemoReads) are kept.
struct Shared {
  Value value;
  Cost cost;
};

// A value on the stack: held in place, or (once memoized for a GET) in a Shared.
struct Node {
  Value value;
  Cost cost;
  std::shared_ptr<Shared> shared;
};

// What the reader charges its byte budget, close to what each piece costs in memory.
constexpr size_t kValueBytes = detail::kValueCharge;  // a value on the stack, with overhead
static_assert(sizeof(Node) + 32 <= kValueBytes);
constexpr size_t kDictEntryBytes = detail::kDictEntryCharge;  // a key's entry, beyond its bytes
constexpr size_t kMemoIndexBytes = detail::kMemoIndexCharge;  // a memo index a GET reads
// Memo indices below this are tracked in a bitmap; a sparse set takes the (odd) larger ones.
constexpr uint64_t kDenseMemo = uint64_t{1} << 24;

class Reader {
 public:
  Reader(std::string_view data, const Limits& limits)
      : in_(data),
        limits_(limits),
        budget_(detail::read_budget(data, limits)),
        reads_(memo_reads(data, budget_ / kMemoIndexBytes)) {
    TORCH_CHECK_VALUE(!reads_.over_budget, "pickle: ", over_budget_text());
    charge(reads_.indices.size() * kMemoIndexBytes);
  }

  Value run() {
    while (true) {
      const size_t at = in_.pos();
      const uint8_t code = u8();
      switch (code) {
        case op::PROTO: {
          const uint8_t v = u8();
          fail_if(v < 2 || v > 5, at, "unsupported protocol ", int(v));
          break;
        }
        case op::FRAME: {
          const uint64_t n = le(8);
          fail_if(!in_.has(n), at, "truncated pickle: frame of ", n, " bytes runs past the end");
          break;
        }
        case op::STOP: {
          fail_if(stack_.size() != 1 || !marks_.empty(), at, "STOP with ", stack_.size(),
                  " values on the stack");
          fail_if(in_.left() != 0, at, in_.left(), " bytes after STOP");
          return take(stack_.back());
        }
        case op::NONE: push(Value()); break;
        case op::NEWTRUE: push(Value::from_bool(true)); break;
        case op::NEWFALSE: push(Value::from_bool(false)); break;
        case op::BININT1: push(Value::from_int(static_cast<int64_t>(le(1)))); break;
        case op::BININT2: push(Value::from_int(static_cast<int64_t>(le(2)))); break;
        case op::BININT:
          push(Value::from_int(static_cast<int32_t>(static_cast<uint32_t>(le(4)))));
          break;
        case op::LONG1: {
          const uint8_t n = u8();
          fail_if(n > 8, at, "integer of ", int(n), " bytes exceeds int64");
          uint64_t u = n ? le(n) : 0;
          if (n && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~uint64_t{0} << (8 * n);  // sign
          push(Value::from_int(static_cast<int64_t>(u)));
          break;
        }
        case op::BINFLOAT: {
          need(8);
          push(Value::from_float(std::bit_cast<double>(in_.be(8))));
          break;
        }
        case op::SHORT_BINUNICODE: push_str(at, le(1)); break;
        case op::BINUNICODE: push_str(at, le(4)); break;
        case op::BINUNICODE8: push_str(at, le(8)); break;
        case op::EMPTY_LIST: push(Value::list()); break;
        case op::EMPTY_DICT: push(Value::dict()); break;
        case op::EMPTY_TUPLE: push(Value::tuple()); break;
        case op::MARK:
          fail_if(marks_.size() >= limits_.max_depth * 4, at, "too many nested marks");
          marks_.push_back(stack_.size());
          break;
        case op::LIST: collect(Value::list(), pop_mark(at), at); break;
        case op::TUPLE: collect(Value::tuple(), pop_mark(at), at); break;
        case op::TUPLE1:
        case op::TUPLE2:
        case op::TUPLE3: {
          const size_t n = code - op::TUPLE1 + 1;
          fail_if(stack_.size() < n + floor(), at, "TUPLE", n, " on a short stack");
          collect(Value::tuple(), stack_.size() - n, at);
          break;
        }
        case op::DICT: {
          const size_t first = pop_mark(at);
          Node d = make(Value::dict());
          fill_dict(d, first, at);
          stack_.push_back(std::move(d));
          break;
        }
        case op::APPEND:
          fail_if(stack_.size() < 2 + floor(), at, "APPEND on a short stack");
          extend(stack_.size() - 1, at);
          break;
        case op::APPENDS: extend(pop_mark(at), at); break;
        case op::SETITEM: {
          fail_if(stack_.size() < 3 + floor(), at, "SETITEM on a short stack");
          const size_t first = stack_.size() - 2;
          fill_dict(below(first, at, Value::Kind::Dict), first, at);
          break;
        }
        case op::SETITEMS: {
          const size_t first = pop_mark(at);
          fill_dict(below(first, at, Value::Kind::Dict), first, at);
          break;
        }
        case op::GLOBAL: {
          // Protocol 0-3 form: "module\nqualname\n". Only the names are kept.
          std::string module = line(at, "module");
          std::string name = line(at, "qualname");
          push(class_ref(at, std::move(module), std::move(name)));
          break;
        }
        case op::STACK_GLOBAL: {
          fail_if(stack_.size() < 2 + floor(), at, "STACK_GLOBAL on a short stack");
          const Value& module = value_of(stack_[stack_.size() - 2]);
          const Value& name = value_of(stack_.back());
          fail_if(module.kind() != Value::Kind::Str || name.kind() != Value::Kind::Str, at,
                  "STACK_GLOBAL needs two str, got a ", Value::kind_name(module.kind()), " and a ",
                  Value::kind_name(name.kind()));
          Value ref = class_ref(at, module.as_str(), name.as_str());
          stack_.resize(stack_.size() - 2);
          push(std::move(ref));
          break;
        }
        case op::MEMOIZE: memo_put(at, memo_count_); break;
        case op::BINPUT: memo_put(at, le(1)); break;
        case op::LONG_BINPUT: memo_put(at, le(4)); break;
        case op::BINGET: memo_get(at, le(1)); break;
        case op::LONG_BINGET: memo_get(at, le(4)); break;
        default: {
          const char* name = dangerous_name(code);
          fail_if(name != nullptr, at, "refused opcode ", name,
                  ": it would import or call code, which a metadata pickle never needs");
          fail_if(true, at, "opcode 0x", hex(code), " is outside the supported subset");
        }
      }
    }
  }

 private:
  template <typename... Args>
  void fail_if(bool cond, size_t at, const Args&... args) {
    TORCH_CHECK_VALUE(!cond, "pickle: ", c10::str(args...), " (at byte ", at, " of ", in_.size(),
                      ")");
  }
  static std::string hex(uint8_t c) {
    static constexpr char kDigits[] = "0123456789abcdef";
    return {kDigits[c >> 4], kDigits[c & 15]};
  }
  // A peer's name as core::excerpt quotes it, with anything but printable ASCII escaped.
  static std::string printable(std::string_view s) {
    std::string out;
    for (const char c : core::excerpt(s)) {
      if (c >= 0x20 && c < 0x7f) {
        out += c;
      } else {
        out += "\\x" + hex(static_cast<uint8_t>(c));
      }
    }
    return out;
  }
  void need(size_t n) { fail_if(!in_.has(n), in_.pos(), "truncated pickle"); }
  uint8_t u8() {
    need(1);
    return in_.u8();
  }
  uint64_t le(size_t n) {
    need(n);
    return in_.le(n);
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }

  // The value a stack node stands for, wherever it is held.
  static Value& value_of(Node& n) { return n.shared ? n.shared->value : n.value; }
  static const Value& value_of(const Node& n) { return n.shared ? n.shared->value : n.value; }
  static Cost& cost_of(Node& n) { return n.shared ? n.shared->cost : n.cost; }

  Node make(Value v) {
    count(1);
    size_t bytes = kValueBytes;
    if (v.kind() == Value::Kind::Str) bytes += v.as_str().size();
    if (v.kind() == Value::Kind::ClassRef) bytes += v.ref_module().size() + v.ref_qualname().size();
    charge(bytes);
    return Node{std::move(v), Cost{0, 1, bytes}, nullptr};
  }
  // Every byte the reader makes counts, copies of memoized values included, so that a small
  // pickle cannot make it build a large tree (one long string read back by many GETs).
  void charge(size_t bytes) {
    spent_ += bytes;
    TORCH_CHECK_VALUE(spent_ <= budget_, "pickle: ", over_budget_text());
  }
  std::string over_budget_text() const {
    return c10::str("the values read would take more than ", budget_,
                    " bytes of memory, the "
                    "budget for a pickle of ",
                    in_.size(),
                    " bytes; a metadata pickle never "
                    "expands that much");
  }
  void count(size_t n) {
    elements_ += n;
    TORCH_CHECK_VALUE(elements_ <= limits_.max_elements, "pickle: more than ", limits_.max_elements,
                      " values");
  }
  void push(Value v) { stack_.push_back(make(std::move(v))); }
  void push_str(size_t at, uint64_t n) {
    fail_if(!in_.has(n), at, "string of ", n, " bytes runs past the end");
    const std::string_view s = in_.take(n);
    fail_if(!core::valid_utf8(s), at, "string is not valid UTF-8");
    push(Value::from_str(std::string(s)));
  }
  // GLOBAL's newline-terminated argument, at most max_name_bytes long, as UTF-8.
  std::string line(size_t at, const char* what) {
    const std::string_view window = in_.rest().substr(0, limits_.max_name_bytes + 1);
    const size_t nl = window.find('\n');
    fail_if(nl == std::string_view::npos && window.size() > limits_.max_name_bytes, at, "GLOBAL ",
            what, " is longer than ", limits_.max_name_bytes, " bytes");
    fail_if(nl == std::string_view::npos, at, "truncated pickle: GLOBAL ", what,
            " has no end of line");
    std::string out(in_.take(nl));
    in_.skip(1);
    return out;
  }
  // An inert class reference, its names checked (and bounded) before they are kept.
  Value class_ref(size_t at, std::string module, std::string name) {
    for (const auto* part : {&module, &name}) {
      const char* what = part == &module ? "module" : "qualname";
      fail_if(part->size() > limits_.max_name_bytes, at, "class reference ", what, " of ",
              part->size(), " bytes is longer than ", limits_.max_name_bytes, " bytes");
      fail_if(!valid_dotted_name(*part), at, "class reference ", what, " '", printable(*part),
              "' is not a dotted name of identifiers");
    }
    return Value::class_ref(std::move(module), std::move(name));
  }
  // The stack position of the last MARK's first item; the mark is dropped.
  size_t pop_mark(size_t at) {
    fail_if(marks_.empty(), at, "no MARK on the stack");
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  // The container just below stack position `first` (the target of APPENDS / SETITEMS).
  Node& below(size_t first, size_t at, Value::Kind kind) {
    fail_if(first <= floor() || first == 0, at, "empty stack");
    Node& n = stack_[first - 1];
    fail_if(value_of(n).kind() != kind, at, "expected a ", Value::kind_name(kind),
            " on the stack, got a ", Value::kind_name(value_of(n).kind()));
    return n;
  }
  void adopt(Cost& parent, const Cost& child, size_t at) {
    parent.depth = std::max(parent.depth, child.depth + 1);
    parent.nodes += child.nodes;
    parent.bytes += child.bytes;
    fail_if(parent.depth > limits_.max_depth, at, "nesting deeper than ", limits_.max_depth);
  }
  // A finished value for its parent: moved when nothing else holds it (no memo entry a GET
  // will read), copied (and charged) otherwise.
  Value take(Node& n) {
    if (!n.shared) return std::move(n.value);
    if (n.shared.use_count() == 1) return std::move(n.shared->value);
    charge(n.shared->cost.bytes);
    return n.shared->value;
  }
  // Moves stack_[first, end) into the list below `first`, then drops them from the stack.
  void extend(size_t first, size_t at) {
    Node& list = below(first, at, Value::Kind::List);
    Value& target = value_of(list);
    Cost& cost = cost_of(list);
    target.reserve(stack_.size() - first);
    for (size_t i = first; i < stack_.size(); ++i) {
      adopt(cost, cost_of(stack_[i]), at);
      target.items().push_back(take(stack_[i]));
    }
    stack_.resize(first);
  }
  // Replaces stack_[first, end) by the container `v` holding them.
  void collect(Value v, size_t first, size_t at) {
    Node c = make(std::move(v));
    c.value.reserve(stack_.size() - first);
    for (size_t i = first; i < stack_.size(); ++i) {
      adopt(c.cost, cost_of(stack_[i]), at);
      c.value.items().push_back(take(stack_[i]));
    }
    stack_.resize(first);
    stack_.push_back(std::move(c));
  }
  // Moves the key/value pairs stack_[first, end) into the dict `d`, then drops them. `d` is
  // below `first` on the stack, or a node not on it yet.
  void fill_dict(Node& d, size_t first, size_t at) {
    fail_if((stack_.size() - first) % 2 != 0, at, "odd number of items for a dict");
    Value& target = value_of(d);
    Cost& cost = cost_of(d);
    target.reserve((stack_.size() - first) / 2);
    for (size_t i = first; i < stack_.size(); i += 2) {
      const Value& key = value_of(stack_[i]);
      fail_if(key.kind() != Value::Kind::Str, at, "dict key is a ", Value::kind_name(key.kind()),
              "; only str keys are supported");
      adopt(cost, cost_of(stack_[i + 1]), at);
      const size_t entry = kDictEntryBytes + key.as_str().size();
      charge(entry);
      cost.bytes += entry;
      std::string k = stack_[i].shared ? key.as_str() : stack_[i].value.take_str();
      target.set(std::move(k), take(stack_[i + 1]));
    }
    stack_.resize(first);
  }
  // Whether memo index `index` is stored already; stores it.
  bool define(uint64_t index) {
    if (index < kDenseMemo) {
      if (index >= defined_.size()) defined_.resize(index + 1, false);
      if (defined_[index]) return false;
      defined_[index] = true;
    } else if (!sparse_defined_.insert(index).second) {
      return false;
    }
    ++memo_count_;
    return true;
  }
  bool is_defined(uint64_t index) const {
    return index < kDenseMemo ? index < defined_.size() && defined_[index]
                              : sparse_defined_.contains(index);
  }
  void memo_put(size_t at, uint64_t index) {
    fail_if(stack_.size() <= floor(), at, "memo store from an empty stack");
    fail_if(memo_count_ >= limits_.max_elements, at, "memo too large");
    define(index);
    // An entry no GET reads is only counted (MEMOIZE numbers entries by the memo's size).
    if (!reads_.contains(index)) {
      memo_.erase(index);
      return;
    }
    Node& top = stack_.back();
    if (!top.shared) {
      top.shared = std::make_shared<Shared>(Shared{std::move(top.value), top.cost});
    }
    memo_[index] = top.shared;
  }
  void memo_get(size_t at, uint64_t index) {
    fail_if(!is_defined(index), at, "memo entry ", index, " is undefined");
    auto it = memo_.find(index);
    TORCH_INTERNAL_ASSERT(it != memo_.end(), "pickle: memo entry ", index, " was not kept");
    // A reference is read again as a copy: count it whole, so shared references cannot blow up.
    const Shared& s = *it->second;
    count(s.cost.nodes);
    charge(s.cost.bytes);
    stack_.push_back(Node{s.value, s.cost, nullptr});
  }

  core::ByteReader in_;
  Limits limits_;
  size_t budget_;
  size_t spent_ = 0;
  size_t elements_ = 0;
  // A deque: it grows without moving (or briefly doubling) what it holds, so that the budget's
  // charge per value is what a value costs.
  std::deque<Node> stack_;
  std::vector<size_t> marks_;
  uint64_t memo_count_ = 0;    // distinct memo indices stored
  std::vector<bool> defined_;  // memo indices below kDenseMemo that are stored
  std::unordered_set<uint64_t> sparse_defined_;
  std::unordered_map<uint64_t, std::shared_ptr<Shared>> memo_;  // the entries a GET reads
  MemoReads reads_;
};

}  // namespace

size_t detail::read_budget(std::string_view data, const Limits& limits) {
  if (limits.max_bytes != 0) return limits.max_bytes;
  return std::min(kMaxBudgetBytes, kBaseBudgetBytes + kBudgetPerInputByte * data.size()) +
         data.size();
}

Writer::Writer(std::string& out) : out_(out) {
  op(op::PROTO);
  out_.push_back(4);
}

void Writer::none() { op(op::NONE); }
void Writer::boolean(bool v) { op(v ? op::NEWTRUE : op::NEWFALSE); }

void Writer::integer(int64_t v) {
  // The shortest form Python's pickler picks for each range.
  if (v >= 0 && v <= 0xff) {
    op(op::BININT1);
    append_le(out_, static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v <= 0xffff) {
    op(op::BININT2);
    append_le(out_, static_cast<uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    op(op::BININT);
    append_le(out_, static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
  } else {
    // LONG1: minimal little-endian two's complement.
    const auto u = static_cast<uint64_t>(v);
    int n = 8;
    while (n > 1) {
      const auto last = static_cast<uint8_t>(u >> (8 * (n - 1)));
      const bool prev_sign = (u >> (8 * (n - 1) - 1)) & 1;
      if ((last == 0x00 && !prev_sign) || (last == 0xff && prev_sign)) {
        --n;
      } else {
        break;
      }
    }
    op(op::LONG1);
    out_.push_back(static_cast<char>(n));
    append_le(out_, u, n);
  }
}

void Writer::floating(double v) {
  op(op::BINFLOAT);
  append_be(out_, std::bit_cast<uint64_t>(v), 8);  // pickle's one big-endian field
}

void Writer::str(std::string_view s) {
  if (s.size() < 256) {
    op(op::SHORT_BINUNICODE);
    append_le(out_, s.size(), 1);
  } else if (s.size() <= 0xffffffffu) {
    op(op::BINUNICODE);
    append_le(out_, s.size(), 4);
  } else {
    op(op::BINUNICODE8);
    append_le(out_, s.size(), 8);
  }
  out_ += s;
}

void Writer::class_ref(std::string_view module, std::string_view qualname) {
  str(module);
  str(qualname);
  op(op::STACK_GLOBAL);
}

void Writer::list_open(size_t n) {
  op(op::EMPTY_LIST);
  if (n) op(op::MARK);
}
void Writer::list_close(size_t n) {
  if (n) op(op::APPENDS);
}
void Writer::tuple_open(size_t n) {
  if (n == 0) op(op::EMPTY_TUPLE);
  if (n > 3) op(op::MARK);
}
void Writer::tuple_close(size_t n) {
  static constexpr uint8_t kSmall[] = {0, op::TUPLE1, op::TUPLE2, op::TUPLE3};
  if (n) op(n > 3 ? op::TUPLE : kSmall[n]);
}
void Writer::dict_open(size_t n) {
  op(op::EMPTY_DICT);
  if (n) op(op::MARK);
}
void Writer::dict_close(size_t n) {
  if (n) op(op::SETITEMS);
}
void Writer::finish() { op(op::STOP); }

std::string dumps(const Value& value) {
  std::string out;
  Writer w(out);
  write_value(w, value);
  w.finish();
  return out;
}

Value loads(std::string_view data, const Limits& limits) { return Reader(data, limits).run(); }

}  // namespace tensordict::wire::pickle

#pragma once
// Tensorclasses: typed structs of fields backed by a TensorDict, as the reference's
// @tensorclass. Declared with one macro that names each field once:
//
//   TENSORDICT_TENSORCLASS(Inner, (at::Tensor, x));
//   TENSORDICT_TENSORCLASS(MyData,
//       (at::Tensor, obs),
//       (at::Tensor, reward),
//       (std::string, label),   // a non-tensor field
//       (Inner, inner));        // a nested tensorclass
//
//   MyData d(at::zeros({4, 3}), at::zeros({4}), "train", Inner(at::ones({4}), {4}), {4});
//   d.obs();                    // at::Tensor
//   d.set_label("eval");        // setters return *this
//   d.inner().x();              // the nested tensorclass, sharing the parent's entries
//   dist::send(d, 1);           // a tensorclass is a `const TensorDict&` (its td())
//
// Field types: at::Tensor; the non-tensor types std::string, int64_t, double, bool and
// tensordict::JsonValue (stored as NonTensorData entries, as the reference stores them); and
// another tensorclass (stored as a nested TensorDict). Anything else fails to compile with a
// static_assert naming the class and the field. Entries are inserted in declaration order,
// which is the consolidated layout's order.
//
// The type name the wire carries ("_tensorclass_type", sent by init_remote and broadcast) is
// the class name by default. A C++ peer of a Python tensorclass declares the Python side's
// "<module>.<qualname>" instead:
//
//   TENSORDICT_TENSORCLASS_NAMED(MyDistData, "__main__.MyDistData", (at::Tensor, x));
//
// To add methods of your own, write the class and put the body macro inside it:
//
//   class MyData : public tensordict::TensorClass<MyData> {
//    public:
//     TENSORDICT_TENSORCLASS_BODY(MyData, "MyData", (at::Tensor, obs), (at::Tensor, reward))
//     at::Tensor total() const { return obs().sum() + reward().sum(); }
//   };
//
// The typed transfers live beside the transports: tensordict/distributed/tensorclass.h (c10d)
// and tensordict/pipe/tensorclass.h (UCX); this header sees neither.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensordict/consolidate.h"
#include "tensordict/errors.h"
#include "tensordict/json_value.h"
#include "tensordict/non_tensor.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {

template <typename Derived>
class TensorClass;

/// A class declared with TENSORDICT_TENSORCLASS (or TENSORDICT_TENSORCLASS_BODY).
template <typename T>
concept TensorClassType = std::derived_from<T, TensorClass<T>> && requires {
  { T::type_name() } -> std::convertible_to<std::string_view>;
  T::tensorclass_fields();
};

namespace detail {

enum class TcKind { kTensor, kNonTensor, kNested, kUnsupported };

template <typename T>
consteval TcKind tc_kind() {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return TcKind::kTensor;
  } else if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, int64_t> ||
                       std::is_same_v<T, double> || std::is_same_v<T, bool> ||
                       std::is_same_v<T, JsonValue>) {
    return TcKind::kNonTensor;
  } else if constexpr (std::derived_from<T, TensorClass<T>>) {
    return TcKind::kNested;
  } else {
    return TcKind::kUnsupported;
  }
}

/// Names a field may not take: members every tensorclass has.
consteval bool tc_reserved_name(std::string_view name) {
  constexpr std::array<std::string_view, 9> kReserved = {
      "td", "batch_size",        "device", "type_name", "field_names", "from_tensordict", "clone",
      "to", "tensorclass_fields"};
  for (std::string_view r : kReserved) {
    if (r == name) return true;
  }
  return false;
}

/// One field: its C++ type and its key in the TensorDict.
template <typename T>
struct TcField {
  using type = T;
  std::string_view name;
};

template <typename T>
constexpr const char* tc_expected() {
  if constexpr (std::is_same_v<T, std::string>)
    return "a string";
  else if constexpr (std::is_same_v<T, int64_t>)
    return "an integer";
  else if constexpr (std::is_same_v<T, double>)
    return "a number";
  else if constexpr (std::is_same_v<T, bool>)
    return "a bool";
  else
    return "JSON-like data";
}

inline const char* tc_json_kind(const JsonValue& v) {
  if (v.is_null()) return "null";
  if (v.is_bool()) return "a bool";
  if (v.is_int()) return "an integer";
  if (v.is_float()) return "a float";
  if (v.is_string()) return "a string";
  if (v.is_list()) return "a list";
  return "a map";
}

inline const char* tc_entry_kind(const Value& v) {
  if (v.is_tensor()) return "a tensor";
  if (v.is_tensordict()) return "a TensorDict";
  return "a non-tensor entry";
}

template <typename T>
bool tc_json_holds(const JsonValue& v) {
  if constexpr (std::is_same_v<T, std::string>)
    return v.is_string();
  else if constexpr (std::is_same_v<T, int64_t>)
    return v.is_int();
  else if constexpr (std::is_same_v<T, double>)
    return v.is_float() || v.is_int();
  else if constexpr (std::is_same_v<T, bool>)
    return v.is_bool();
  else
    return true;
}

template <TensorClassType T>
std::string tc_field_list() {
  std::string out;
  std::apply([&](auto... f) { ((out += (out.empty() ? "" : ", "), out += f.name), ...); },
             T::tensorclass_fields());
  return out;
}

/// "a[0] shape starts with batch_size": the rule every entry of a TensorDict follows.
inline bool tc_starts_with(at::IntArrayRef shape, at::IntArrayRef batch_size) {
  return shape.size() >= batch_size.size() && shape.slice(0, batch_size.size()) == batch_size;
}

/// Checks one field of `td` against its declaration; `where` prefixes the messages.
template <typename F>
void tc_validate_field(const TensorDict& td, const F& field, const std::string& where,
                       std::string_view cls);

/// Checks that `td` holds exactly T's fields, each of the declared kind, nested ones
/// recursively. ValueError for a missing or extra key, TypeError for a wrong kind.
template <TensorClassType T>
void tc_validate(const TensorDict& td, const std::string& where) {
  std::apply([&](const auto&... f) { (tc_validate_field(td, f, where, T::type_name()), ...); },
             T::tensorclass_fields());
  if (td.entries().size() == std::tuple_size_v<decltype(T::tensorclass_fields())>) return;
  for (const auto& entry : td.entries()) {
    bool known = false;
    std::apply([&](const auto&... f) { known = ((f.name == entry.first) || ...); },
               T::tensorclass_fields());
    TORCH_CHECK_VALUE(known, where, ": key ", quote_key(entry.first), " is not a field of ",
                      T::type_name(), " (fields: ", tc_field_list<T>(), ")");
  }
}

template <typename F>
void tc_validate_field(const TensorDict& td, const F& field, const std::string& where,
                       std::string_view cls) {
  using T = typename F::type;
  constexpr TcKind kind = tc_kind<T>();
  const std::string name(field.name);
  TORCH_CHECK_VALUE(td.contains(name), where, ": field ", quote_key(name), " of ", cls,
                    " is missing");
  const Value value = td.get(name);
  if constexpr (kind == TcKind::kTensor) {
    TORCH_CHECK_TYPE(value.is_tensor(), where, ": field ", quote_key(name), " of ", cls,
                     " must be a tensor, found ", tc_entry_kind(value));
  } else if constexpr (kind == TcKind::kNonTensor) {
    TORCH_CHECK_TYPE(value.is_non_tensor(), where, ": field ", quote_key(name), " of ", cls,
                     " must be a non-tensor entry holding ", tc_expected<T>(), ", found ",
                     tc_entry_kind(value));
    const JsonValue& data = value.non_tensor().data();
    TORCH_CHECK_TYPE(tc_json_holds<T>(data), where, ": field ", quote_key(name), " of ", cls,
                     " must hold ", tc_expected<T>(), ", found ", tc_json_kind(data));
  } else if constexpr (kind == TcKind::kNested) {
    TORCH_CHECK_TYPE(value.is_tensordict(), where, ": field ", quote_key(name), " of ", cls,
                     " must be a TensorDict (tensorclass ", T::type_name(), "), found ",
                     tc_entry_kind(value));
    tc_validate<T>(value.tensordict(), where + ": field " + quote_key(name));
  }
}

/// Grants the free functions below access to a tensorclass's TensorDict, so that the class has
/// no member a field name could collide with.
struct TcAccess {
  template <typename D>
  static TensorDict& td(TensorClass<D>& tc) {
    return tc.td_;
  }
  template <TensorClassType T>
  static T wrap(TensorDict td) {
    T out;
    static_cast<TensorClass<T>&>(out).td_ = std::move(td);
    return out;
  }
};

/// Wraps `td` after validating it; `call` names the operation in the messages.
template <TensorClassType T>
T tc_from(TensorDict td, std::string_view call) {
  tc_validate<T>(td, std::string(call));
  return TcAccess::wrap<T>(std::move(td));
}

/// The accessor of a field (the macro's `name()`).
template <typename T, typename D>
T tc_get(const TensorClass<D>& tc, std::string_view field) {
  const TensorDict& td = tc.td();
  const std::string key(field);
  TD_CHECK_KEY(td.contains(key), D::type_name(), ": field ", quote_key(key),
               " is not set (a default-constructed placeholder, or a TensorDict changed "
               "through td())");
  constexpr TcKind kind = tc_kind<T>();
  if constexpr (kind == TcKind::kTensor) {
    const Value v = td.get(key);
    TORCH_CHECK_TYPE(v.is_tensor(), D::type_name(), ": field ", quote_key(key), " holds ",
                     tc_entry_kind(v), ", not a tensor");
    return v.tensor();
  } else if constexpr (kind == TcKind::kNonTensor) {
    const Value v = td.get(key);
    TORCH_CHECK_TYPE(v.is_non_tensor(), D::type_name(), ": field ", quote_key(key), " holds ",
                     tc_entry_kind(v), ", not a non-tensor entry");
    const JsonValue& data = v.non_tensor().data();
    TORCH_CHECK_TYPE(tc_json_holds<T>(data), D::type_name(), ": field ", quote_key(key), " holds ",
                     tc_json_kind(data), ", not ", tc_expected<T>());
    if constexpr (std::is_same_v<T, std::string>)
      return data.as_string();
    else if constexpr (std::is_same_v<T, int64_t>)
      return data.as_int();
    else if constexpr (std::is_same_v<T, double>)
      return data.as_float();
    else if constexpr (std::is_same_v<T, bool>)
      return data.as_bool();
    else
      return data;
  } else if constexpr (kind == TcKind::kNested) {
    const Value v = td.get(key);
    TORCH_CHECK_TYPE(v.is_tensordict(), D::type_name(), ": field ", quote_key(key), " holds ",
                     tc_entry_kind(v), ", not a TensorDict");
    // Not validated again on every access: each accessor of the nested class checks its own
    // field, and the nested handle shares the parent's entries.
    return TcAccess::wrap<T>(v.tensordict());
  } else {
    // Unsupported types are reported by the macro's static_assert; no second error here.
    TORCH_INTERNAL_ASSERT(false, "unsupported tensorclass field type");
  }
}

/// The value of a field as a TensorDict entry, checked against the batch size.
template <typename T, typename D>
Value tc_entry(const TensorClass<D>& /*tc: names D*/, std::string_view field, T value,
               at::IntArrayRef batch_size, std::optional<at::Device> device) {
  constexpr TcKind kind = tc_kind<T>();
  if constexpr (kind == TcKind::kTensor) {
    TORCH_CHECK_VALUE(value.defined(), D::type_name(), ": field ", quote_key(field),
                      " is an undefined tensor");
    TD_CHECK_BATCH(tc_starts_with(value.sizes(), batch_size), D::type_name(), ": field ",
                   quote_key(field), " has shape ", value.sizes(),
                   ", which does not start with the batch size ", batch_size);
    return Value(std::move(value));
  } else if constexpr (kind == TcKind::kNonTensor) {
    return Value(NonTensorData(JsonValue(std::move(value)), batch_size.vec(), device));
  } else if constexpr (kind == TcKind::kNested) {
    TD_CHECK_BATCH(tc_starts_with(value.batch_size(), batch_size), D::type_name(), ": field ",
                   quote_key(field), " (", T::type_name(), ") has batch size ", value.batch_size(),
                   ", which does not start with the batch size ", batch_size);
    return Value(value.td());
  } else {
    TORCH_INTERNAL_ASSERT(false, "unsupported tensorclass field type");
  }
}

/// The setter of a field (the macro's `set_name(value)`).
template <typename T, typename D>
void tc_set(TensorClass<D>& tc, std::string_view field, T value) {
  TensorDict& td = TcAccess::td(tc);
  td.set(std::string(field),
         tc_entry<T>(tc, field, std::move(value), td.batch_size(), td.device()));
}

template <typename D, typename Values, size_t... I>
void tc_init_(TensorClass<D>& tc, at::IntArrayRef batch_size, std::optional<at::Device> device,
              Values& values, std::index_sequence<I...>) {
  constexpr auto fields = D::tensorclass_fields();
  std::vector<TensorDict::Entry> entries;
  entries.reserve(sizeof...(I));
  (entries.emplace_back(
       std::string(std::get<I>(fields).name),
       tc_entry<typename std::tuple_element_t<I, decltype(fields)>::type>(
           tc, std::get<I>(fields).name, std::move(std::get<I>(values)), batch_size, device)),
   ...);
  TcAccess::td(tc) = TensorDict(std::move(entries), batch_size, device);
}

/// The constructor of the macro: one value per field, in declaration order.
template <typename D, typename... Ts>
void tc_init(TensorClass<D>& tc, at::IntArrayRef batch_size, std::optional<at::Device> device,
             std::tuple<Ts...> values) {
  tc_init_(tc, batch_size, device, values, std::index_sequence_for<Ts...>{});
}

}  // namespace detail

/// The base of every tensorclass (CRTP): holds the backing TensorDict and the operations every
/// tensorclass shares. A tensorclass is a handle, as TensorDict is: copies share the entries,
/// clone() copies them. Thread-safety as TensorDict's. Declare one with TENSORDICT_TENSORCLASS;
/// the macro adds, in the class:
///   static constexpr std::string_view type_name();  // the name the wire carries
///   static constexpr auto tensorclass_fields();     // tuple of detail::TcField<T>{"name"}
///   Name();                                         // an empty placeholder (see below)
///   explicit Name(fields..., at::IntArrayRef batch_size, std::optional<at::Device> = {});
///   T field() const;  Name& set_field(T value);      // per field
template <typename Derived>
class TensorClass {
 public:
  /// The backing TensorDict: a handle sharing this tensorclass's entries. Every TensorDict
  /// call (transfers included) accepts a tensorclass through it, or through the implicit
  /// conversion below.
  const TensorDict& td() const { return td_; }
  operator const TensorDict&() const { return td_; }  // NOLINT: implicit on purpose

  at::IntArrayRef batch_size() const { return td_.batch_size(); }
  std::optional<at::Device> device() const { return td_.device(); }

  /// The field names, in declaration order.
  static constexpr auto field_names() {
    return std::apply(
        [](auto... f) { return std::array<std::string_view, sizeof...(f)>{f.name...}; },
        Derived::tensorclass_fields());
  }

  /// Wraps `td` without copying (the result shares its entries), after checking that it holds
  /// exactly the declared fields: ValueError naming the class and the field when one is
  /// missing or a key is not a field; TypeError when a field holds the wrong kind of entry
  /// (a tensor where a string is expected, ...). Nested tensorclass fields are checked
  /// recursively. Python's `MyData.from_tensordict(td)`, except that a missing field is an
  /// error (C++ fields are not optional).
  static Derived from_tensordict(TensorDict td) {
    return detail::tc_from<Derived>(std::move(td),
                                    std::string(Derived::type_name()) + ".from_tensordict");
  }

  /// A deep copy (TensorDict::clone()).
  Derived clone() const { return detail::TcAccess::wrap<Derived>(td_.clone()); }
  /// A copy on `device` (TensorDict::to()).
  Derived to(at::Device device) const { return detail::TcAccess::wrap<Derived>(td_.to(device)); }

 protected:
  /// An empty placeholder: no entries, batch size []. Its field accessors throw KeyError
  /// naming the field. Useful as the ignored argument of broadcast() on receiving ranks, and
  /// for containers.
  TensorClass() = default;

 private:
  friend struct detail::TcAccess;
  TensorDict td_;
};

/// A consolidated copy (see consolidate() in consolidate.h), as the tensorclass: the result's
/// fields are views of one flat storage, non-tensor fields included in its metadata.
template <TensorClassType T>
T consolidate(const T& tc, const ConsolidateOptions& options = {}) {
  return detail::tc_from<T>(consolidate(tc.td(), options), "consolidate");
}

namespace detail {
/// True when two "<module>.<qualname>" name the same class. "__main__.X" and "__mp_main__.X"
/// do: multiprocessing's spawn re-imports a script as __mp_main__, so a Python peer started
/// that way sends the latter (the Python side treats them alike too).
constexpr bool same_tensorclass_type(std::string_view a, std::string_view b) {
  if (a == b) return true;
  auto strip = [](std::string_view s) -> std::optional<std::string_view> {
    for (std::string_view m : {std::string_view("__main__."), std::string_view("__mp_main__.")}) {
      if (s.substr(0, m.size()) == m) return s.substr(m.size());
    }
    return std::nullopt;
  };
  const auto sa = strip(a), sb = strip(b);
  return sa && sb && *sa == *sb;
}

/// Checks the class name a transfer received ("_tensorclass_type") against T's. A payload
/// without one (a plain TensorDict) is accepted: its fields are validated instead.
template <TensorClassType T>
void check_tensorclass_type(std::string_view call, const std::optional<std::string>& received) {
  if (!received) return;
  TORCH_CHECK_TYPE(same_tensorclass_type(*received, T::type_name()), call,
                   ": the sender's tensorclass is '", *received, "' but the receiver expects '",
                   T::type_name(),
                   "' (a C++ peer of a Python tensorclass declares its "
                   "\"<module>.<qualname>\" with TENSORDICT_TENSORCLASS_NAMED)");
}
}  // namespace detail

}  // namespace tensordict

// ---- the declaration macros ----------------------------------------------------------------
// A field is a parenthesised pair (type, name). The for-each below is the usual C++20
// __VA_OPT__ recursion: each rescan of TENSORDICT_TC_EXPAND peels one field (up to 256).

#define TENSORDICT_TC_PARENS ()
#define TENSORDICT_TC_EXPAND(...) \
  TENSORDICT_TC_EXPAND4(          \
      TENSORDICT_TC_EXPAND4(TENSORDICT_TC_EXPAND4(TENSORDICT_TC_EXPAND4(__VA_ARGS__))))
#define TENSORDICT_TC_EXPAND4(...) \
  TENSORDICT_TC_EXPAND3(           \
      TENSORDICT_TC_EXPAND3(TENSORDICT_TC_EXPAND3(TENSORDICT_TC_EXPAND3(__VA_ARGS__))))
#define TENSORDICT_TC_EXPAND3(...) \
  TENSORDICT_TC_EXPAND2(           \
      TENSORDICT_TC_EXPAND2(TENSORDICT_TC_EXPAND2(TENSORDICT_TC_EXPAND2(__VA_ARGS__))))
#define TENSORDICT_TC_EXPAND2(...) __VA_ARGS__

// m(ctx, field) for each field, juxtaposed.
#define TENSORDICT_TC_FOR_EACH(m, ctx, ...) \
  __VA_OPT__(TENSORDICT_TC_EXPAND(TENSORDICT_TC_FOR_EACH_(m, ctx, __VA_ARGS__)))
#define TENSORDICT_TC_FOR_EACH_(m, ctx, f, ...) \
  m(ctx, f) __VA_OPT__(TENSORDICT_TC_FOR_EACH_AGAIN TENSORDICT_TC_PARENS(m, ctx, __VA_ARGS__))
#define TENSORDICT_TC_FOR_EACH_AGAIN() TENSORDICT_TC_FOR_EACH_

// m(ctx, field) for each field, separated by commas.
#define TENSORDICT_TC_FOR_EACH_COMMA(m, ctx, ...) \
  __VA_OPT__(TENSORDICT_TC_EXPAND(TENSORDICT_TC_FOR_EACH_COMMA_(m, ctx, __VA_ARGS__)))
#define TENSORDICT_TC_FOR_EACH_COMMA_(m, ctx, f, ...) \
  m(ctx, f)                                           \
      __VA_OPT__(, TENSORDICT_TC_FOR_EACH_COMMA_AGAIN TENSORDICT_TC_PARENS(m, ctx, __VA_ARGS__))
#define TENSORDICT_TC_FOR_EACH_COMMA_AGAIN() TENSORDICT_TC_FOR_EACH_COMMA_

#define TENSORDICT_TC_TYPE(type, name) type
#define TENSORDICT_TC_NAME(type, name) name

// Each per-field macro unpacks (type, name) through one more level, so that # and ## see the
// name itself.
#define TENSORDICT_TC_CHECK(Name, f) \
  TENSORDICT_TC_CHECK_(Name, TENSORDICT_TC_TYPE f, TENSORDICT_TC_NAME f)
#define TENSORDICT_TC_CHECK_(Name, type, name) TENSORDICT_TC_CHECK__(Name, type, name)
#define TENSORDICT_TC_CHECK__(Name, type, name)                                            \
  static_assert(                                                                           \
      ::tensordict::detail::tc_kind<type>() != ::tensordict::detail::TcKind::kUnsupported, \
      "TENSORDICT_TENSORCLASS(" #Name "): field '" #name                                   \
      "' has an unsupported "                                                              \
      "type; use at::Tensor, std::string, int64_t, double, bool, "                         \
      "tensordict::JsonValue or another tensorclass");                                     \
  static_assert(!::tensordict::detail::tc_reserved_name(#name),                            \
                "TENSORDICT_TENSORCLASS(" #Name "): field '" #name                         \
                "' is reserved (every "                                                    \
                "tensorclass has a member of that name)");

#define TENSORDICT_TC_DESC(Name, f) TENSORDICT_TC_DESC_(TENSORDICT_TC_TYPE f, TENSORDICT_TC_NAME f)
#define TENSORDICT_TC_DESC_(type, name) TENSORDICT_TC_DESC__(type, name)
#define TENSORDICT_TC_DESC__(type, name) \
  ::tensordict::detail::TcField<type> { #name }

#define TENSORDICT_TC_PARAM(Name, f) \
  TENSORDICT_TC_PARAM_(TENSORDICT_TC_TYPE f, TENSORDICT_TC_NAME f)
#define TENSORDICT_TC_PARAM_(type, name) type name,

#define TENSORDICT_TC_MOVE(Name, f) ::std::move(TENSORDICT_TC_NAME f)

#define TENSORDICT_TC_ACCESSORS(Name, f) \
  TENSORDICT_TC_ACCESSORS_(Name, TENSORDICT_TC_TYPE f, TENSORDICT_TC_NAME f)
#define TENSORDICT_TC_ACCESSORS_(Name, type, name) TENSORDICT_TC_ACCESSORS__(Name, type, name)
#define TENSORDICT_TC_ACCESSORS__(Name, type, name)                              \
  type name() const { return ::tensordict::detail::tc_get<type>(*this, #name); } \
  Name& set_##name(type value) {                                                 \
    ::tensordict::detail::tc_set<type>(*this, #name, ::std::move(value));        \
    return *this;                                                                \
  }

/// The members of a tensorclass, inside `class Name : public tensordict::TensorClass<Name>`;
/// TypeName is the name the wire carries (a string literal). Leaves the access public.
#define TENSORDICT_TENSORCLASS_BODY(Name, TypeName, ...)                                           \
 public:                                                                                           \
  TENSORDICT_TC_FOR_EACH(TENSORDICT_TC_CHECK, Name, __VA_ARGS__)                                   \
  static_assert(::std::string_view(TypeName).size() > 0,                                           \
                "TENSORDICT_TENSORCLASS(" #Name "): the type name must not be empty");             \
  static constexpr ::std::string_view type_name() { return TypeName; }                             \
  static constexpr auto tensorclass_fields() {                                                     \
    return ::std::make_tuple(TENSORDICT_TC_FOR_EACH_COMMA(TENSORDICT_TC_DESC, Name, __VA_ARGS__)); \
  }                                                                                                \
  Name() = default;                                                                                \
  explicit Name(                                                                                   \
      TENSORDICT_TC_FOR_EACH(TENSORDICT_TC_PARAM, Name, __VA_ARGS__)::at::IntArrayRef batch_size,  \
      ::std::optional<::at::Device> device = ::std::nullopt) {                                     \
    ::tensordict::detail::tc_init(                                                                 \
        *this, batch_size, device,                                                                 \
        ::std::make_tuple(TENSORDICT_TC_FOR_EACH_COMMA(TENSORDICT_TC_MOVE, Name, __VA_ARGS__)));   \
  }                                                                                                \
  TENSORDICT_TC_FOR_EACH(TENSORDICT_TC_ACCESSORS, Name, __VA_ARGS__)

/// Declares tensorclass `Name` whose wire type name is TypeName (a string literal, e.g. the
/// Python class's "<module>.<qualname>"). Fields: (type, name) pairs.
#define TENSORDICT_TENSORCLASS_NAMED(Name, TypeName, ...)    \
  class Name : public ::tensordict::TensorClass<Name> {      \
    TENSORDICT_TENSORCLASS_BODY(Name, TypeName, __VA_ARGS__) \
  }

/// Declares tensorclass `Name` (wire type name "Name"). Fields: (type, name) pairs.
#define TENSORDICT_TENSORCLASS(Name, ...) TENSORDICT_TENSORCLASS_NAMED(Name, #Name, __VA_ARGS__)

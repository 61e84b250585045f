// The reference's reprs (tensordict 0.15.3, utils.py): the compact one-line form it prints by
// default, and the detailed form of set_printoptions(compact=False).

#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "core/json_text.h"
#include "tensor_dict_impl.h"
#include "tensordict/dtypes.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {
namespace {

// textwrap.indent: prefix every line that is not whitespace only.
std::string indent(const std::string& text, const std::string& prefix = "    ") {
  std::string out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    const size_t stop = end == std::string::npos ? text.size() : end + 1;
    const std::string line = text.substr(start, stop - start);
    if (line.find_first_not_of(" \t\r\n") != std::string::npos) out += prefix;
    out += line;
    start = stop;
  }
  return out;
}

std::string size_repr(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "torch.Size([";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "])";
  return os.str();
}

// Python's Tensor.is_shared(): CUDA memory, or CPU memory from a shared-memory mapping.
bool is_shared(const at::Tensor& t) {
  if (t.is_cuda()) return true;
  return t.has_storage() && at::MapAllocator::fromDataPtr(t.storage().data_ptr()) != nullptr;
}

std::string device_repr(const std::optional<at::Device>& d) { return d ? d->str() : "None"; }

std::string tensor_repr(const at::Tensor& t) {
  return "Tensor(shape=" + size_repr(t.sizes()) + ", device=" + t.device().str() +
         ", dtype=" + dtype_name(t.scalar_type()) +
         ", is_shared=" + (is_shared(t) ? "True" : "False") + ")";
}

// The first or last `n` characters (code points) of UTF-8 text.
std::string_view utf8_head(std::string_view s, size_t n) {
  size_t i = 0;
  for (size_t k = 0; k < n && i < s.size(); ++k) {
    do ++i;
    while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xc0) == 0x80);
  }
  return s.substr(0, i);
}

std::string_view utf8_tail(std::string_view s, size_t n) {
  size_t i = s.size();
  for (size_t k = 0; k < n && i > 0; ++k) {
    do --i;
    while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xc0) == 0x80);
  }
  return s.substr(i);
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xc0) != 0x80;
  return n;
}

// NonTensorData.__repr__ (MetaData's too): str(data), cut to its first and last 20 characters
// past 200; NonTensorStack's: str(tolist()), cut after 50 characters.
std::string non_tensor_repr(const NonTensorData& nt) {
  // str() of data that reuses shared values writes each reuse again: measured first.
  core::JsonExpansion().add(nt.is_stack() ? nt.tolist() : nt.data(),
                            [] { return std::string("repr of a non-tensor entry"); });
  if (nt.is_stack()) {
    std::string values = core::python_str(nt.tolist());
    if (utf8_length(values) > 50) values = std::string(utf8_head(values, 50)) + "...";
    return "NonTensorStack(\n    " + values + ",\n    batch_size=" + size_repr(nt.batch_size()) +
           ",\n    device=" + device_repr(nt.device()) + ")";
  }
  std::string data = core::python_str(nt.data());
  if (utf8_length(data) > 200) {
    data = std::string(utf8_head(data, 20)) + "  ...  " + std::string(utf8_tail(data, 20));
  }
  return std::string(nt.class_name()) + "(data=" + data +
         ", batch_size=" + size_repr(nt.batch_size()) + ", device=" + device_repr(nt.device()) +
         ")";
}

std::string detailed_repr(const TensorDict& td, const std::string& type_name);

std::string value_repr(const Value& value) {
  if (value.is_tensor()) return tensor_repr(value.tensor());
  if (value.is_non_tensor()) return non_tensor_repr(value.non_tensor());
  const TensorDict& td = value.tensordict();
  return detailed_repr(td, td.is_lazy_stack() ? "LazyStackedTensorDict" : "TensorDict");
}

// "\nkey: value,\nkey: value" sorted as the reference sorts them: by the formatted strings.
std::string fields_repr(std::vector<std::string> fields) {
  std::sort(fields.begin(), fields.end());
  std::string joined = "\n";
  for (size_t i = 0; i < fields.size(); ++i) joined += (i ? ",\n" : "") + fields[i];
  return joined;
}

// A lazy stack's leaf as the reference shows it without stacking: the stacked shape, -1 where
// the members differ.
std::string stacked_leaf_repr(const LazyStackedTensorDict& td, const std::string& key) {
  const auto members = td.tensordicts();
  const at::Tensor first = members.front().get(key).tensor();
  std::vector<int64_t> shape = first.sizes().vec();
  bool shared = is_shared(first);
  for (const auto& m : members) {
    const at::Tensor t = m.get(key).tensor();
    shared = shared && is_shared(t);
    if (t.dim() != first.dim()) return tensor_repr(first);  // no common shape to show
    for (size_t d = 0; d < shape.size(); ++d) {
      if (t.size(static_cast<int64_t>(d)) != shape[d]) shape[d] = -1;
    }
  }
  shape.insert(shape.begin() + td.stack_dim(), static_cast<int64_t>(members.size()));
  return "Tensor(shape=" + size_repr(shape) + ", device=" + first.device().str() +
         ", dtype=" + dtype_name(first.scalar_type()) +
         ", is_shared=" + (shared ? "True" : "False") + ")";
}

std::string lazy_repr(const LazyStackedTensorDict& td) {
  std::vector<std::string> fields;
  std::vector<std::string> common;
  for (const auto& key : td.keys()) {
    const std::string& k = key.front();
    common.push_back(k);
    const Value first = td.tensordicts().front().get(k);
    std::string shown;
    if (first.is_tensor()) {
      shown = stacked_leaf_repr(td, k);
    } else {
      try {  // a repr never throws: members whose levels or data differ show member 0's
        shown = value_repr(td.get(k));
      } catch (const c10::Error&) {
        shown = value_repr(first);
      }
    }
    fields.push_back(k + ": " + shown);
  }
  std::string exclusive = "\n";
  const auto members = td.tensordicts();
  bool any = false;
  for (size_t i = 0; i < members.size(); ++i) {
    std::vector<std::string> own;
    for (const auto& [k, v] : members[i].entries()) {
      if (std::find(common.begin(), common.end(), k) == common.end())
        own.push_back(k + ": " + value_repr(v));
    }
    if (own.empty()) continue;
    exclusive += std::string(any ? ",\n" : "") +
                 indent(std::to_string(i) + " ->" + indent(fields_repr(own)));
    any = true;
  }
  const bool shared = td.device().has_value() && td.device()->is_cuda();
  std::vector<std::string> parts = {
      indent("fields={" + indent(fields_repr(fields)) + "}"),
      indent("exclusive_fields={" + exclusive + "}"),
      indent("batch_size=" + size_repr(td.batch_size())),
      indent("device=" + device_repr(td.device())),
      indent(std::string("is_shared=") + (shared ? "True" : "False")),
      indent("stack_dim=" + std::to_string(td.stack_dim())),
  };
  std::string out = "LazyStackedTensorDict(\n";
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? ",\n" : "") + parts[i];
  return out + ")";
}

std::string detailed_repr(const TensorDict& td, const std::string& type_name) {
  if (td.is_lazy_stack()) return lazy_repr(LazyStackedTensorDict::of(td));
  std::vector<std::string> fields;
  for (const auto& [key, value] : td.entries()) fields.push_back(key + ": " + value_repr(value));
  const bool shared = td.device().has_value() && td.device()->is_cuda();
  std::vector<std::string> parts = {
      indent("fields={" + indent(fields_repr(std::move(fields))) + "}"),
      indent("batch_size=" + size_repr(td.batch_size())),
      indent("device=" + device_repr(td.device())),
      indent(std::string("is_shared=") + (shared ? "True" : "False")),
  };
  std::string out = type_name + "(\n";
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? ",\n" : "") + parts[i];
  return out + ")";
}

// ---- the compact form (utils.py _compact_repr) ----------------------------------------------

constexpr size_t kWidth = 80;

// A value as the compact form shows it: a token (a leaf, a non-tensor entry) or a collection
// ("prefix{key: value, ...}").
struct ShownEntry;

struct Shown {
  std::string token;
  bool collection = false;
  std::string prefix;
  // Not std::pair<std::string, Shown>: a pair of an incomplete type, which clang refuses.
  std::vector<ShownEntry> entries;
};

struct ShownEntry {
  std::string first;  // the key
  Shown second;
};

std::string flat(const Shown& v) {
  if (!v.collection) return v.token;
  std::string out = v.prefix + "{";
  for (size_t i = 0; i < v.entries.size(); ++i) {
    out += (i ? ", " : "") + v.entries[i].first + ": " + flat(v.entries[i].second);
  }
  return out + "}";
}

// Sorted as the reference sorts them: by the text "key: value".
void sort_entries(std::vector<ShownEntry>& entries) {
  std::vector<std::pair<std::string, ShownEntry>> keyed;
  keyed.reserve(entries.size());
  for (auto& e : entries) keyed.emplace_back(e.first + ": " + flat(e.second), std::move(e));
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < keyed.size(); ++i) entries[i] = std::move(keyed[i].second);
}

// torch's short dtype names: "torch." dropped, float -> f, uint -> u, int -> i, complex -> c.
std::string short_dtype(at::ScalarType t) {
  std::string name = dtype_name(t);
  name = name.substr(name.find('.') + 1);
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"float", "f"},
                                 {"uint", "u"},
                                 {"int", "i"},
                                 {"complex", "c"}}) {
    for (size_t at = name.find(from); at != std::string::npos;
         at = name.find(from, at + to.size())) {
      name.replace(at, from.size(), to);
    }
  }
  return name;
}

std::string dims_str(at::IntArrayRef dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? "," : "") + std::to_string(dims[i]);
  return out + "]";
}

// "@cpu,meta" when the leaves are not all on the CPU and their level has no device.
std::string device_suffix(std::vector<std::string> devices,
                          const std::optional<at::Device>& level) {
  std::sort(devices.begin(), devices.end());
  devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
  if (level || (devices.size() == 1 && devices[0] == "cpu")) return "";
  std::string out = "@";
  for (size_t i = 0; i < devices.size(); ++i) out += (i ? "," : "") + devices[i];
  return out;
}

Shown token(std::string t) {
  Shown out;
  out.token = std::move(t);
  return out;
}

// A non-tensor entry: the type of its data, or its class for a stack or a MetaData.
Shown non_tensor_token(const NonTensorData& nt) {
  return token(nt.kind() == NonTensorKind::kData ? core::json_type_name(nt.data())
                                                 : nt.class_name());
}

Shown shown_level(const TensorDict& td, size_t outer_dims);

// The entries of the members of a lazy stack (flattened when they are lazy stacks too) at one
// key merged as the reference shows them: a dim that differs is -1, dtypes are promoted.
Shown merged(const std::vector<Value>& values, size_t member_dims,
             const std::optional<at::Device>& level_device) {
  const Value& first = values.front();
  if (first.is_non_tensor()) return non_tensor_token(first.non_tensor());
  if (first.is_tensor()) {
    at::ScalarType dtype = first.tensor().scalar_type();
    std::vector<int64_t> shape = first.tensor().sizes().slice(member_dims).vec();
    bool ragged = false;
    std::vector<std::string> devices;
    for (const auto& v : values) {
      if (!v.is_tensor()) continue;
      const at::Tensor& t = v.tensor();
      dtype = c10::promoteTypes(dtype, t.scalar_type());
      devices.push_back(t.device().str());
      const auto s = t.sizes().slice(std::min(member_dims, t.sizes().size()));
      if (s.size() != shape.size()) {
        ragged = true;
      } else {
        for (size_t d = 0; d < s.size(); ++d) {
          if (s[d] != shape[d]) shape[d] = -1;
        }
      }
    }
    if (ragged) shape = {-1};
    return token(short_dtype(dtype) + dims_str(shape) + device_suffix(devices, level_device));
  }
  // Nested levels: merged key by key over the members' levels.
  const TensorDict& td0 = first.tensordict();
  Shown out;
  out.collection = true;
  out.prefix = td0.is_lazy_stack() ? "LazyStackedTensorDict" : "";
  const auto extra = td0.batch_size().slice(std::min(member_dims, td0.batch_size().size()));
  if (!extra.empty()) out.prefix += dims_str(extra);
  if (td0.is_lazy_stack()) {
    out.entries = shown_level(td0, td0.batch_size().size()).entries;
    return out;
  }
  std::vector<TensorDict> levels;
  for (const auto& v : values) {
    if (v.is_tensordict()) levels.push_back(v.tensordict());
  }
  for (const auto& [key, child] : td0.entries()) {
    std::vector<Value> parts;
    for (const auto& l : levels) {
      if (const Value* p = l.find(key)) parts.push_back(*p);
    }
    if (parts.size() == levels.size()) {
      out.entries.emplace_back(key, merged(parts, td0.batch_size().size(), td0.device()));
    }
  }
  sort_entries(out.entries);
  return out;
}

// The members of a lazy stack flattened (members that are stacks too), each distinct one once:
// merging a part twice changes nothing, and shared members would make the list 2^depth long.
void flat_members(const TensorDict& td, std::vector<TensorDict>& out,
                  std::unordered_set<const detail::TensorDictImpl*>& seen) {
  for (const auto& m : LazyStackedTensorDict::of(td).tensordicts()) {
    if (!seen.insert(&detail::TensorDictImpl::of(m)).second) continue;
    if (m.is_lazy_stack()) {
      flat_members(m, out, seen);
    } else {
      out.push_back(m);
    }
  }
}

// A level's entries as shown in the fields of a level with `outer_dims` batch dims (feature
// dims are a leaf's dims after those).
Shown shown_level(const TensorDict& td, size_t outer_dims) {
  Shown out;
  out.collection = true;
  if (td.is_lazy_stack()) {
    std::vector<TensorDict> members;
    std::unordered_set<const detail::TensorDictImpl*> seen;
    flat_members(td, members, seen);
    const size_t member_dims = members.front().batch_size().size();
    for (const auto& key : detail::lazy::common_keys(td)) {
      std::vector<Value> parts;
      for (const auto& m : members) parts.push_back(m.get(key));
      out.entries.emplace_back(key, merged(parts, member_dims, td.device()));
    }
    sort_entries(out.entries);
    return out;
  }
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensor()) {
      const at::Tensor& t = value.tensor();
      // An unbatched leaf shows its whole shape.
      const auto dims = value.is_unbatched() ? t.sizes() : t.sizes().slice(outer_dims);
      out.entries.emplace_back(key, token(short_dtype(t.scalar_type()) + dims_str(dims) +
                                          device_suffix({t.device().str()}, td.device())));
    } else if (value.is_non_tensor()) {
      out.entries.emplace_back(key, non_tensor_token(value.non_tensor()));
    } else {
      const TensorDict& child = value.tensordict();
      Shown c = shown_level(child, child.batch_size().size());
      c.prefix = child.is_lazy_stack() ? "LazyStackedTensorDict" : "";
      const auto extra = child.batch_size().slice(outer_dims);
      if (!extra.empty()) c.prefix += dims_str(extra);
      out.entries.emplace_back(key, std::move(c));
    }
  }
  sort_entries(out.entries);
  return out;
}

std::string render(const Shown& v, const std::string& indent_by, size_t used, size_t tail) {
  std::string f = flat(v);
  if (!v.collection || v.entries.empty() || used + utf8_length(f) + tail <= kWidth) return f;
  const std::string pad = indent_by + "    ";
  std::string out = v.prefix + "{\n";
  for (size_t i = 0; i < v.entries.size(); ++i) {
    const auto& [k, e] = v.entries[i];
    const size_t vt = i + 1 == v.entries.size() ? tail + 1 : 1;
    out += (i ? ",\n" : "") + pad + k + ": " +
           render(e, pad, utf8_length(pad) + utf8_length(k) + 2, vt);
  }
  return out + "}";
}

// nested_names' "*": every nested TensorDict level shows `name` (a _SubTensorDict's levels).
void name_every_level(Shown& v, const std::string& name) {
  if (!v.collection) return;
  if (v.prefix.rfind("LazyStackedTensorDict", 0) != 0) v.prefix = name + v.prefix;
  for (auto& [k, e] : v.entries) name_every_level(e, name);
}

std::string compact_repr(const TensorDict& td, const std::string& type_name,
                         const ReprOptions& options) {
  std::string head = type_name + "(batch_size=" + dims_str(td.batch_size()) + ", ";
  if (td.device()) head += "device=" + td.device()->str() + ", ";
  // A tensorclass over a lazy stack does not show it (options.type_name is a tensorclass's).
  if (td.is_lazy_stack() && options.type_name.empty()) {
    head += "stack_dim=" + std::to_string(detail::stack_dim_of(td)) + ", ";
  }
  head += "fields=";
  // A lazy stack's keys that only some members have: each member's, by member index.
  Shown exclusive;
  exclusive.collection = true;
  if (td.is_lazy_stack()) {
    const auto common = detail::lazy::common_keys(td);
    const auto members = LazyStackedTensorDict::of(td).tensordicts();
    for (size_t i = 0; i < members.size(); ++i) {
      Shown own = shown_level(members[i], members[i].batch_size().size());
      std::erase_if(own.entries, [&](const auto& e) {
        return std::find(common.begin(), common.end(), e.first) != common.end();
      });
      if (!own.entries.empty()) exclusive.entries.emplace_back(std::to_string(i), std::move(own));
    }
  }
  const size_t tail =
      exclusive.entries.empty() ? 1 : 1 + std::string(", exclusive_fields={").size();
  Shown body = shown_level(td, td.batch_size().size());
  std::erase_if(body.entries, [&](const auto& e) {
    return std::find(options.hidden.begin(), options.hidden.end(), e.first) != options.hidden.end();
  });
  for (auto& [key, value] : body.entries) {
    for (const auto& [k, name] : options.nested_names) {
      if (k == "*") name_every_level(value, name);
      if (k == key && value.collection) value.prefix = name + value.prefix;
    }
  }
  if (!options.nested_names.empty()) sort_entries(body.entries);
  for (const auto& [key, t] : options.trailing) body.entries.emplace_back(key, token(t));
  std::string out = head + render(body, "", utf8_length(head), tail);
  if (!exclusive.entries.empty()) {
    const size_t last_line = out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1;
    const size_t used = utf8_length(std::string_view(out).substr(last_line)) +
                        std::string(", exclusive_fields=").size();
    out += ", exclusive_fields=" + render(exclusive, "", used, 1);
  }
  return out + ")";
}

}  // namespace

std::string NonTensorData::repr() const { return non_tensor_repr(*this); }

std::string TensorDict::repr(const ReprOptions& options) const {
  const std::string name = !options.type_name.empty() ? options.type_name
                           : is_lazy_stack()          ? "LazyStackedTensorDict"
                                                      : "TensorDict";
  return options.compact ? compact_repr(*this, name, options) : detailed_repr(*this, name);
}

std::ostream& operator<<(std::ostream& os, const TensorDict& td) { return os << td.repr(); }

}  // namespace tensordict

// The reference's detailed repr (tensordict.set_printoptions(compact=False)).

#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>

#include <algorithm>
#include <sstream>

#include "wire/json_text.h"
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
         ", dtype=" + dtype_name(t.scalar_type()) + ", is_shared=" + (is_shared(t) ? "True" : "False") +
         ")";
}

// The first or last `n` characters (code points) of UTF-8 text.
std::string_view utf8_head(std::string_view s, size_t n) {
  size_t i = 0;
  for (size_t k = 0; k < n && i < s.size(); ++k) {
    do ++i; while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xc0) == 0x80);
  }
  return s.substr(0, i);
}

std::string_view utf8_tail(std::string_view s, size_t n) {
  size_t i = s.size();
  for (size_t k = 0; k < n && i > 0; ++k) {
    do --i; while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xc0) == 0x80);
  }
  return s.substr(i);
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xc0) != 0x80;
  return n;
}

// NonTensorData.__repr__: str(data), cut to its first and last 20 characters past 200.
std::string non_tensor_repr(const NonTensorData& nt) {
  std::string data = wire::python_str(nt.data());
  if (utf8_length(data) > 200) {
    data = std::string(utf8_head(data, 20)) + "  ...  " + std::string(utf8_tail(data, 20));
  }
  return "NonTensorData(data=" + data + ", batch_size=" + size_repr(nt.batch_size()) +
         ", device=" + device_repr(nt.device()) + ")";
}

std::string value_repr(const Value& value) {
  return value.is_tensor()       ? tensor_repr(value.tensor())
         : value.is_non_tensor() ? non_tensor_repr(value.non_tensor())
                                 : value.tensordict().repr();
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
         ", dtype=" + dtype_name(first.scalar_type()) + ", is_shared=" +
         (shared ? "True" : "False") + ")";
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
      if (std::find(common.begin(), common.end(), k) == common.end()) own.push_back(k + ": " + value_repr(v));
    }
    if (own.empty()) continue;
    exclusive += std::string(any ? ",\n" : "") + indent(std::to_string(i) + " ->" + indent(fields_repr(own)));
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

}  // namespace

std::string TensorDict::repr() const {
  if (is_lazy_stack()) return lazy_repr(LazyStackedTensorDict::of(*this));
  std::vector<std::string> fields;
  for (const auto& [key, value] : entries()) fields.push_back(key + ": " + value_repr(value));
  const bool shared = device().has_value() && device()->is_cuda();
  std::vector<std::string> parts = {
      indent("fields={" + indent(fields_repr(std::move(fields))) + "}"),
      indent("batch_size=" + size_repr(batch_size())),
      indent("device=" + device_repr(device())),
      indent(std::string("is_shared=") + (shared ? "True" : "False")),
  };
  std::string out = "TensorDict(\n";
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? ",\n" : "") + parts[i];
  return out + ")";
}

std::ostream& operator<<(std::ostream& os, const TensorDict& td) { return os << td.repr(); }

}  // namespace tensordict

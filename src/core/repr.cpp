// The reference's detailed repr (tensordict.set_printoptions(compact=False)).

#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>

#include <algorithm>
#include <sstream>

#include "wire/json_text.h"
#include "tensordict/dtypes.h"
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

}  // namespace

std::string TensorDict::repr() const {
  std::vector<std::string> fields;
  for (const auto& [key, value] : entries()) {
    fields.push_back(key + ": " +
                     (value.is_tensor()       ? tensor_repr(value.tensor())
                      : value.is_non_tensor() ? non_tensor_repr(value.non_tensor())
                                              : value.tensordict().repr()));
  }
  // The reference sorts the formatted "key: value" strings, not the keys.
  std::sort(fields.begin(), fields.end());
  std::string joined = "\n";
  for (size_t i = 0; i < fields.size(); ++i) joined += (i ? ",\n" : "") + fields[i];
  const bool shared = device().has_value() && device()->is_cuda();
  std::vector<std::string> parts = {
      indent("fields={" + indent(joined) + "}"),
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

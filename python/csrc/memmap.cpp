// Binding of memmap.h: the MemoryMappedTensor factories and the TensorDict memmap functions as
// _C functions. tensordict_cpp.memmap (MemoryMappedTensor, a torch.Tensor subclass over these
// tensors) and the TensorDict methods own the Python conventions; paths arrive as str.

#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "tensordict/memmap.h"

namespace tensordict::python {

void bind_memmap(py::module_& m) {
  using Opt = std::optional<std::string>;
  m.def(
      "_memmap_from_tensor",
      [](const at::Tensor& t, const Opt& filename, bool existsok, bool copy_existing) {
        py::gil_scoped_release release;  // the copy may be large
        return MemoryMappedTensor::from_tensor(
            t, filename, {.existsok = existsok, .copy_existing = copy_existing});
      },
      py::arg("tensor"), py::arg("filename"), py::arg("existsok"), py::arg("copy_existing"));
  m.def(
      "_memmap_from_filename",
      [](const std::string& filename, at::ScalarType dtype, const std::vector<int64_t>& shape) {
        return MemoryMappedTensor::from_filename(filename, dtype, shape);
      },
      py::arg("filename"), py::arg("dtype"), py::arg("shape"));
  m.def(
      "_memmap_empty",
      [](const std::vector<int64_t>& shape, at::ScalarType dtype, const Opt& filename,
         bool existsok) {
        return MemoryMappedTensor::empty(shape, dtype, filename, {.existsok = existsok});
      },
      py::arg("shape"), py::arg("dtype"), py::arg("filename"), py::arg("existsok"));
  m.def("_is_memmap", [](const at::Tensor& t) { return is_memmap(t); }, py::arg("tensor"));
  m.def(
      "_memmap_filename", [](const at::Tensor& t) { return memmap_filename(t); },
      py::arg("tensor"));

  m.def(
      "_memmap_td",
      [](const TensorDict& td, const Opt& prefix, bool copy_existing, bool existsok) {
        py::gil_scoped_release release;
        return memmap(td, prefix, {.copy_existing = copy_existing, .existsok = existsok});
      },
      py::arg("td"), py::arg("prefix"), py::arg("copy_existing"), py::arg("existsok"));
  m.def(
      "_memmap_td_",
      [](TensorDict& td, const Opt& prefix, bool copy_existing, bool existsok) {
        py::gil_scoped_release release;
        memmap_(td, prefix, {.copy_existing = copy_existing, .existsok = existsok});
      },
      py::arg("td"), py::arg("prefix"), py::arg("copy_existing"), py::arg("existsok"));
  m.def(
      "_memmap_like",
      [](const TensorDict& td, const Opt& prefix, bool existsok) {
        py::gil_scoped_release release;
        return memmap_like(td, prefix, {.existsok = existsok});
      },
      py::arg("td"), py::arg("prefix"), py::arg("existsok"));
  m.def(
      "_load_memmap",
      [](const std::string& prefix) {
        py::gil_scoped_release release;
        return load_memmap(prefix);
      },
      py::arg("prefix"));
  m.def("_is_memmap_td", [](const TensorDict& td) { return is_memmap(td); }, py::arg("td"));
}

}  // namespace tensordict::python

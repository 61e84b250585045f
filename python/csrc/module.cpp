// tensordict_cpp._C: the pybind11 module. Errors cross to Python as the Errors table of
// STYLE.md says; everything else is in tensor_dict.cpp and distributed.cpp.

#include <c10/util/Exception.h>

#include "bindings.h"
#include "tensordict/errors.h"

namespace tensordict::python {
namespace {

// c10d's DistError family becomes torch.distributed's Python classes (all RuntimeErrors), as
// torch's own bindings raise them; looked up lazily so that importing _C needs no c10d.
PyObject* torch_exception(const char* name) {
  py::object cls = py::module_::import("torch._C").attr(name);
  return cls.ptr();  // torch._C keeps it alive
}

void translate(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const KeyError& e) {
    // KeyError's str() quotes its argument; the message is the whole argument, as the
    // reference raises it.
    PyErr_SetString(PyExc_KeyError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::DistBackendError& e) {
    PyErr_SetString(torch_exception("_DistBackendError"), e.what_without_backtrace());
  } catch (const c10::DistNetworkError& e) {
    PyErr_SetString(torch_exception("_DistNetworkError"), e.what_without_backtrace());
  } catch (const c10::DistStoreError& e) {
    PyErr_SetString(torch_exception("_DistStoreError"), e.what_without_backtrace());
  } catch (const c10::DistError& e) {
    PyErr_SetString(torch_exception("_DistError"), e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

// Raises each mapped C++ type, so that tests pin the mapping without provoking every error.
void raise_for_test(const std::string& kind, const std::string& msg) {
  if (kind == "KeyError") TD_CHECK_KEY(false, msg);
  if (kind == "ValueError") TORCH_CHECK_VALUE(false, msg);
  if (kind == "TypeError") TORCH_CHECK_TYPE(false, msg);
  if (kind == "IndexError") TORCH_CHECK_INDEX(false, msg);
  if (kind == "NotImplementedError") TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
  if (kind == "DistBackendError") C10_THROW_ERROR(DistBackendError, msg);
  if (kind == "RuntimeError") TORCH_CHECK(false, msg);
  if (kind == "InternalAssert") TORCH_INTERNAL_ASSERT(false, msg);
  TORCH_CHECK_VALUE(false, "unknown kind ", kind);
}

}  // namespace
}  // namespace tensordict::python

PYBIND11_MODULE(_C, m) {
  namespace tp = tensordict::python;
  m.doc() = "C++ core of tensordict_cpp (use the tensordict_cpp package, not this module)";
  pybind11::register_exception_translator(&tp::translate);
  m.def("_raise_for_test", &tp::raise_for_test, pybind11::arg("kind"), pybind11::arg("msg"));
  tp::bind_tensor_dict(m);
#ifdef TENSORDICT_WITH_DIST
  tp::bind_distributed(m);
  tp::bind_collectives(m);
  m.attr("has_distributed") = true;
#else
  m.attr("has_distributed") = false;
#endif
#ifdef TENSORDICT_WITH_PIPE
  tp::bind_pipe(m);
#endif
}

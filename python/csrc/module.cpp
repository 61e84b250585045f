// tensordict_cpp._C: the pybind11 module. Errors cross to Python in translate() below, the one
// mapping point, as the table of docs/errors.md says; everything else is in tensor_dict.cpp,
// memmap.cpp, distributed.cpp, collectives.cpp, publication.cpp and pipe.cpp.

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

// The classes of tensordict_cpp.errors, one per failure kind of errors.h; each derives from the
// built-in class its C++ base maps to below. Looked up once, when _C is imported (errors.py
// imports nothing of the package), and never freed: a translator may run until the interpreter
// ends, after static destructors would have released them.
struct ErrorClasses {
  py::object timeout, peer_lost, pipe_closed, peer_closed, schema_mismatch, malformed_peer_data,
      no_publisher, batch_size;
};
const ErrorClasses* error_classes = nullptr;

void load_error_classes() {
  py::module_ m = py::module_::import("tensordict_cpp.errors");
  error_classes = new ErrorClasses{m.attr("TimeoutError"),        m.attr("PeerLostError"),
                                   m.attr("PipeClosedError"),     m.attr("PeerClosedError"),
                                   m.attr("SchemaMismatchError"), m.attr("MalformedPeerDataError"),
                                   m.attr("NoPublisherError"),    m.attr("BatchSizeError")};
}

void set_error(const py::object& cls, const c10::Error& e) {
  PyErr_SetString(cls.ptr(), e.what_without_backtrace());
}

// Most-derived first: each of our types is caught before the c10 type it derives from.
void translate(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const TimeoutError& e) {
    set_error(error_classes->timeout, e);
  } catch (const PeerLostError& e) {
    set_error(error_classes->peer_lost, e);
  } catch (const PipeClosedError& e) {
    set_error(error_classes->pipe_closed, e);
  } catch (const PeerClosedError& e) {
    set_error(error_classes->peer_closed, e);
  } catch (const SchemaMismatchError& e) {
    set_error(error_classes->schema_mismatch, e);
  } catch (const MalformedPeerDataError& e) {
    set_error(error_classes->malformed_peer_data, e);
  } catch (const NoPublisherError& e) {
    set_error(error_classes->no_publisher, e);
  } catch (const BatchSizeError& e) {
    set_error(error_classes->batch_size, e);
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
  if (kind == "TimeoutError") TD_THROW(TimeoutError, msg);
  if (kind == "PeerLostError") TD_THROW(PeerLostError, msg);
  if (kind == "PipeClosedError") TD_THROW(PipeClosedError, msg);
  if (kind == "PeerClosedError") TD_THROW(PeerClosedError, msg);
  if (kind == "SchemaMismatchError") TD_THROW(SchemaMismatchError, msg);
  if (kind == "MalformedPeerDataError") TD_THROW(MalformedPeerDataError, msg);
  if (kind == "NoPublisherError") TD_THROW(NoPublisherError, msg);
  if (kind == "BatchSizeError") TD_THROW(BatchSizeError, msg);
  if (kind == "ValueError") TORCH_CHECK_VALUE(false, msg);
  if (kind == "TypeError") TORCH_CHECK_TYPE(false, msg);
  if (kind == "IndexError") TORCH_CHECK_INDEX(false, msg);
  if (kind == "NotImplementedError") TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
  if (kind == "DistBackendError") C10_THROW_ERROR(DistBackendError, msg);
  if (kind == "DistNetworkError") C10_THROW_ERROR(DistNetworkError, msg);
  if (kind == "DistStoreError") C10_THROW_ERROR(DistStoreError, msg);
  if (kind == "DistError") C10_THROW_ERROR(DistError, msg);
  if (kind == "RuntimeError") TORCH_CHECK(false, msg);
  if (kind == "InternalAssert") TORCH_INTERNAL_ASSERT(false, msg);
  TORCH_CHECK_VALUE(false, "unknown kind ", kind);
}

}  // namespace
}  // namespace tensordict::python

PYBIND11_MODULE(_C, m) {
  namespace tp = tensordict::python;
  m.doc() = "C++ core of tensordict_cpp (use the tensordict_cpp package, not this module)";
  tp::load_error_classes();
  pybind11::register_exception_translator(&tp::translate);
  m.def("_raise_for_test", &tp::raise_for_test, pybind11::arg("kind"), pybind11::arg("msg"));
  tp::bind_tensor_dict(m);
  tp::bind_memmap(m);
  tp::bind_observability(m);
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
  tp::bind_publication(m);
}

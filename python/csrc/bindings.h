#pragma once
// Shared pieces of the tensordict_cpp._C module: conversions between Python objects and the
// core's NestedKey / Value, and the per-area binding functions module.cpp calls.

#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <utility>

#include "tensordict/tensor_dict.h"
#ifdef TENSORDICT_WITH_DIST
#include "tensordict/distributed/options.h"
#endif

namespace tensordict::python {

namespace py = pybind11;

/// A str, or a non-empty tuple of str (nested tuples are flattened, as the reference does).
/// TypeError for anything else.
NestedKey key_from_py(py::handle key);
/// 'a' for a one-level key, ('a', 'b') for a path.
py::object key_to_py(const NestedKey& key);
/// A torch.Tensor, a _C.TensorDict or a _C.NonTensorData. TypeError for anything else.
Value value_from_py(py::handle value);
py::object value_to_py(const Value& value);
/// JSON-like Python data (str, int, float, bool, None, lists and str-keyed dicts of them) as
/// the data of the non-tensor entry `key`; TypeError naming the key and the position for
/// anything else, ValueError for an int outside int64 or data nested too deep.
JsonValue json_from_py(py::handle value, const NestedKey& key);

/// Binds `fn` as `scope.name` (a module function or a method) with the extras of `args`, a tuple
/// of py::arg, py::arg_v and py::kw_only: the bindings of one area build that tuple in one helper
/// (p2p_args, pipe_option_args, ...), so each argument's name and default is written once and
/// help() shows them.
template <class Scope, class F, class... Extra>
void def(Scope& scope, const char* name, F&& fn, const std::tuple<Extra...>& args) {
  std::apply([&](const Extra&... extra) { scope.def(name, std::forward<F>(fn), extra...); }, args);
}

/// The same for a static method of a bound class.
template <class Class, class F, class... Extra>
void def_static(Class& cls, const char* name, F&& fn, const std::tuple<Extra...>& args) {
  std::apply([&](const Extra&... extra) { cls.def_static(name, std::forward<F>(fn), extra...); },
             args);
}

void bind_tensor_dict(py::module_& m);
void bind_observability(py::module_& m);
void bind_memmap(py::module_& m);
#ifdef TENSORDICT_WITH_DIST
/// `group=None`: a torch ProcessGroup, a c10d Backend, or None (see group_from_py).
inline py::arg_v group_arg() { return py::arg("group") = py::none(); }
/// `timeout=None`: a transfer's timeout in seconds, None for the group's (see timeout_from_py).
inline py::arg_v timeout_arg() { return py::arg("timeout") = py::none(); }

/// A torch ProcessGroup, a bare c10d Backend, or None (the default group). TypeError otherwise.
dist::Group group_from_py(py::handle group);
/// torch's Python Work objects.
py::list works_to_py(const std::vector<dist::WorkPtr>& works);
/// A transfer's `timeout` in seconds (the Python layer turns a timedelta into seconds) as the
/// options take it, rounded up to whole milliseconds; the core refuses one that is not positive.
std::optional<std::chrono::milliseconds> timeout_from_py(std::optional<double> seconds);

/// A receive's `late=` ("deliver" or "drop"; ValueError otherwise).
dist::Late late_from_py(const std::string& late);
void bind_collectives(py::module_& m);
#endif
void bind_distributed(py::module_& m);
void bind_pipe(py::module_& m);
/// _C.Publisher and _C.Subscriber (c10d), _C.PipePublisher and _C.PipeSubscriber (the pipe).
void bind_publication(py::module_& m);

}  // namespace tensordict::python

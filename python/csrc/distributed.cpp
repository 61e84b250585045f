// Binding of the point-to-point calls of tensordict::dist. Groups arrive as torch's own Python
// objects (torch.distributed.ProcessGroup, or a bare Backend such as ProcessGroupGloo built on
// a store) and Work handles leave as torch's Python Work: both types are registered by
// torch._C with pybind11, which this module shares (same pybind11 internals).
//
// The Python layer resolves global ranks with torch.distributed before calling here (torch's
// registry of groups is the Python one), so these functions see either a group peer or no peer
// at all (then the core raises the reference's ValueError).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cmath>
#include <optional>
#include <string>

#include "bindings.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"

namespace tensordict::python {
namespace {

// intrusive_ptr keeps its count in the object, so a raw pointer from pybind11 makes a new owning
// reference whatever holder torch registered the class with.
template <typename T>
bool load_intrusive(py::handle obj, c10::intrusive_ptr<T>* out) {
  py::detail::make_caster<T> caster;
  if (!caster.load(obj, /*convert=*/false)) {
    return false;
  }
  *out = c10::intrusive_ptr<T>::reclaim_copy(&py::detail::cast_op<T&>(caster));
  return true;
}

dist::SendOptions send_options(py::handle group, std::optional<int64_t> group_dst, int64_t init_tag,
                               bool pseudo_rand, bool consolidated, bool checked,
                               std::optional<double> timeout) {
  return {.group = group_from_py(group),
          .group_dst = group_dst,
          .init_tag = init_tag,
          .pseudo_rand = pseudo_rand,
          .consolidated = consolidated,
          .checked = checked,
          .timeout = timeout_from_py(timeout)};
}

dist::RecvOptions recv_options(py::handle group, std::optional<int64_t> group_src, int64_t init_tag,
                               bool pseudo_rand, bool consolidated, bool checked,
                               std::optional<double> timeout, const std::string& late) {
  return {.group = group_from_py(group),
          .group_src = group_src,
          .init_tag = init_tag,
          .pseudo_rand = pseudo_rand,
          .consolidated = consolidated,
          .checked = checked,
          .timeout = timeout_from_py(timeout),
          .late = late_from_py(late)};
}

}  // namespace

dist::Group group_from_py(py::handle obj) {
  if (obj.is_none()) {
    return {};
  }
  // torch.distributed.new_group's answer to a rank outside the group (an int sentinel there),
  // refused by every call as ours is (dist::non_group_member()).
  static const py::handle non_member = [] {  // kept for the process's life (none at exit)
    py::object v =
        py::module_::import("torch.distributed").attr("GroupMember").attr("NON_GROUP_MEMBER");
    return v.release();
  }();
  if (obj.equal(non_member) && !PyBool_Check(obj.ptr())) return dist::non_group_member();
  dist::ProcessGroupPtr pg;
  if (load_intrusive(obj, &pg)) {
    return pg;
  }
  dist::BackendPtr backend;
  if (load_intrusive(obj, &backend)) {
    return backend;
  }
  C10_THROW_ERROR(TypeError,
                  c10::str("group must be a torch.distributed.ProcessGroup, a c10d Backend or "
                           "None, got ",
                           py::str(py::type::of(obj)).cast<std::string>()));
}

std::optional<std::chrono::milliseconds> timeout_from_py(std::optional<double> seconds) {
  if (!seconds) return std::nullopt;
  TORCH_CHECK_VALUE(std::isfinite(*seconds) && *seconds > 0,
                    "timeout must be a positive number of seconds, got ", *seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(*seconds * 1000)));
}

dist::Late late_from_py(const std::string& late) {
  if (late == "deliver") return dist::Late::kDeliver;
  TORCH_CHECK_VALUE(late == "drop", "late must be \"deliver\" or \"drop\", got \"", late, "\"");
  return dist::Late::kDrop;
}

py::list works_to_py(const std::vector<dist::WorkPtr>& works) {
  py::list out;
  for (const auto& w : works) out.append(py::cast(w));
  return out;
}

namespace {

// The arguments of every point-to-point binding, as the reference's send / recv name them (with
// `peer` "dst" or "src"), and ours: checked and timeout. Defaults are those of the options.
auto p2p_args(const char* peer, const char* group_peer) {
  const dist::SendOptions d;
  return std::make_tuple(py::arg("td"), py::arg(peer) = py::none(), py::kw_only(), group_arg(),
                         py::arg(group_peer) = py::none(), py::arg("init_tag") = d.init_tag,
                         py::arg("pseudo_rand") = d.pseudo_rand,
                         py::arg("consolidated") = d.consolidated, py::arg("checked") = d.checked,
                         timeout_arg());
}

// The receiving bindings' arguments: p2p_args and `late`.
auto recv_p2p_args() {
  return std::tuple_cat(p2p_args("src", "group_src"), std::make_tuple(py::arg("late") = "deliver"));
}

// A point-to-point binding: the Python arguments p2p_args names (and, for the receives, the
// `Extra` ones recv_p2p_args adds) become the call's options (made by `options`, with the GIL
// held), then `call(td, peer, options)` runs.
template <typename... Extra, typename MakeOptions, typename Call>
auto p2p(MakeOptions options, Call call) {
  return [options, call](const TensorDict& td, std::optional<int64_t> peer, py::object group,
                         std::optional<int64_t> group_peer, int64_t init_tag, bool pseudo_rand,
                         bool consolidated, bool checked, std::optional<double> timeout,
                         Extra... extra) {
    return call(td, peer,
                options(group, group_peer, init_tag, pseudo_rand, consolidated, checked, timeout,
                        extra...));
  };
}

// The transfer with the GIL released; Work handles leave as torch's Python objects.
template <auto Fn>
auto released = [](const TensorDict& td, std::optional<int64_t> peer, const auto& options) {
  using Result = decltype(Fn(td, peer, options));
  if constexpr (std::is_void_v<Result>) {
    py::gil_scoped_release nogil;
    Fn(td, peer, options);
  } else if constexpr (std::is_same_v<Result, std::vector<dist::WorkPtr>>) {
    Result works;
    {
      py::gil_scoped_release nogil;
      works = Fn(td, peer, options);
    }
    return works_to_py(works);
  } else {
    py::gil_scoped_release nogil;
    return Fn(td, peer, options);
  }
};

// recv / irecv into a SubTensorDict (the rows of a parent): p2p's arguments.
template <typename Fn>
auto p2p_rows(Fn fn) {
  return
      [fn](const SubTensorDict& rows, std::optional<int64_t> peer, py::object group,
           std::optional<int64_t> group_peer, int64_t init_tag, bool pseudo_rand, bool consolidated,
           bool checked, std::optional<double> timeout, const std::string& late) {
        const auto o = recv_options(group, group_peer, init_tag, pseudo_rand, consolidated, checked,
                                    timeout, late);
        py::gil_scoped_release nogil;
        return fn(rows, peer, o);
      };
}

}  // namespace

void bind_distributed(py::module_& m) {
  const auto send_args = p2p_args("dst", "group_dst");
  const auto recv_args = recv_p2p_args();
  def(m, "send", p2p(send_options, released<&dist::send>), send_args);
  def(m, "isend", p2p(send_options, released<&dist::isend>), send_args);
  def(m, "isend_early", p2p(send_options, released<&dist::isend_early>), send_args);
  // recv and irecv are overloaded for SubTensorDict; these pick the TensorDict ones.
  using Recv = std::optional<int64_t> (*)(const TensorDict&, std::optional<int64_t>,
                                          const dist::RecvOptions&);
  using IRecv = void (*)(const TensorDict&, std::optional<int64_t>, const dist::RecvOptions&);
  using Late = const std::string&;  // recv_p2p_args' `late`
  def(m, "recv", p2p<Late>(recv_options, released<static_cast<Recv>(&dist::recv)>), recv_args);
  def(m, "irecv", p2p<Late>(recv_options, released<static_cast<IRecv>(&dist::irecv)>), recv_args);
  def(m, "irecv_premature", p2p<Late>(recv_options, released<&dist::irecv_premature>), recv_args);
  def(m, "recv_rows",
      p2p_rows([](const SubTensorDict& rows, std::optional<int64_t> peer,
                  const dist::RecvOptions& o) { return dist::recv(rows, peer, o); }),
      recv_args);
  def(m, "irecv_rows",
      p2p_rows([](const SubTensorDict& rows, std::optional<int64_t> peer,
                  const dist::RecvOptions& o) { dist::irecv(rows, peer, o); }),
      recv_args);
}

}  // namespace tensordict::python

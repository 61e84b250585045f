// Binding of init_remote / from_remote_init and the collectives of tensordict::dist. As in
// distributed.cpp, the Python layer has already turned global ranks into group ranks and
// resolved `group=None` to torch's default group (torch's registry is the Python one), so these
// functions always receive a group and, where a peer is needed, its rank in that group.

#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "tensordict/distributed/collectives.h"
#include "tensordict/distributed/init_remote.h"

namespace tensordict::python {
namespace {

py::list tds_to_py(const std::vector<TensorDict>& tds) {
  py::list out;
  for (const auto& td : tds) out.append(py::cast(td));
  return out;
}

// The arguments the collectives share, each named and defaulted once; the ranks are group ranks
// (the Python layer maps them), the other names are the Python methods' (device,
// max_total_bytes, _tensorclass_type, ...).
py::arg_v device_arg() { return py::arg("device") = py::none(); }
py::arg_v max_total_bytes_arg() { return py::arg("max_total_bytes") = py::none(); }
py::arg_v tensorclass_type_arg() { return py::arg("_tensorclass_type") = py::none(); }
py::arg_v use_broadcast_arg() {
  return py::arg("use_broadcast") = dist::InitRemoteOptions{}.use_broadcast;
}
py::arg_v async_op_arg() { return py::arg("async_op") = false; }
py::arg_v check_buckets_arg() {
  return py::arg("check_buckets") = dist::AllReduceOptions{}.check_buckets;
}

// Arguments are converted with the GIL held; the transfers run without it. from_remote_init and
// broadcast return (TensorDict, the sender's tensorclass type or None): the Python layer
// resolves the type against its tensorclass registry.

// init_remote and from_remote_init.
void bind_remote(py::module_& m) {
  def(
      m, "init_remote",
      [](const TensorDict& td, std::optional<int64_t> group_dst, py::object group,
         std::optional<at::Device> device, bool use_broadcast,
         std::optional<std::string> tensorclass_type, std::optional<double> timeout) {
        dist::InitRemoteOptions o{.group = group_from_py(group),
                                  .group_dst = group_dst,
                                  .device = device,
                                  .use_broadcast = use_broadcast,
                                  .tensorclass_type = std::move(tensorclass_type),
                                  .timeout = timeout_from_py(timeout)};
        py::gil_scoped_release nogil;
        return dist::init_remote(td, std::nullopt, o);
      },
      std::make_tuple(py::arg("td"), py::kw_only(), py::arg("group_dst") = py::none(), group_arg(),
                      device_arg(), use_broadcast_arg(), tensorclass_type_arg(), timeout_arg()));
  def(
      m, "from_remote_init",
      [](std::optional<int64_t> group_src, py::object group, std::optional<at::Device> device,
         bool use_broadcast, std::optional<int64_t> max_total_bytes, std::optional<double> timeout,
         const std::string& late) {
        dist::FromRemoteInitOptions o{.group = group_from_py(group),
                                      .group_src = group_src,
                                      .device = device,
                                      .use_broadcast = use_broadcast,
                                      .max_total_bytes = max_total_bytes,
                                      .timeout = timeout_from_py(timeout),
                                      .late = late_from_py(late)};
        std::optional<std::string> type;
        TensorDict out;
        {
          py::gil_scoped_release nogil;
          out = dist::from_remote_init(std::nullopt, o, &type);
        }
        return std::make_pair(out, type);
      },
      std::make_tuple(py::arg("group_src"), py::kw_only(), group_arg(), device_arg(),
                      use_broadcast_arg(), max_total_bytes_arg(), timeout_arg(),
                      py::arg("late") = "deliver"));
}

// The collectives that move whole TensorDicts: broadcast, all_gather, scatter, gather_and_stack.
void bind_moving(py::module_& m) {
  def(
      m, "broadcast",
      [](const TensorDict& td, std::optional<int64_t> group_src, py::object group,
         std::optional<at::Device> device, std::optional<int64_t> max_total_bytes,
         std::optional<std::string> tensorclass_type, std::optional<double> timeout) {
        dist::BroadcastOptions o{.group = group_from_py(group),
                                 .group_src = group_src,
                                 .device = device,
                                 .max_total_bytes = max_total_bytes,
                                 .tensorclass_type = std::move(tensorclass_type),
                                 .timeout = timeout_from_py(timeout)};
        std::optional<std::string> type;
        TensorDict out;
        {
          py::gil_scoped_release nogil;
          out = dist::broadcast(td, std::nullopt, o, &type);
        }
        return std::make_pair(out, type);
      },
      std::make_tuple(py::arg("td"), py::arg("group_src"), py::kw_only(), group_arg(), device_arg(),
                      max_total_bytes_arg(), tensorclass_type_arg(), timeout_arg()));
  def(
      m, "all_gather",
      [](const TensorDict& td, py::object group, std::optional<int64_t> max_total_bytes,
         std::optional<double> timeout) {
        dist::AllGatherOptions o{.group = group_from_py(group),
                                 .max_total_bytes = max_total_bytes,
                                 .timeout = timeout_from_py(timeout)};
        std::vector<TensorDict> out;
        {
          py::gil_scoped_release nogil;
          out = dist::all_gather(td, o);
        }
        return tds_to_py(out);
      },
      std::make_tuple(py::arg("td"), py::kw_only(), group_arg(), max_total_bytes_arg(),
                      timeout_arg()));
  def(
      m, "scatter",
      [](std::optional<int64_t> group_src, const std::vector<TensorDict>& tds, py::object group,
         std::optional<at::Device> device, std::optional<int64_t> max_total_bytes,
         std::optional<double> timeout) {
        dist::ScatterOptions o{.group = group_from_py(group),
                               .group_src = group_src,
                               .device = device,
                               .max_total_bytes = max_total_bytes,
                               .timeout = timeout_from_py(timeout)};
        py::gil_scoped_release nogil;
        return dist::scatter(std::nullopt, tds, o);
      },
      std::make_tuple(py::arg("group_src"), py::arg("tensordicts"), py::kw_only(), group_arg(),
                      device_arg(), max_total_bytes_arg(), timeout_arg()));
  def(
      m, "gather_and_stack",
      [](const TensorDict& td, int64_t group_dst, py::object group,
         std::optional<int64_t> max_total_bytes, std::optional<double> timeout) -> py::object {
        dist::GatherAndStackOptions o{.group = group_from_py(group),
                                      .group_dst = group_dst,
                                      .max_total_bytes = max_total_bytes,
                                      .timeout = timeout_from_py(timeout)};
        std::optional<TensorDict> out;
        {
          py::gil_scoped_release nogil;
          out = dist::gather_and_stack(td, std::nullopt, o);
        }
        return out ? py::cast(*out) : py::object(py::none());
      },
      std::make_tuple(py::arg("td"), py::arg("group_dst"), py::kw_only(), group_arg(),
                      max_total_bytes_arg(), timeout_arg()));
}

// The reductions: all_reduce and reduce.
void bind_reductions(py::module_& m) {
  def(
      m, "all_reduce",
      [](const TensorDict& td, const c10d::ReduceOp& op, bool async_op, py::object group,
         std::optional<double> timeout, std::optional<int64_t> bucket_bytes,
         bool check_buckets) -> py::object {
        dist::AllReduceOptions o{.op = op,
                                 .async_op = false,
                                 .group = group_from_py(group),
                                 .timeout = timeout_from_py(timeout),
                                 .bucket_bytes = bucket_bytes,
                                 .check_buckets = check_buckets};
        std::vector<dist::WorkPtr> works;
        {
          py::gil_scoped_release nogil;
          if (async_op) {
            works = dist::all_reduce_async(td, o);
          } else {
            dist::all_reduce(td, o);
          }
        }
        return async_op ? py::object(works_to_py(works)) : py::object(py::none());
      },
      std::make_tuple(py::arg("td"), py::arg("op"), py::kw_only(), async_op_arg(), group_arg(),
                      timeout_arg(), py::arg("bucket_bytes") = py::none(), check_buckets_arg()));
  def(
      m, "reduce",
      [](const TensorDict& td, int64_t group_dst, const c10d::ReduceOp& op, bool async_op,
         bool return_premature, py::object group, std::optional<double> timeout,
         std::optional<int64_t> bucket_bytes, bool check_buckets) -> py::object {
        dist::ReduceOptions o{.op = op,
                              .async_op = async_op,
                              .group = group_from_py(group),
                              .group_dst = group_dst,
                              .timeout = timeout_from_py(timeout),
                              .bucket_bytes = bucket_bytes,
                              .check_buckets = check_buckets};
        std::vector<dist::WorkPtr> works;
        const bool premature = async_op && return_premature;
        {
          py::gil_scoped_release nogil;
          if (premature) {
            works = dist::reduce_premature(td, std::nullopt, o);
          } else {
            dist::reduce(td, std::nullopt, o);
          }
        }
        return premature ? py::object(works_to_py(works)) : py::object(py::none());
      },
      std::make_tuple(py::arg("td"), py::arg("group_dst"), py::arg("op"), py::kw_only(),
                      async_op_arg(), py::arg("return_premature") = false, group_arg(),
                      timeout_arg(), py::arg("bucket_bytes") = py::none(), check_buckets_arg()));
}

}  // namespace

void bind_collectives(py::module_& m) {
  bind_remote(m);
  bind_moving(m);
  bind_reductions(m);
}

}  // namespace tensordict::python

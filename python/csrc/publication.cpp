// Binding of tensordict::dist's Publisher and Subscriber (docs/publication.md). As in
// distributed.cpp, the Python layer (python/tensordict_cpp/publication.py) has turned global
// ranks into group ranks and `group=None` into torch's default group; every call that waits
// releases the GIL.

#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "tensordict/distributed/publication.h"

namespace tensordict::python {
namespace {

// A pull's or a publish's timeout in seconds: 0 allowed (a poll), unlike a transfer's.
std::optional<std::chrono::milliseconds> wait_from_py(std::optional<double> seconds) {
  if (!seconds) return std::nullopt;
  TORCH_CHECK_VALUE(std::isfinite(*seconds) && *seconds >= 0,
                    "timeout must be a number of seconds >= 0 or None, got ", *seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(*seconds * 1000)));
}

py::dict stats_to_py(const dist::SubscriberStats& s) {
  py::dict d;
  d["rank"] = s.rank;
  d["version"] = s.version ? py::cast(*s.version) : py::none();
  d["pulls"] = s.pulls;
  d["pinned"] = s.pinned ? py::cast(*s.pinned) : py::none();
  d["waiting"] = s.waiting;
  d["lost"] = s.lost;
  d["error"] = s.error.empty() ? py::none() : py::cast(s.error);
  return d;
}

}  // namespace

void bind_publication(py::module_& m) {
  py::class_<dist::Publisher>(m, "Publisher")
      .def(py::init([](py::object group, int64_t max_slots, std::vector<int64_t> subscribers,
                       int64_t channel) {
             dist::PublisherOptions o{.group = group_from_py(group),
                                      .max_slots = max_slots,
                                      .subscribers = std::move(subscribers),
                                      .channel = channel};
             py::gil_scoped_release nogil;
             return std::make_unique<dist::Publisher>(o);
           }),
           py::kw_only(), group_arg(), py::arg("max_slots") = 2,
           py::arg("subscribers") = std::vector<int64_t>{}, py::arg("channel") = 0)
      .def(
          "publish",
          [](dist::Publisher& p, const TensorDict& td, std::optional<double> timeout,
             std::optional<std::string> tensorclass_type) {
            const auto wait = wait_from_py(timeout);
            py::gil_scoped_release nogil;
            return p.publish(td, wait, tensorclass_type);
          },
          py::arg("td"), py::kw_only(), timeout_arg(), py::arg("_tensorclass_type") = py::none())
      .def_property_readonly("epoch", &dist::Publisher::epoch)
      .def_property_readonly("version", &dist::Publisher::version)
      .def("stats",
           [](const dist::Publisher& p) {
             py::list out;
             for (const auto& s : p.stats()) out.append(stats_to_py(s));
             return out;
           })
      .def(
          "wait_for_subscribers",
          [](const dist::Publisher& p, double timeout) {
            const auto wait = wait_from_py(timeout);
            py::gil_scoped_release nogil;
            p.wait_for_subscribers(*wait);
          },
          py::arg("timeout"))
      .def("close", &dist::Publisher::close, py::call_guard<py::gil_scoped_release>());

  py::class_<dist::Subscriber>(m, "Subscriber")
      .def(py::init([](int64_t group_src, py::object group, int64_t channel,
                       std::optional<int64_t> max_total_bytes) {
             dist::SubscriberOptions o{.group = group_from_py(group),
                                       .group_src = group_src,
                                       .channel = channel,
                                       .max_total_bytes = max_total_bytes};
             py::gil_scoped_release nogil;
             return std::make_unique<dist::Subscriber>(o);
           }),
           py::arg("group_src"), py::kw_only(), group_arg(), py::arg("channel") = 0,
           py::arg("max_total_bytes") = py::none())
      .def(
          "pull_into",
          [](dist::Subscriber& s, TensorDict& td, std::optional<double> timeout,
             std::optional<int64_t> min_version) {
            dist::PullOptions o{.timeout = wait_from_py(timeout), .min_version = min_version};
            py::gil_scoped_release nogil;
            return s.pull(td, o);
          },
          py::arg("td"), py::kw_only(), timeout_arg(), py::arg("min_version") = py::none())
      .def(
          "pull_new",
          [](dist::Subscriber& s, std::optional<double> timeout,
             std::optional<int64_t> min_version) -> py::object {
            dist::PullOptions o{.timeout = wait_from_py(timeout), .min_version = min_version};
            std::optional<dist::Pulled> pulled;
            {
              py::gil_scoped_release nogil;
              pulled = s.pull(o);
            }
            if (!pulled) return py::none();
            return py::make_tuple(std::move(pulled->td), pulled->version,
                                  pulled->tensorclass_type);
          },
          py::kw_only(), timeout_arg(), py::arg("min_version") = py::none())
      .def_property_readonly("version", &dist::Subscriber::version)
      .def_property_readonly("epoch", &dist::Subscriber::epoch);
}

}  // namespace tensordict::python

// Binding of publication (docs/publication.md): tensordict::dist's Publisher and Subscriber as
// _C.Publisher / _C.Subscriber, tensordict::pipe's as _C.PipePublisher / _C.PipeSubscriber,
// with the same methods, bound once for both (publisher_methods, subscriber_methods): only the
// constructors differ. As in distributed.cpp, the Python layer
// (python/tensordict_cpp/publication.py) has turned global ranks into group ranks and
// `group=None` into torch's default group; every call that waits releases the GIL.

#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "tensordict/publication.h"
#ifdef TENSORDICT_WITH_DIST
#include "tensordict/distributed/publication.h"
#endif
#ifdef TENSORDICT_WITH_PIPE
#include "tensordict/pipe/publication.h"
#endif

namespace tensordict::python {
namespace {

// A pull's or a publish's timeout in seconds: 0 allowed (a poll), unlike a transfer's.
std::optional<std::chrono::milliseconds> wait_from_py(std::optional<double> seconds) {
  if (!seconds) return std::nullopt;
  TORCH_CHECK_VALUE(std::isfinite(*seconds) && *seconds >= 0,
                    "timeout must be a number of seconds >= 0 or None, got ", *seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(*seconds * 1000)));
}

py::arg_v wait_arg() { return py::arg("timeout") = py::none(); }

py::dict stats_to_py(const SubscriberStats& s) {
  py::dict d;
  d["rank"] = s.rank >= 0 ? py::cast(s.rank) : py::none();
  d["peer"] = s.peer;
  d["version"] = s.version ? py::cast(*s.version) : py::none();
  d["pulls"] = s.pulls;
  d["pinned"] = s.pinned ? py::cast(*s.pinned) : py::none();
  d["waiting"] = s.waiting;
  d["lost"] = s.lost;
  d["error"] = s.error.empty() ? py::none() : py::cast(s.error);
  d["transport"] = s.transport;
  d["relayed_from"] = s.relayed_from ? py::cast(*s.relayed_from) : py::none();
  d["relayed_second"] = s.relayed_second ? py::cast(*s.relayed_second) : py::none();
  d["routed_around"] = s.routed_around.empty() ? py::none() : py::cast(s.routed_around);
  return d;
}

// What the two Publishers share.
template <class P>
void publisher_methods(py::class_<P>& cls) {
  cls.def(
         "publish",
         [](P& p, const TensorDict& td, std::optional<double> timeout,
            std::optional<std::string> tensorclass_type) {
           const auto wait = wait_from_py(timeout);
           py::gil_scoped_release nogil;
           return p.publish(td, wait, tensorclass_type);
         },
         py::arg("td"), py::kw_only(), wait_arg(), py::arg("_tensorclass_type") = py::none())
      .def(
          "wait_for_subscribers",
          [](const P& p, double timeout, std::optional<size_t> count) {
            const auto wait = wait_from_py(timeout);
            py::gil_scoped_release nogil;
            p.wait_for_subscribers(*wait, count);
          },
          py::arg("timeout"), py::kw_only(), py::arg("count") = py::none())
      .def_property_readonly("epoch", &P::epoch)
      .def_property_readonly("version", &P::version)
      .def("stats",
           [](const P& p) {
             py::list out;
             for (const auto& s : p.stats()) out.append(stats_to_py(s));
             return out;
           })
      .def("close", &P::close, py::call_guard<py::gil_scoped_release>());
}

// What the two Subscribers share.
template <class S>
void subscriber_methods(py::class_<S>& cls) {
  cls.def(
         "pull_into",
         [](S& s, TensorDict& td, std::optional<double> timeout, std::optional<int64_t> min_version,
            bool zero_copy) {
           PullOptions o{.timeout = wait_from_py(timeout),
                         .min_version = min_version,
                         .zero_copy = zero_copy};
           py::gil_scoped_release nogil;
           return s.pull(td, o);
         },
         py::arg("td"), py::kw_only(), wait_arg(), py::arg("min_version") = py::none(),
         py::arg("zero_copy") = false)
      .def(
          "pull_new",
          [](S& s, std::optional<double> timeout, std::optional<int64_t> min_version,
             bool zero_copy) -> py::object {
            PullOptions o{.timeout = wait_from_py(timeout),
                          .min_version = min_version,
                          .zero_copy = zero_copy};
            std::optional<Pulled> pulled;
            {
              py::gil_scoped_release nogil;
              pulled = s.pull(o);
            }
            if (!pulled) return py::none();
            return py::make_tuple(std::move(pulled->td), pulled->version, pulled->tensorclass_type);
          },
          py::kw_only(), wait_arg(), py::arg("min_version") = py::none(),
          py::arg("zero_copy") = false)
      .def("interrupt", &S::interrupt, py::arg("on") = true)
      .def("release", &S::release)
      .def_property_readonly("transport", &S::transport)
      .def_property_readonly("routed_around", &S::routed_around)
      .def_property_readonly("version", &S::version)
      .def_property_readonly("epoch", &S::epoch)
      .def_property_readonly("publisher_closed", &S::publisher_closed);
}

}  // namespace

void bind_publication(py::module_& m) {
#ifdef TENSORDICT_WITH_DIST
  py::class_<dist::Publisher> publisher(m, "Publisher");
  publisher.def(py::init([](py::object group, int64_t max_slots, std::vector<int64_t> subscribers,
                            int64_t channel, std::string transport, std::string route) {
                  dist::PublisherOptions o{.group = group_from_py(group),
                                           .max_slots = max_slots,
                                           .subscribers = std::move(subscribers),
                                           .channel = channel,
                                           .transport = std::move(transport),
                                           .route = std::move(route)};
                  py::gil_scoped_release nogil;
                  return std::make_unique<dist::Publisher>(o);
                }),
                py::kw_only(), group_arg(), py::arg("max_slots") = 2,
                py::arg("subscribers") = std::vector<int64_t>{}, py::arg("channel") = 0,
                py::arg("transport") = "auto", py::arg("route") = "star");
  publisher_methods(publisher);

  py::class_<dist::Subscriber> subscriber(m, "Subscriber");
  subscriber.def(py::init([](int64_t group_src, py::object group, int64_t channel,
                             std::optional<int64_t> max_total_bytes, std::string transport) {
                   dist::SubscriberOptions o{.group = group_from_py(group),
                                             .group_src = group_src,
                                             .channel = channel,
                                             .max_total_bytes = max_total_bytes,
                                             .transport = std::move(transport)};
                   py::gil_scoped_release nogil;
                   return std::make_unique<dist::Subscriber>(o);
                 }),
                 py::arg("group_src"), py::kw_only(), group_arg(), py::arg("channel") = 0,
                 py::arg("max_total_bytes") = py::none(), py::arg("transport") = "auto");
  subscriber_methods(subscriber);
#endif
#ifdef TENSORDICT_WITH_PIPE
  py::class_<pipe::Publisher> pipe_publisher(m, "PipePublisher");
  pipe_publisher.def(
      py::init([](pipe::TensorDictServer& server, int64_t max_slots, std::string transport) {
        py::gil_scoped_release nogil;
        return std::make_unique<pipe::Publisher>(
            server, pipe::PublisherOptions{max_slots, std::move(transport)});
      }),
      py::arg("server"), py::kw_only(), py::arg("max_slots") = 2, py::arg("transport") = "auto",
      py::keep_alive<1, 2>());
  publisher_methods(pipe_publisher);

  py::class_<pipe::Subscriber> pipe_subscriber(m, "PipeSubscriber");
  pipe_subscriber.def(py::init([](const pipe::Pipe& p, std::optional<int64_t> max_total_bytes,
                                  std::string transport) {
                        py::gil_scoped_release nogil;
                        return std::make_unique<pipe::Subscriber>(
                            p, pipe::SubscriberOptions{max_total_bytes, std::move(transport)});
                      }),
                      py::arg("pipe"), py::kw_only(), py::arg("max_total_bytes") = py::none(),
                      py::arg("transport") = "auto");
  subscriber_methods(pipe_subscriber);
#endif
}

}  // namespace tensordict::python

// Binding of tensordict::pipe as _C.Pipe and _C.PipeServer. Every call that waits on the
// network releases the GIL, so the asyncio layer (tensordict_cpp.pipe) can run them in worker
// threads while the event loop keeps going, and a blocking call in the loop's own thread cannot
// deadlock: the UCX progress thread never needs Python.

#include <chrono>
#include <optional>
#include <string>
#include <tuple>

#include "bindings.h"
#include "core/testing.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/pipe/server.h"

namespace tensordict::python {
namespace {

using pipe::Pipe;
using pipe::PipeOptions;
using pipe::TensorDictServer;

std::chrono::milliseconds millis(double seconds, const char* what) {
  TORCH_CHECK_VALUE(seconds >= 0 && seconds < 1e9, what,
                    " must be a nonnegative number of "
                    "seconds, got ",
                    seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

// The keyword arguments of every constructor, in pipe_option_args()'s order.
struct OptionArgs {
  bool consolidated;
  double timeout;
  int64_t max_metadata_bytes;
  std::optional<int64_t> max_storage_bytes;
  double linger;
  int64_t max_unreceived;
  double spin;
  int64_t max_unread_bytes;
};

PipeOptions options(const OptionArgs& a) {
  PipeOptions o;
  o.consolidated = a.consolidated;
  o.timeout = millis(a.timeout, "timeout");
  o.max_metadata_bytes = a.max_metadata_bytes;
  o.max_storage_bytes = a.max_storage_bytes;
  o.linger = millis(a.linger, "linger");
  o.max_unreceived = a.max_unreceived;
  o.max_unread_bytes = a.max_unread_bytes;
  TORCH_CHECK_VALUE(a.spin >= 0 && a.spin < 1e3,
                    "spin must be a nonnegative number of seconds "
                    "(under 1000), got ",
                    a.spin);
  o.spin = std::chrono::microseconds(static_cast<int64_t>(a.spin * 1e6 + 0.5));
  return o;
}

// A Python callable held by C++ code that may drop it on a thread without the GIL.
struct PyCallable {
  py::object fn;
  explicit PyCallable(py::object f) : fn(std::move(f)) {}
  ~PyCallable() {
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
};

// Pipe.over's link: each message crosses as a memoryview of the pipe's own buffer (no copy).
pipe::CallerTransport link_from_py(py::object send, py::object recv, py::object close,
                                   std::string peer, std::optional<uint64_t> peer_tag) {
  pipe::CallerTransport link;
  auto s = std::make_shared<PyCallable>(std::move(send));
  auto r = std::make_shared<PyCallable>(std::move(recv));
  link.send = [s](const void* data, size_t n) {
    py::gil_scoped_acquire gil;
    s->fn(py::memoryview::from_memory(const_cast<void*>(data), static_cast<py::ssize_t>(n),
                                      /*readonly=*/true));
  };
  link.recv = [r](void* data, size_t n) {
    py::gil_scoped_acquire gil;
    r->fn(py::memoryview::from_memory(data, static_cast<py::ssize_t>(n)));
  };
  if (!close.is_none()) {
    auto c = std::make_shared<PyCallable>(std::move(close));
    link.close = [c] {
      py::gil_scoped_acquire gil;
      c->fn();
    };
  }
  link.peer = std::move(peer);
  link.peer_tag = peer_tag;
  return link;
}

double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

// The keyword arguments of every constructor (listen, connect, PipeServer), with PipeOptions'
// defaults: each name and default is written here only.
auto pipe_option_args() {
  const PipeOptions d;
  return std::make_tuple(
      py::kw_only(), py::arg("consolidated") = d.consolidated,
      py::arg("timeout") = seconds(d.timeout), py::arg("max_metadata_bytes") = d.max_metadata_bytes,
      py::arg("max_storage_bytes") = d.max_storage_bytes, py::arg("linger") = seconds(d.linger),
      py::arg("max_unreceived") = d.max_unreceived,
      py::arg("spin") = static_cast<double>(d.spin.count()) / 1e6,
      py::arg("max_unread_bytes") = d.max_unread_bytes);
}

auto listen_args() {
  return std::tuple_cat(std::make_tuple(py::arg("port"), py::arg("host")), pipe_option_args());
}

// listen, connect and over.
void bind_pipe_makers(py::class_<Pipe>& pipe) {
  def_static(
      pipe, "listen",
      [](int port, const std::string& host, bool consolidated, double timeout,
         int64_t max_metadata_bytes, std::optional<int64_t> max_storage_bytes, double linger,
         int64_t max_unreceived, double spin, int64_t max_unread_bytes) {
        auto o = options({consolidated, timeout, max_metadata_bytes, max_storage_bytes, linger,
                          max_unreceived, spin, max_unread_bytes});
        py::gil_scoped_release nogil;
        return Pipe::listen(port, host, o);
      },
      listen_args());
  def_static(
      pipe, "connect",
      [](const std::string& host, int port, bool consolidated, double timeout,
         int64_t max_metadata_bytes, std::optional<int64_t> max_storage_bytes, double linger,
         int64_t max_unreceived, double spin, int64_t max_unread_bytes) {
        auto o = options({consolidated, timeout, max_metadata_bytes, max_storage_bytes, linger,
                          max_unreceived, spin, max_unread_bytes});
        py::gil_scoped_release nogil;
        return Pipe::connect(host, port, o);
      },
      std::tuple_cat(std::make_tuple(py::arg("host"), py::arg("port")), pipe_option_args()));
  // A pipe over a transport of the caller's (tensordict_cpp.pipe passes a ucxx endpoint's):
  // send(memoryview) and recv(memoryview) move one message each, blocking; close() ends it.
  def_static(
      pipe, "over",
      [](py::object send, py::object recv, py::object close, std::string peer,
         std::optional<uint64_t> peer_tag, bool consolidated, double timeout,
         int64_t max_metadata_bytes, std::optional<int64_t> max_storage_bytes, double linger,
         int64_t max_unreceived, double spin, int64_t max_unread_bytes) {
        auto o = options({consolidated, timeout, max_metadata_bytes, max_storage_bytes, linger,
                          max_unreceived, spin, max_unread_bytes});
        return Pipe::over(link_from_py(std::move(send), std::move(recv), std::move(close),
                                       std::move(peer), peer_tag),
                          o);
      },
      std::tuple_cat(
          std::make_tuple(py::arg("send"), py::arg("recv"), py::arg("close") = py::none(),
                          py::arg("peer") = "a caller's link", py::arg("peer_tag") = py::none()),
          pipe_option_args()));
}

// send, recv and the event loops' calls.
void bind_pipe_transfers(py::class_<Pipe>& pipe) {
  // send's `timeout`: this send's own limit in seconds from now, in place of the pipe's per wait
  // (PipeSendOptions::deadline); asend's thread passes what is left of its call's.
  pipe.def(
          "send",
          [](Pipe& p, const TensorDict& td, std::optional<double> timeout) {
            pipe::PipeSendOptions o;
            if (timeout) {
              TORCH_CHECK_VALUE(*timeout < 1e9, "timeout must be under 1e9 seconds, got ",
                                *timeout);
              o.deadline = std::chrono::steady_clock::now() +
                           std::chrono::microseconds(static_cast<int64_t>(*timeout * 1e6));
            }
            py::gil_scoped_release nogil;
            p.send(td, o);
          },
          py::arg("td"), py::kw_only(), py::arg("timeout") = py::none())
      .def("recv", &Pipe::recv, py::arg("td") = py::none(), py::kw_only(),
           py::arg("device") = py::none(), py::call_guard<py::gil_scoped_release>())
      // try_recv: the received TensorDict, or why not as a str: "not_arrived" or "would_wait".
      .def(
          "try_recv",
          [](Pipe& p, const std::optional<TensorDict>& td, std::optional<at::Device> device,
             bool spin) -> py::object {
            Pipe::RecvAttempt a;
            std::optional<TensorDict> out;
            {
              py::gil_scoped_release nogil;
              out = p.try_recv(&a, td, device,
                               spin ? p.options().spin : std::chrono::microseconds(0));
            }
            if (out) return py::cast(std::move(*out));
            return py::str(a == Pipe::RecvAttempt::kNotArrived ? "not_arrived" : "would_wait");
          },
          py::arg("td") = py::none(), py::kw_only(), py::arg("device") = py::none(),
          py::arg("spin") = false)
      // try_send's answer as a str: "sent", "window_full" or "would_wait".
      .def(
          "try_send",
          [](Pipe& p, const TensorDict& td, bool spin) {
            Pipe::SendAttempt a;
            {
              py::gil_scoped_release nogil;
              a = p.try_send(td, spin ? p.options().spin : std::chrono::microseconds(0));
            }
            return a == Pipe::SendAttempt::kSent         ? "sent"
                   : a == Pipe::SendAttempt::kWindowFull ? "window_full"
                                                         : "would_wait";
          },
          py::arg("td"), py::arg("spin") = false)
      .def(
          "recv_ready",
          [](Pipe& p, std::optional<double> spin) {
            // Default: the pipe's own spin option.
            const auto us = spin
                                ? std::chrono::microseconds(static_cast<int64_t>(*spin * 1e6 + 0.5))
                                : p.options().spin;
            py::gil_scoped_release nogil;
            return p.recv_ready(us);
          },
          py::arg("spin") = py::none());
}

// The pipe's state, its counters and the test hooks.
void bind_pipe_state(py::class_<Pipe>& pipe) {
  pipe.def_property_readonly("timeout", [](const Pipe& p) { return seconds(p.options().timeout); })
      .def_property_readonly("last_recv_bytes", &Pipe::last_recv_bytes)
      .def("event_fd", &Pipe::event_fd)
      .def("watch", &Pipe::watch, py::arg("on"))
      .def("accept", &Pipe::accept, py::call_guard<py::gil_scoped_release>())
      .def("close", &Pipe::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Pipe::closed)
      .def_property_readonly("peer_closed", &Pipe::peer_closed)
      .def_property_readonly("port", &Pipe::port)
      .def_property_readonly("peer", &Pipe::peer)
      .def_property_readonly("transports", &Pipe::transports)
      .def_property_readonly("peer_is_tensordict_cpp", &Pipe::peer_is_tensordict_cpp)
      .def_property_readonly("consolidated", [](const Pipe& p) { return p.options().consolidated; })
      .def("stats",
           [](const Pipe& p) {
             const auto s = p.stats();
             py::dict d;
             d["sends"] = s.sends;
             d["schema_sends"] = s.schema_sends;
             d["recvs"] = s.recvs;
             d["schema_recvs"] = s.schema_recvs;
             d["bytes_sent"] = s.bytes_sent;
             d["bytes_received"] = s.bytes_received;
             return d;
           })
      .def(
          "_send_raw",
          [](Pipe& p, const py::bytes& data) {
            std::string s = data;
            py::gil_scoped_release nogil;
            p.send_raw(TestKey{}, s.data(), s.size());
          },
          py::arg("data"))
      .def(
          "_recv_raw",
          [](Pipe& p, size_t n) {
            std::string s;
            {
              py::gil_scoped_release nogil;
              s = p.recv_raw(TestKey{}, n);
            }
            return py::bytes(s);
          },
          py::arg("n"));
}

void bind_server(py::module_& m) {
  // serve() is not bound: its handlers run on C++ threads; the Python server runs them as
  // asyncio tasks over accept() instead (a Publisher serves through it in C++).
  py::class_<TensorDictServer> server(m, "PipeServer");
  std::apply(
      [&](const auto&... args) {
        server.def(py::init([](int port, const std::string& host, bool consolidated, double timeout,
                               int64_t max_metadata_bytes, std::optional<int64_t> max_storage_bytes,
                               double linger, int64_t max_unreceived, double spin,
                               int64_t max_unread_bytes) {
                     auto o = options({consolidated, timeout, max_metadata_bytes, max_storage_bytes,
                                       linger, max_unreceived, spin, max_unread_bytes});
                     py::gil_scoped_release nogil;
                     return std::make_unique<TensorDictServer>(port, host, o);
                   }),
                   args...);
      },
      listen_args());
  server.def_property_readonly("port", &TensorDictServer::port)
      .def_property_readonly("clients", &TensorDictServer::clients)
      .def(
          "accept",
          [](TensorDictServer& s, std::optional<double> timeout) {
            std::optional<std::chrono::milliseconds> t;
            if (timeout) t = millis(*timeout, "timeout");
            py::gil_scoped_release nogil;
            return s.accept(t);
          },
          py::arg("timeout") = py::none())
      .def("close", &TensorDictServer::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace

void bind_pipe(py::module_& m) {
  py::class_<Pipe> pipe(m, "Pipe");
  bind_pipe_makers(pipe);
  bind_pipe_transfers(pipe);
  bind_pipe_state(pipe);
  bind_server(m);
}

}  // namespace tensordict::python

// Binding of tensordict::pipe as _C.Pipe and _C.PipeServer. Every call that waits on the
// network releases the GIL, so the asyncio layer (tensordict_cpp.pipe) can run them in worker
// threads while the event loop keeps going, and a blocking call in the loop's own thread cannot
// deadlock: the UCX progress thread never needs Python.

#include <chrono>
#include <optional>
#include <string>
#include <tuple>

#include "bindings.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/pipe/server.h"

namespace tensordict::python {
namespace {

using pipe::Pipe;
using pipe::PipeOptions;
using pipe::TensorDictServer;

std::chrono::milliseconds millis(double seconds, const char* what) {
  TORCH_CHECK_VALUE(seconds >= 0 && seconds < 1e9, what, " must be a nonnegative number of "
                    "seconds, got ", seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

PipeOptions options(bool consolidated, double timeout, int64_t max_metadata_bytes,
                    int64_t max_storage_bytes, double linger) {
  PipeOptions o;
  o.consolidated = consolidated;
  o.timeout = millis(timeout, "timeout");
  o.max_metadata_bytes = max_metadata_bytes;
  o.max_storage_bytes = max_storage_bytes;
  o.linger = millis(linger, "linger");
  return o;
}

double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

// The keyword arguments of every constructor (listen, connect, PipeServer), with PipeOptions'
// defaults: each name and default is written here only.
auto pipe_option_args() {
  const PipeOptions d;
  return std::make_tuple(py::kw_only(), py::arg("consolidated") = d.consolidated,
                         py::arg("timeout") = seconds(d.timeout),
                         py::arg("max_metadata_bytes") = d.max_metadata_bytes,
                         py::arg("max_storage_bytes") = d.max_storage_bytes,
                         py::arg("linger") = seconds(d.linger));
}

}  // namespace

void bind_pipe(py::module_& m) {
  py::class_<Pipe> pipe(m, "Pipe");
  const auto listen_args =
      std::tuple_cat(std::make_tuple(py::arg("port"), py::arg("host")), pipe_option_args());
  def_static(
      pipe, "listen",
      [](int port, const std::string& host, bool consolidated, double timeout,
         int64_t max_metadata_bytes, int64_t max_storage_bytes, double linger) {
        auto o = options(consolidated, timeout, max_metadata_bytes, max_storage_bytes, linger);
        py::gil_scoped_release nogil;
        return Pipe::listen(port, host, o);
      },
      listen_args);
  def_static(
      pipe, "connect",
      [](const std::string& host, int port, bool consolidated, double timeout,
         int64_t max_metadata_bytes, int64_t max_storage_bytes, double linger) {
        auto o = options(consolidated, timeout, max_metadata_bytes, max_storage_bytes, linger);
        py::gil_scoped_release nogil;
        return Pipe::connect(host, port, o);
      },
      std::tuple_cat(std::make_tuple(py::arg("host"), py::arg("port")), pipe_option_args()));
  pipe.def("send", &Pipe::send, py::arg("td"), py::call_guard<py::gil_scoped_release>())
      .def("recv", &Pipe::recv, py::arg("td") = py::none(), py::kw_only(),
           py::arg("device") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("accept", &Pipe::accept, py::call_guard<py::gil_scoped_release>())
      .def("close", &Pipe::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Pipe::closed)
      .def_property_readonly("peer_closed", &Pipe::peer_closed)
      .def_property_readonly("port", &Pipe::port)
      .def_property_readonly("peer", &Pipe::peer)
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
          "send_raw",
          [](Pipe& p, const py::bytes& data) {
            std::string s = data;
            py::gil_scoped_release nogil;
            p.send_raw(s.data(), s.size());
          },
          py::arg("data"))
      .def(
          "recv_raw",
          [](Pipe& p, size_t n) {
            std::string s;
            {
              py::gil_scoped_release nogil;
              s = p.recv_raw(n);
            }
            return py::bytes(s);
          },
          py::arg("n"));

  // serve() is not bound: its handlers run on C++ threads; the Python server runs them as
  // asyncio tasks over accept() instead.
  py::class_<TensorDictServer> server(m, "PipeServer");
  std::apply(
      [&](const auto&... args) {
        server.def(py::init([](int port, const std::string& host, bool consolidated,
                               double timeout, int64_t max_metadata_bytes,
                               int64_t max_storage_bytes, double linger) {
                     auto o = options(consolidated, timeout, max_metadata_bytes,
                                      max_storage_bytes, linger);
                     py::gil_scoped_release nogil;
                     return std::make_unique<TensorDictServer>(port, host, o);
                   }),
                   args...);
      },
      listen_args);
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

}  // namespace tensordict::python

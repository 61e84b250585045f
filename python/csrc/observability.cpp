// Binding of log.h and transfer_stats.h: the level, a sink that forwards to Python, and the
// per-process transfer counters (tensordict_cpp/observability.py is the Python face).

#include "bindings.h"
#include "tensordict/log.h"
#include "tensordict/transfer_stats.h"

namespace tensordict::python {

void bind_observability(py::module_& m) {
  m.def("log_level", [] {
    switch (log_level()) {
      case LogLevel::kInfo: return "info";
      case LogLevel::kDebug: return "debug";
      default: return "off";
    }
  });
  m.def(
      "set_log_level", [](const std::string& level) { set_log_level(parse_log_level(level)); },
      py::arg("level"));
  // sink(level, line) with level "info" or "debug", called from any thread (with the GIL taken
  // here); None restores stderr.
  m.def(
      "set_log_sink",
      [](py::object sink) {
        if (sink.is_none()) {
          set_log_sink(nullptr);
          return;
        }
        // Held until replaced; dropped with the GIL, whichever thread drops it.
        auto held = std::shared_ptr<py::object>(new py::object(std::move(sink)), [](py::object* o) {
          py::gil_scoped_acquire gil;
          delete o;
        });
        set_log_sink([held](LogLevel level, const std::string& line) {
          py::gil_scoped_acquire gil;
          try {
            (*held)(level == LogLevel::kDebug ? "debug" : "info", line);
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("tensordict_cpp log sink");
          }
        });
      },
      py::arg("sink"));
  m.def(
      "transfer_stats",
      [](const std::string& channel) {
        TORCH_CHECK_VALUE(channel == "process_group" || channel == "pipe",
                          "transfer_stats: channel must be 'process_group' or 'pipe', got '",
                          channel, "'");
        const TransferStats s =
            transfer_stats(channel == "pipe" ? Channel::kPipe : Channel::kProcessGroup);
        py::dict d;
        d["transfers"] = s.transfers;
        d["messages_sent"] = s.messages_sent;
        d["messages_received"] = s.messages_received;
        d["bytes_sent"] = s.bytes_sent;
        d["bytes_received"] = s.bytes_received;
        d["seconds"] = static_cast<double>(s.nanoseconds) / 1e9;
        return d;
      },
      py::arg("channel"));
  m.def("reset_transfer_stats", &reset_transfer_stats);
}

}  // namespace tensordict::python

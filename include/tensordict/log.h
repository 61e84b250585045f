#pragma once
// Logging of transfers: one line per transfer at "info" (its kind, peer, tags, bytes and
// duration; the UCX transports a pipe connected with), one per message at "debug". Off unless
// asked: the environment variable TENSORDICT_LOG=info|debug at the first log call, or
// set_log_level(). Lines go to stderr, or to the sink the caller installs (the Python module
// installs one that forwards to Python's `logging`, logger "tensordict_cpp").
// docs/observability.md.

#include <functional>
#include <string>
#include <string_view>

namespace tensordict {

enum class LogLevel { kOff = 0, kInfo = 1, kDebug = 2 };

/// The current level: TENSORDICT_LOG ("off", "info" or "debug"; anything else is off) read
/// once, unless set_log_level() was called.
LogLevel log_level();
void set_log_level(LogLevel level);
/// "off", "info" or "debug" as a level; ValueError naming the text otherwise.
LogLevel parse_log_level(std::string_view text);

/// Where lines go; an empty function restores stderr. The sink may be called from any thread
/// (the pipe's progress threads included), one line at a time, never with a lock of ours held.
using LogSink = std::function<void(LogLevel level, const std::string& line)>;
void set_log_sink(LogSink sink);

/// True when lines of `level` are written: check it before building a line.
inline bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= static_cast<int>(log_level());
}
/// Writes `line` at `level` (when enabled) to the sink, or to stderr prefixed "tensordict: ".
void log(LogLevel level, const std::string& line);

}  // namespace tensordict

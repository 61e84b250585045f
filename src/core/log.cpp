#include "tensordict/log.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

namespace tensordict {
namespace {

constexpr int kUnset = -1;
std::atomic<int> level_{kUnset};

// The sink, swapped whole under a mutex and called through a copy of its shared_ptr: a sink
// replaced while a line is being written lives until that line is done.
std::mutex sink_mu;
std::shared_ptr<const LogSink> sink;

LogLevel from_env() {
  const char* text = std::getenv("TENSORDICT_LOG");
  if (text == nullptr) return LogLevel::kOff;
  try {
    return parse_log_level(text);
  } catch (const c10::Error&) {
    std::fprintf(stderr, "tensordict: TENSORDICT_LOG=%s is not off, info or debug: logging off\n",
                 text);
    return LogLevel::kOff;
  }
}

}  // namespace

LogLevel parse_log_level(std::string_view text) {
  if (text == "off" || text.empty()) return LogLevel::kOff;
  if (text == "info") return LogLevel::kInfo;
  if (text == "debug") return LogLevel::kDebug;
  TORCH_CHECK_VALUE(false, "log level must be off, info or debug, got '", text, "'");
}

LogLevel log_level() {
  int level = level_.load(std::memory_order_relaxed);
  if (level == kUnset) {
    int expected = kUnset;
    level_.compare_exchange_strong(expected, static_cast<int>(from_env()));
    level = level_.load();
  }
  return static_cast<LogLevel>(level);
}

void set_log_level(LogLevel level) { level_.store(static_cast<int>(level)); }

void set_log_sink(LogSink s) {
  auto next = s ? std::make_shared<const LogSink>(std::move(s)) : nullptr;
  std::lock_guard<std::mutex> lk(sink_mu);
  sink = std::move(next);
}

void log(LogLevel level, const std::string& line) {
  if (!log_enabled(level) || level == LogLevel::kOff) return;
  std::shared_ptr<const LogSink> s;
  {
    std::lock_guard<std::mutex> lk(sink_mu);
    s = sink;
  }
  if (s) {
    try {
      (*s)(level, line);
      return;
    } catch (...) {
      // a failing sink falls back to stderr
    }
  }
  std::fprintf(stderr, "tensordict: %s\n", line.c_str());
}

}  // namespace tensordict

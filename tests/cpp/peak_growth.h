#pragma once
// Shared by the GoogleTest suites: the growth of this process's peak resident memory over a
// call (VmHWM, reset first through /proc/self/clear_refs, after malloc_trim so that what
// earlier tests freed does not hide it).

#include <malloc.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

// Under a sanitizer, shadow memory and the quarantine of freed memory dwarf what the memory
// checks measure: they are left out there (what they guard is still run).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kMeasureMemory = false;
#else
constexpr bool kMeasureMemory = true;
#endif

inline int64_t status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0) return std::stoll(line.substr(n)) * 1024;
  }
  return 0;
}

template <typename Fn>
int64_t peak_growth(Fn&& fn) {
  malloc_trim(0);
  {
    std::ofstream("/proc/self/clear_refs") << "5";
  }
  const int64_t before = status_bytes("VmRSS:");
  fn();
  return status_bytes("VmHWM:") - before;
}

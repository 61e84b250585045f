#pragma once
// Shared memory between the processes of one host, at the level of the operating system (Linux):
// a segment of memory that one process creates and others of the same user map, futex waits and
// wakes on words inside it, and a handle on another process that says when it exited. No torch
// and nothing of ours: publication's engine (src/wire/publication_*.cpp) puts its slots in such
// segments (docs/publication.md, "Shared memory"; the layout is docs/wire-format.md §9.8).
//
// A segment is a memfd (memfd_create, MFD_CLOEXEC, mode 0600): it has no name in /dev/shm or
// anywhere, so nothing is left behind when its processes are killed; it lives while a descriptor
// or a mapping of it does. Another process reaches it through /proc/<creator's pid>/fd/<fd>,
// which the kernel opens only for a process allowed to read the creator's memory (ptrace read
// access: the same user, the same pid namespace, a dumpable creator).

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tensordict::shm {

/// One mapping of a memfd. The creator maps it readable and writable and keeps its descriptor
/// (others open it through /proc while the creator lives); an opener maps it read-only or
/// readable and writable, as it asks, and keeps no descriptor. Unmapped (and the descriptor
/// closed) with the last reference. Thread-safe (immutable).
class Segment {
 public:
  /// A new segment of `bytes` (> 0), zeroed. `name` shows in /proc/<pid>/fd ("memfd:<name>").
  /// `populate`: its pages made at once (MAP_POPULATE), else as they are first touched.
  /// Throws std::system_error when the kernel refuses (no memfd_create, no memory).
  static std::shared_ptr<Segment> create(const std::string& name, size_t bytes,
                                         bool populate = true);
  /// Maps the segment that process `pid` holds as descriptor `fd`: only a memfd (its link in
  /// /proc says so before it is opened, so nothing else of that process is ever opened),
  /// whatever size it has. Null when it cannot, with the reason in `why` ("could not open
  /// /proc/12/fd/5: Permission denied").
  static std::shared_ptr<Segment> open(pid_t pid, int fd, bool writable, std::string* why,
                                       bool populate = true);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  /// The creator's descriptor; -1 in an opener.
  int fd() const { return fd_; }

 private:
  Segment(uint8_t* data, size_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  uint8_t* data_;
  size_t size_;
  int fd_;
};

/// Sleeps while `*word` holds `expected`, at most `timeout`, or until futex_wake() on the same
/// word from any process that maps it (shared futexes: no FUTEX_PRIVATE_FLAG). Returns at once
/// when the word differs. Spurious returns happen: callers look again.
void futex_wait(const std::atomic<uint32_t>* word, uint32_t expected,
                std::chrono::microseconds timeout);
/// Wakes every process waiting on `word`.
void futex_wake(const std::atomic<uint32_t>* word);

/// This process's network host: a hash of the kernel's boot id and the network namespace's
/// inode, the same for every process whose sockets reach each other through the loopback
/// device; never 0 (0: unknown, when /proc cannot tell).
uint64_t host_fingerprint();

/// Another process, watched: a pidfd when the kernel has them (a pid reused by a new process is
/// never mistaken for the old one), else kill(pid, 0). Thread-safe.
class Process {
 public:
  explicit Process(pid_t pid);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  pid_t pid() const { return pid_; }
  /// Whether it has not exited (a zombie has exited).
  bool alive() const;

 private:
  pid_t pid_;
  int pidfd_;  // -1: none (then kill(pid, 0))
};

/// 16 bytes from the kernel's random source (getrandom).
std::array<uint8_t, 16> random_token();

}  // namespace tensordict::shm

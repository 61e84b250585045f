#include "shm/segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>

namespace tensordict::shm {
namespace {

std::string errno_text(int e) { return std::strerror(e); }

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

}  // namespace

std::shared_ptr<Segment> Segment::create(const std::string& name, size_t bytes, bool populate) {
  const int fd = static_cast<int>(::syscall(SYS_memfd_create, name.c_str(), MFD_CLOEXEC));
  if (fd < 0) throw_errno("memfd_create");
  // Only this user may open it through /proc (the kernel already asks for ptrace read access).
  if (::fchmod(fd, 0600) != 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    throw_errno("shared memory of " + std::to_string(bytes) + " bytes");
  }
  // Populated now: faulting in fresh pages one at a time costs more than copying into them,
  // and a segment's pages are all written soon (each slot by a publish).
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    ::close(fd);
    errno = e;
    throw_errno("mmap of " + std::to_string(bytes) + " bytes of shared memory");
  }
  return std::shared_ptr<Segment>(new Segment(static_cast<uint8_t*>(p), bytes, fd));
}

std::shared_ptr<Segment> Segment::open(pid_t pid, int fd, bool writable, std::string* why,
                                       bool populate) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  // What the descriptor is, before opening it: opening a device or a pipe of another process
  // could block or act on it.
  char target[PATH_MAX];
  const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
  if (n < 0) {
    *why = "could not read " + path + ": " + errno_text(errno);
    return nullptr;
  }
  target[n] = '\0';
  if (std::strncmp(target, "/memfd:", 7) != 0) {
    *why = path + " is not a memfd (it is " + std::string(target) + ")";
    return nullptr;
  }
  const int own = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOCTTY);
  if (own < 0) {
    *why = "could not open " + path + ": " + errno_text(errno);
    return nullptr;
  }
  struct stat st{};
  if (::fstat(own, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
    *why = path + " is not a segment of shared memory";
    ::close(own);
    return nullptr;
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                   MAP_SHARED | (populate ? MAP_POPULATE : 0), own, 0);  // pulls then fault nothing
  const int e = errno;
  ::close(own);  // the mapping keeps the memory
  if (p == MAP_FAILED) {
    *why = "could not map " + path + ": " + errno_text(e);
    return nullptr;
  }
  return std::shared_ptr<Segment>(new Segment(static_cast<uint8_t*>(p), bytes, -1));
}

Segment::~Segment() {
  ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void futex_wait(const std::atomic<uint32_t>* word, uint32_t expected,
                std::chrono::microseconds timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free);
  if (timeout.count() <= 0) return;
  struct timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000000) * 1000);
  // EAGAIN (the word differs), EINTR and ETIMEDOUT all mean: look again.
  ::syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr,
            0);
}

uint64_t host_fingerprint() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  struct stat net{};
  if (!(boot >> id) || ::stat("/proc/self/ns/net", &net) != 0) return 0;
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of both
  const auto mix = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 0x100000001b3ull;
  };
  mix(id.data(), id.size());
  mix(&net.st_ino, sizeof net.st_ino);
  mix(&net.st_dev, sizeof net.st_dev);
  return h == 0 ? 1 : h;
}

void futex_wake(const std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
}

Process::Process(pid_t pid) : pid_(pid), pidfd_(-1) {
#ifdef SYS_pidfd_open
  pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd_ >= 0) ::fcntl(pidfd_, F_SETFD, FD_CLOEXEC);
#endif
}

Process::~Process() {
  if (pidfd_ >= 0) ::close(pidfd_);
}

bool Process::alive() const {
  if (pidfd_ >= 0) {
    struct pollfd p{pidfd_, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;  // readable once it exited
  }
  return ::kill(pid_, 0) == 0 || errno == EPERM;
}

std::array<uint8_t, 16> random_token() {
  std::array<uint8_t, 16> t{};
  size_t got = 0;
  while (got < t.size()) {
    const ssize_t n = ::getrandom(t.data() + got, t.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("getrandom");
    }
    got += static_cast<size_t>(n);
  }
  return t;
}

}  // namespace tensordict::shm

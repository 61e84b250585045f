#include "ucx_listener.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "tensordict/log.h"
#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {
namespace {

// The listener looks at descriptors other threads own (UCX's sockets), which may be closed or
// reused meanwhile: a look is rechecked by inode before anything is done to it. These go to the
// kernel directly so that ThreadSanitizer, which models a descriptor as memory, does not take
// that look for a data race on UCX's descriptors (they are not memory of ours).
int sys_fstat(int fd, struct stat* st) { return static_cast<int>(::syscall(SYS_fstat, fd, st)); }
int sys_getsockname(int fd, sockaddr_storage* a, socklen_t* n) {
  return static_cast<int>(::syscall(SYS_getsockname, fd, a, n));
}
int sys_getpeername(int fd, sockaddr_storage* a, socklen_t* n) {
  return static_cast<int>(::syscall(SYS_getpeername, fd, a, n));
}
int sys_getsockopt(int fd, int level, int name, void* value, socklen_t* n) {
  return static_cast<int>(::syscall(SYS_getsockopt, fd, level, name, value, n));
}
int sys_connect(int fd, const sockaddr* a, socklen_t n) {
  return static_cast<int>(::syscall(SYS_connect, fd, a, n));
}

// A connected TCP socket of the process.
struct Socket {
  int fd;
  ino_t inode;
  sockaddr_storage local, remote;
};

// The process's open descriptors, listed from /proc/self/fd through a descriptor kept open
// while a listener exists (acquire/release), so that they can be listed when none is left to
// open; and its connected TCP sockets, looked at once for every listener of the process (a look
// costs a system call per descriptor, several per new socket). Thread-safe.
class Descriptors {
 public:
  static Descriptors& get() {
    static auto* d = new Descriptors();  // never destroyed: a progress thread may use it at exit
    return *d;
  }

  void acquire() {
    std::lock_guard<std::mutex> lk(mu_);
    ++users_;
    open_locked();  // now, while descriptors are to be had
  }
  void release() {
    std::lock_guard<std::mutex> lk(mu_);
    if (--users_ == 0 && dir_ >= 0) {
      ::close(dir_);
      dir_ = -1;
    }
  }

  std::vector<int> list() {
    std::lock_guard<std::mutex> lk(mu_);
    return list_locked();
  }

  // The connected TCP sockets, as seen at most kFresh ago: descriptors new since the last look
  // are looked at, and every one again each kRecheck (a number closed and reused meanwhile).
  std::vector<Socket> sockets(size_t* open = nullptr) {
    std::lock_guard<std::mutex> lk(mu_);
    const auto now = Clock::now();
    if (now - last_ < kFresh) {
      if (open != nullptr) *open = known_.size();
      return sockets_;
    }
    last_ = now;
    const bool recheck = now - last_full_ >= kRecheck;
    if (recheck) last_full_ = now;
    std::unordered_map<int, Entry> seen;
    sockets_.clear();
    for (const int fd : list_locked()) {
      auto it = known_.find(fd);
      Entry e = it != known_.end() && !recheck ? it->second : look(fd);
      if (e.tcp) sockets_.push_back(e.socket);
      seen.emplace(fd, e);
    }
    known_ = std::move(seen);
    if (open != nullptr) *open = known_.size();
    return sockets_;
  }

 private:
  static constexpr auto kFresh = std::chrono::milliseconds(90);
  static constexpr auto kRecheck = std::chrono::seconds(1);
  struct Entry {
    bool tcp = false;
    Socket socket{};
  };

  static Entry look(int fd) {
    Entry e;
    struct stat st{};
    if (sys_fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return e;
    Socket s{fd, st.st_ino, {}, {}};
    socklen_t n = sizeof(s.local);
    if (sys_getsockname(fd, &s.local, &n) != 0 ||
        (s.local.ss_family != AF_INET && s.local.ss_family != AF_INET6)) {
      return e;
    }
    int type = 0;
    n = sizeof(type);
    if (sys_getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &n) != 0 || type != SOCK_STREAM) return e;
    n = sizeof(s.remote);
    // A listening socket has no peer; one not connected yet gets looked at again later.
    if (sys_getpeername(fd, &s.remote, &n) != 0) return e;
    e.tcp = true;
    e.socket = s;
    return e;
  }

  std::vector<int> list_locked() {
    open_locked();
    std::vector<int> out;
    if (dir_ < 0 || ::lseek(dir_, 0, SEEK_SET) != 0) return out;
    alignas(dirent64) char buf[16384];
    for (;;) {
      const ssize_t n = ::getdents64(dir_, buf, sizeof(buf));
      if (n <= 0) break;
      for (ssize_t off = 0; off < n;) {
        const auto* d = reinterpret_cast<const dirent64*>(buf + off);
        off += d->d_reclen;
        char* end = nullptr;
        const long fd = std::strtol(d->d_name, &end, 10);
        if (end != d->d_name && *end == '\0' && fd != dir_) out.push_back(static_cast<int>(fd));
      }
    }
    if (users_ == 0) {  // listed for no listener: kept by none
      ::close(dir_);
      dir_ = -1;
    }
    return out;
  }

  void open_locked() {
    if (dir_ >= 0 && pid_ != ::getpid()) {  // a forked child: /proc/self was the parent
      ::close(dir_);
      dir_ = -1;
    }
    if (dir_ < 0) {
      dir_ = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      pid_ = ::getpid();
    }
  }

  std::mutex mu_;
  int users_ = 0;
  int dir_ = -1;
  pid_t pid_ = -1;
  std::unordered_map<int, Entry> known_;  // by descriptor, as last looked at
  std::vector<Socket> sockets_;
  Clock::time_point last_{}, last_full_{};
};

// RLIMIT_NOFILE's soft limit, and the descriptors kept out of clients' reach below it.
size_t descriptor_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return SIZE_MAX / 2;
  return static_cast<size_t>(r.rlim_cur);
}
size_t descriptor_reserve(size_t limit) { return std::max<size_t>(32, limit / 8); }

bool near_descriptor_limit(size_t open) {
  const size_t limit = descriptor_limit();
  return open + descriptor_reserve(limit) > limit;
}

bool same_address(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in&>(a).sin_addr,
                       &reinterpret_cast<const sockaddr_in&>(b).sin_addr, sizeof(in_addr)) == 0;
  }
  return a.ss_family == AF_INET6 &&
         std::memcmp(&reinterpret_cast<const sockaddr_in6&>(a).sin6_addr,
                     &reinterpret_cast<const sockaddr_in6&>(b).sin6_addr, sizeof(in6_addr)) == 0;
}

bool unspecified(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr == htonl(INADDR_ANY);
  }
  return a.ss_family == AF_INET6 &&
         IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6&>(a).sin6_addr);
}

// Aborts the TCP connection of descriptor `fd` (a reset to the peer, ECONNRESET on the socket)
// without closing the descriptor, which is UCX's: connect() to AF_UNSPEC, the kernel's
// disconnect. UCX's connection manager then sees an error event on it and closes it itself.
// Checked first that `fd` is still the socket seen (`inode`): UCX may have closed it, and the
// number been reused, since.
// The most a client sends before UCX's TCP connection manager makes a request of its connection:
// a header and UCX_TCP_CM_PRIV_DATA_LEN (2048 by default) bytes, in a buffer of that length plus
// two headers of 16 bytes (uct_tcp_sockcm_ep_t's comm_ctx.buf).
uint64_t request_bytes() {
  static const uint64_t bytes = [] {
    uint64_t priv = 2048;
    if (const char* v = std::getenv("UCX_TCP_CM_PRIV_DATA_LEN")) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(v, &end, 10);
      const char unit = end != nullptr ? static_cast<char>(std::tolower(*end)) : '\0';
      const uint64_t scale = unit == 'k' ? 1024 : unit == 'm' ? 1024 * 1024 : 1;
      if (end != v) priv = std::max<uint64_t>(priv, n * scale);
    }
    return priv + 2 * 16;
  }();
  return bytes;
}

bool reset_connection(int fd, ino_t inode) {
  struct stat st{};
  if (sys_fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != inode) return false;
  sockaddr none{};
  none.sa_family = AF_UNSPEC;
  return sys_connect(fd, &none, sizeof(none)) == 0;
}

}  // namespace

Listener::Listener(std::shared_ptr<Worker> worker, int max_clients, const PipeOptions& options)
    : worker_(std::move(worker)),
      max_clients_(max_clients),
      limits_(UnreadLimits::of(options)),
      handshake_timeout_(options.timeout) {}

std::shared_ptr<Listener> Listener::create(std::shared_ptr<Worker> worker, const std::string& host,
                                           int port, int max_clients, const PipeOptions& options) {
  const SockAddr addr = resolve(host, port, /*passive=*/true);
  std::shared_ptr<Listener> l(new Listener(worker, max_clients, options));
  {
    auto lk = worker->lock();
    ucp_listener_params_t params{};
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr.storage);
    params.sockaddr.addrlen = addr.length;
    params.conn_handler.cb = &Listener::on_conn_request;
    params.conn_handler.arg = l.get();
    const ucs_status_t st = ucp_listener_create(worker->handle(), &params, &l->listener_);
    if (st != UCS_OK) l->listener_ = nullptr;
    TORCH_CHECK(st == UCS_OK, "listen: cannot listen on ", host, ":", port, ": ",
                ucs_status_string(st));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    check_ucs(ucp_listener_query(l->listener_, &attr), "ucp_listener_query");
    l->port_ = port_of(attr.sockaddr);
    l->bound_.storage = attr.sockaddr;
  }
  // Unregistered by close(), which the destructor calls: the task never outlives the listener.
  Descriptors::get().acquire();
  worker->add_periodic(l.get(), [raw = l.get()] { raw->sweep(); });
  l->sweeping_ = true;
  return l;
}

Listener::~Listener() { close(kTeardownGrace); }

void Listener::on_conn_request(ucp_conn_request_h request, void* arg) {
  // Inside a progress call: accept right after it. The listener outlives the task, since its
  // close() destroys the UCX listener (no more requests) with the UCX lock held.
  auto* self = static_cast<Listener*>(arg);
  self->worker_->defer([self, request] { self->accept_locked(request); });
}

void Listener::refuse_locked(ucp_conn_request_h request, const std::string& peer, const char* why) {
  ucp_listener_reject(listener_, request);
  refused_.fetch_add(1);
  if (log_enabled(LogLevel::kInfo)) {
    log(LogLevel::kInfo,
        c10::str("pipe listener on port ", port_, ": refused the connection of ", peer, ": ", why));
  }
}

void Listener::accept_locked(ucp_conn_request_h request) {
  if (listener_ == nullptr) return;  // closed: UCX dropped the request with the listener
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string peer = "?";
  if (ucp_conn_request_query(request, &attr) == UCS_OK) peer = format_address(attr.client_address);
  {
    // From now on its connection is UCX's to close (accepted or rejected): the sweep lets it be.
    std::lock_guard<std::mutex> lk(requested_mu_);
    requested_[peer] = Clock::now();
  }
  if (closed_) return refuse_locked(request, peer, "the listener is closing");
  if (max_clients_ > 0 && accepted_ + static_cast<int64_t>(handshaking_.size()) >= max_clients_) {
    // A listening pipe's later clients: not a refusal to report.
    ucp_listener_reject(listener_, request);
    return;
  }
  if (handshaking_.size() >= kMaxHandshakes) {
    return refuse_locked(request, peer, "64 peer-info exchanges are under way");
  }
  if (ready_.size() >= kMaxUnclaimed) {
    return refuse_locked(request, peer, "1024 accepted clients wait for accept()");
  }
  const size_t open = Descriptors::get().list().size();
  if (near_descriptor_limit(open)) {
    return refuse_locked(
        request, peer,
        c10::str("the process has ", open, " descriptors open, of RLIMIT_NOFILE's ",
                 descriptor_limit(), " (a reserve of ", descriptor_reserve(descriptor_limit()),
                 " is kept from clients)")
            .c_str());
  }
  auto ep = std::make_shared<Endpoint>(worker_, std::move(peer), limits_);
  try {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
    params.conn_request = request;
    ep->create_locked(params);
  } catch (const c10::Error&) {
    return;  // the client sees its connection fail; the listener goes on
  }
  handshaking_.emplace_back(ep, Clock::now());
  // ucxx's exchange, listener side: send our info, then receive the peer's; each step goes on
  // from the previous one's completion.
  write_peer_info(ep->recv_tag_, ep->handshake_.data_ptr<uint8_t>());
  std::weak_ptr<Listener> weak = weak_from_this();
  auto* info = ep->handshake_.data_ptr<uint8_t>();
  ep->start(Endpoint::Dir::kStreamSend, info, 16, ep->handshake_,
            [weak, ep, info](ucs_status_t sent, size_t) {
              auto self = weak.lock();
              if (!self) return;
              if (sent != UCS_OK) return self->handshake_done_locked(ep, sent);
              ep->start(Endpoint::Dir::kStreamRecv, info + 16, 16, ep->handshake_,
                        [weak, ep](ucs_status_t received, size_t length) {
                          auto self = weak.lock();
                          if (!self) return;
                          self->handshake_done_locked(ep, received == UCS_OK && length != 16
                                                              ? UCS_ERR_MESSAGE_TRUNCATED
                                                              : received);
                        });
            });
}

void Listener::handshake_done_locked(const std::shared_ptr<Endpoint>& ep, ucs_status_t status) {
  std::erase_if(handshaking_, [&](const auto& h) { return h.first == ep; });
  if (status == UCS_OK && !closed_) {
    try {
      ep->peer_info_ = read_peer_info(ep->handshake_.data_ptr<uint8_t>() + 16);
      ready_.push_back(ep);
      accepted_.fetch_add(1);
      ready_count_.fetch_add(1);
      worker_->notify();
      return;
    } catch (const c10::Error&) {
      // a bad checksum: not a ucxx peer; drop the connection as ucxx does
    }
  }
  ep->closed_ = true;
  ep->force_close_locked();
}

std::shared_ptr<Endpoint> Listener::accept(Millis timeout) {
  std::shared_ptr<Worker> worker;
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    worker = worker_;
  }
  if (!worker) return nullptr;  // closed
  worker->wait_until([&] { return closed_flag_.load() || ready_count_.load() > 0; },
                     Clock::now() + timeout);
  auto lk = worker->lock();
  if (closed_ || ready_.empty()) return nullptr;
  auto ep = std::move(ready_.front());
  ready_.pop_front();
  ready_count_.fetch_sub(1);
  return ep;
}

void Listener::close(Millis timeout) noexcept {
  std::shared_ptr<Worker> worker;
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    worker = worker_;
  }
  if (!worker) return;
  if (sweeping_.exchange(false)) {
    worker->remove_periodic(this);  // waits for a sweep under way
    Descriptors::get().release();
  }
  std::deque<std::shared_ptr<Endpoint>> unclaimed;
  {
    auto lk = worker->lock();
    if (closed_) return;
    closed_ = true;
    closed_flag_ = true;
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    listener_ = nullptr;  // no more requests: the callbacks below need no worker_ now
    unclaimed.swap(ready_);
    ready_count_ = 0;
    for (auto& [ep, since] : handshaking_) {
      ep->closed_ = true;
      ep->force_close_locked();
    }
    handshaking_.clear();
    // A closed listener holds no worker, so that its owner may release the worker while the
    // listener object stays (TensorDictServer keeps it for port() and clients()).
    std::lock_guard<std::mutex> lk2(close_mu_);
    worker_.reset();
  }
  worker->notify();
  for (auto& ep : unclaimed) ep->close(timeout);
}

void Listener::expire_handshakes(Worker& worker) {
  auto lk = worker.lock();
  const auto expired = Clock::now() - handshake_timeout_;
  std::erase_if(handshaking_, [&](const auto& h) {
    if (h.second > expired) return false;
    // The client never sent its peer info: its connection goes, as after a failed exchange.
    h.first->closed_ = true;
    h.first->force_close_locked();
    refused_.fetch_add(1);
    if (log_enabled(LogLevel::kInfo)) {
      log(LogLevel::kInfo,
          c10::str("pipe listener on port ", port_, ": closed the connection of ", h.first->peer(),
                   ": no peer info within ", handshake_timeout_.count(), " ms"));
    }
    return true;
  });
}

void Listener::sweep() {
  std::shared_ptr<Worker> worker;
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    worker = worker_;
  }
  if (!worker) return;
  expire_handshakes(*worker);
  const auto now = Clock::now();
  // This listener's TCP connections (the local address is the bound one, or any if it bound
  // every interface) that UCX has not made a connection request of.
  struct Seen {
    int fd;
    ino_t inode;
    std::string peer;
    Clock::time_point since;
  };
  std::vector<Seen> seen;
  std::vector<std::string> peers;
  size_t open = 0;
  for (const Socket& sock : Descriptors::get().sockets(&open)) {
    if (port_of(sock.local) != port_ ||
        (!unspecified(bound_.storage) && !same_address(sock.local, bound_.storage))) {
      continue;
    }
    const int fd = sock.fd;
    std::string peer = format_address(sock.remote);
    peers.push_back(peer);
    {
      std::lock_guard<std::mutex> lk(requested_mu_);
      if (requested_.count(peer) != 0) continue;
    }
    // A client's connection data fits UCX's buffer, and is a request once it has all come: a
    // connection that brought more is not UCX's (UCX then spins on it: docs/pipe.md), however
    // slowly the process runs. One that brings too little is given the listener's timeout.
    tcp_info info{};
    socklen_t n = sizeof(info);
    const bool overfull = sys_getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &n) == 0 &&
                          info.tcpi_bytes_received > request_bytes();
    auto it = pending_.find(sock.inode);
    const Pending p = it != pending_.end() ? it->second : Pending{now};
    pending_[sock.inode] = p;
    const bool late = now - p.since >= handshake_timeout_;
    if (overfull || late) {
      seen.push_back({fd, sock.inode, std::move(peer), Clock::time_point::min()});  // reset now
    } else {
      seen.push_back({fd, sock.inode, std::move(peer), p.since});
    }
  }
  {
    // Requests whose connections are gone (UCX closed them) need no entry any more.
    std::lock_guard<std::mutex> lk(requested_mu_);
    std::erase_if(requested_, [&](const auto& r) {
      return now - r.second > std::chrono::seconds(2) &&
             std::find(peers.begin(), peers.end(), r.first) == peers.end();
    });
  }
  // Over the bound, or the process short of descriptors: the oldest go first (a new client's
  // request takes milliseconds, an old connection had its chance).
  std::sort(seen.begin(), seen.end(),
            [](const Seen& a, const Seen& b) { return a.since < b.since; });
  size_t keep = near_descriptor_limit(open) ? 0 : kMaxPending;
  size_t live = 0;
  for (const auto& s : seen) live += s.since != Clock::time_point::min() ? 1 : 0;
  size_t over = live > keep ? live - keep : 0;
  std::vector<std::string> reset;
  std::unordered_map<ino_t, Pending> still;
  for (const auto& s : seen) {
    const bool go = s.since == Clock::time_point::min() || over > 0;
    if (go && s.since != Clock::time_point::min()) --over;
    if (go) {
      if (reset_connection(s.fd, s.inode)) reset.push_back(s.peer);
    } else {
      still[s.inode] = pending_[s.inode];
    }
  }
  pending_ = std::move(still);
  if (reset.empty()) return;
  refused_.fetch_add(static_cast<int64_t>(reset.size()));
  if (log_enabled(LogLevel::kInfo)) {
    std::string who;
    for (size_t i = 0; i < reset.size() && i < 8; ++i) who += (i ? ", " : "") + reset[i];
    if (reset.size() > 8) who += c10::str(" and ", reset.size() - 8, " more");
    log(LogLevel::kInfo,
        c10::str("pipe listener on port ", port_, ": reset ", reset.size(),
                 " TCP connections that are no UCX connection request (more than its ",
                 request_bytes(), " bytes, none within ", handshake_timeout_.count(),
                 " ms, or more than ", kMaxPending, " pending or the process near its ",
                 descriptor_limit(), " descriptors): ", who));
  }
}

}  // namespace tensordict::pipe::detail

#include "caller_connection.h"

#include <c10/util/Exception.h>

#include <utility>

#include "tensordict/errors.h"

namespace tensordict::pipe::detail {

CallerConnection::CallerConnection(CallerTransport link) : link_(std::move(link)) {
  TORCH_CHECK_VALUE(link_.send && link_.recv, "Pipe::over: the link needs send and recv");
  if (link_.peer_tag) {
    // The peer's tag as the peer-info exchange gave it: our mark tells a peer of ours.
    uint8_t bytes[16];
    write_peer_info(*link_.peer_tag, bytes);
    info_ = read_peer_info(bytes);
  }
}

void CallerConnection::send(const void* data, size_t n, const at::Tensor& /*owner*/,
                            const char* what, Millis /*timeout*/) {
  check_open("send", what);
  link_.send(data, n);
}

void CallerConnection::send_credit(const void* data, size_t n, const at::Tensor& owner,
                                   const char* what, size_t /*window*/, Millis timeout) {
  send(data, n, owner, what, timeout);
}

void CallerConnection::recv(void* data, size_t n, const at::Tensor& /*owner*/, const char* what,
                            Millis /*timeout*/) {
  check_open("recv", what);
  link_.recv(data, n);
}

void CallerConnection::close(Millis /*timeout*/) noexcept {
  if (closed_.exchange(true) || !link_.close) return;
  try {
    link_.close();
  } catch (...) {
    // close() never throws; the link is gone either way
  }
}

void CallerConnection::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) failure_ = why;
  }
  close(Millis(0));
}

void CallerConnection::check_open(const char* op, const char* what) const {
  std::lock_guard<std::mutex> lk(mu_);
  TD_CHECK_AS(PeerLostError, failure_.empty(), op, " ", what, ": the pipe to ", link_.peer,
              " is broken: ", failure_);
  TD_CHECK_AS(PipeClosedError, !closed_.load(), op, " ", what, ": the pipe to ", link_.peer,
              " is closed");
}

}  // namespace tensordict::pipe::detail

#pragma once
// A pipe over a transport the caller supplies (CallerTransport, tensordict/pipe/pipe.h; in
// Python, a ucxx endpoint): the pipe's second kind of Connection (connection.h), beside the UCX
// endpoint of ucx_endpoint.h. Each call goes to the caller's functions; its timeouts and flow
// control are the caller's.

#include <atomic>
#include <mutex>
#include <string>

#include "connection.h"
#include "tensordict/pipe/pipe.h"

namespace tensordict::pipe::detail {

class CallerConnection final : public Connection {
 public:
  /// ValueError when `link` has no send or recv.
  explicit CallerConnection(CallerTransport link);
  void send(const void* data, size_t n, const at::Tensor& owner, const char* what,
            Millis timeout) override;
  void send_credit(const void* data, size_t n, const at::Tensor& owner, const char* what,
                   size_t window, Millis timeout) override;
  void recv(void* data, size_t n, const at::Tensor& owner, const char* what,
            Millis timeout) override;
  bool drain(Millis) override { return true; }
  void close(Millis timeout) noexcept override;
  bool peer_gone() const override { return false; }
  void fail(const std::string& why) override;
  const std::string& peer() const override { return link_.peer; }
  const PeerInfo& peer_info() const override { return info_; }
  std::string transports() override { return "the caller's link"; }

 private:
  void check_open(const char* op, const char* what) const;

  CallerTransport link_;
  PeerInfo info_;
  std::atomic<bool> closed_{false};
  mutable std::mutex mu_;
  std::string failure_;  // set by fail(), from the pipe's threads
};

}  // namespace tensordict::pipe::detail

#pragma once
// Socket addresses for UCX's client-server connections: host:port resolved for connecting (the
// endpoint) and listening (the listener), and read back for messages and port(). Plain sockets
// API, no UCX; shared so that both sides parse a host and a port alike.

#include <sys/socket.h>

#include <string>

namespace tensordict::pipe::detail {

/// Resolves host:port to a socket address (numeric or by name); ValueError on failure.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
};
SockAddr resolve(const std::string& host, int port, bool passive);
std::string format_address(const sockaddr_storage& addr);
/// The port of an IPv4 or IPv6 address; 0 for another family.
int port_of(const sockaddr_storage& addr);

}  // namespace tensordict::pipe::detail

#include "ucx_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstring>

namespace tensordict::pipe::detail {

SockAddr resolve(const std::string& host, int port, bool passive) {
  TORCH_CHECK_VALUE(port >= 0 && port <= 65535, "pipe: port must be in [0, 65535], got ", port);
  TORCH_CHECK_VALUE(!host.empty(), "pipe: empty host");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  TORCH_CHECK_VALUE(rc == 0 && result != nullptr, "pipe: cannot resolve host '", host,
                    "': ", gai_strerror(rc));
  SockAddr out;
  std::memcpy(&out.storage, result->ai_addr, result->ai_addrlen);
  out.length = result->ai_addrlen;
  ::freeaddrinfo(result);
  return out;
}

std::string format_address(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  } else {
    return "?";
  }
  return c10::str(host, ":", port);
}

int port_of(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET)
    return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  }
  return 0;
}

}  // namespace tensordict::pipe::detail

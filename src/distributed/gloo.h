#pragma once
// The only door to Gloo. gloo.cpp is the one file compiled with USE_C10D_GLOO and the Gloo
// headers; everything else sees c10d base types.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace tensordict::dist::detail {

/// True when this build can make Gloo backends.
bool gloo_available();

/// A c10d::ProcessGroupGloo over `store` (which it uses for rendezvous; blocks until every
/// rank has joined or `timeout` passes). Its device binds to `hostname` when given, else to
/// the interfaces in GLOO_SOCKET_IFNAME, else to this machine's hostname (torch's rules).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& hostname);

}  // namespace tensordict::dist::detail

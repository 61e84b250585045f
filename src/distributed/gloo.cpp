// The one file that includes ProcessGroupGloo.hpp, and so the Gloo headers: the torch wheel
// ships none, they come from the system's libgloo-dev (CMakeLists.txt gives this file their
// directory and USE_C10D_GLOO, which torch's CMake target also defines for every consumer).
#include "gloo.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <csignal>
#include <cstdlib>
#include <sstream>

#include "core/env.h"

namespace tensordict::dist::detail {

namespace {

// Gloo writes to its TCP sockets without MSG_NOSIGNAL: a write to a peer that just died raises
// SIGPIPE, whose default action kills this process before Gloo can report the broken pair as an
// error naming the peer. Python ignores SIGPIPE in every interpreter; a C++ program gets the same
// here, once, unless it installed a handler of its own (which is then left alone).
void ignore_default_sigpipe() {
  static const bool done = [] {
    struct sigaction current{};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      std::signal(SIGPIPE, SIG_IGN);
    }
    return true;
  }();
  (void)done;
}

}  // namespace

bool gloo_available() { return true; }

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& hostname) {
  using c10d::ProcessGroupGloo;
  ignore_default_sigpipe();
  auto options = ProcessGroupGloo::Options::create(timeout);
  if (!hostname.empty()) {
    options->devices.push_back(ProcessGroupGloo::createDeviceForHostname(hostname));
  } else if (const auto ifnames = core::env("GLOO_SOCKET_IFNAME")) {
    std::stringstream list(*ifnames);
    for (std::string name; std::getline(list, name, ',');) {
      if (!name.empty()) {
        options->devices.push_back(ProcessGroupGloo::createDeviceForInterface(name));
      }
    }
  } else {
    options->devices.push_back(ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace tensordict::dist::detail

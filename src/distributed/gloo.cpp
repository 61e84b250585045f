// The one file that includes ProcessGroupGloo.hpp, and so the Gloo headers: the torch wheel
// ships none, they come from the system's libgloo-dev (CMakeLists.txt gives this file their
// directory and USE_C10D_GLOO, which torch's CMake target also defines for every consumer).
#include "gloo.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include <sstream>

namespace tensordict::dist::detail {

bool gloo_available() { return true; }

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& hostname) {
  using c10d::ProcessGroupGloo;
  auto options = ProcessGroupGloo::Options::create(timeout);
  if (!hostname.empty()) {
    options->devices.push_back(ProcessGroupGloo::createDeviceForHostname(hostname));
  } else if (const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME"); ifnames && *ifnames) {
    std::stringstream list(ifnames);
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

#pragma once
// The one reader of environment variables that configure us (TENSORDICT_*, torchrun's RANK,
// MASTER_ADDR, ..., GLOO_SOCKET_IFNAME): a variable set to the empty string counts as unset, as
// torch's own readers treat it.

#include <cstdlib>
#include <optional>
#include <string>

namespace tensordict::core {

inline std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? std::optional<std::string>(value) : std::nullopt;
}

}  // namespace tensordict::core

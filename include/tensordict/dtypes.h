#pragma once
// dtype names as Python prints them ("torch.float32"): used by repr and by the metadata that
// travels on the wire.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <string_view>

namespace tensordict {

/// "torch.float32", "torch.bool", ... : str(dtype) in Python, always the canonical name.
/// Every ScalarType of this torch build has one.
std::string dtype_name(at::ScalarType dtype);

/// The inverse of dtype_name for the canonical names; std::nullopt for anything else
/// (aliases such as "torch.float" are not canonical and are refused).
std::optional<at::ScalarType> dtype_from_name(std::string_view name);

}  // namespace tensordict

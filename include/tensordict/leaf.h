#pragma once
// What a leaf must be for its bytes to travel: every transfer moves a leaf as the bytes of its
// storage, so a tensor without plain strided storage is refused up front, by key, instead of
// failing deep inside c10d (or, for meta tensors, silently sending nothing).

#include <ATen/core/Tensor.h>

#include <string_view>

namespace tensordict {

/// Why `leaf`'s bytes cannot be sent, received or consolidated, in words ("is on the meta
/// device, which holds no data"); nullptr when they can. Refused: meta tensors, sparse and
/// other non-strided layouts, nested (jagged) tensors, quantized dtypes (whose storage is not
/// numel * element size), tensor subclasses that dispatch to Python (a DTensor) and tensors
/// without storage.
const char* untransferable_reason(const at::Tensor& leaf);

/// ValueError "<who>: leaf <key> <reason>" when untransferable_reason(leaf) is not null
/// (NotImplementedError for a subclass that dispatches to Python, as the reference's DTensor).
void check_transferable(std::string_view who, std::string_view key, const at::Tensor& leaf);

}  // namespace tensordict

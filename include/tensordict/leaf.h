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

/// Tells autograd that a transport writes `leaf`'s memory behind its back (Gloo receiving or
/// reducing into it, a bucket's bytes copied back with memcpy): bumps its version counter, as
/// any in-place op does, so that a backward that saved the tensor (a Parameter used before the
/// receive) raises "one of the variables needed for gradient computation has been modified by
/// an inplace operation" instead of silently using the new values. Views share their base's
/// counter, so marking a view marks the base. Inference tensors, which have no counter, are
/// left alone. The reference does not do this (docs/distributed.md).
void mark_written(const at::Tensor& leaf);

}  // namespace tensordict

#include "tensordict/leaf.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include "tensordict/dtypes.h"

namespace tensordict {
namespace {

constexpr const char* kQuantized =
    "has a quantized dtype, whose storage is not numel * element size bytes; dequantize() it "
    "first";
// A wrapper subclass has no storage of its own to hand to c10d or to pack.
constexpr const char* kPythonSubclass =
    "is a tensor subclass that dispatches to Python, such as a DTensor (DTensor is not supported "
    "yet): transfer its local shard (to_local()) or its full_tensor() instead";

}  // namespace

const char* untransferable_reason(const at::Tensor& leaf) {
  if (!leaf.defined()) return "is an undefined tensor";
  // Nested tensors report a strided layout on some builds: test them first.
  if (leaf.is_nested()) return "is a nested (jagged) tensor, which has no single storage to send";
  if (leaf.layout() != at::kStrided) {
    return leaf.is_sparse() || leaf.is_sparse_csr()
               ? "is a sparse tensor, which has no dense storage to send; call to_dense() first"
               : "has a non-strided layout, which has no dense storage to send";
  }
  if (leaf.is_meta()) return "is on the meta device, which holds no data to send or receive";
  if (c10::isQIntType(leaf.scalar_type())) return kQuantized;
  if (leaf.unsafeGetTensorImpl()->is_python_dispatch()) return kPythonSubclass;
  if (!leaf.has_storage()) return "has no storage";
  return nullptr;
}

void check_transferable(std::string_view who, std::string_view key, const at::Tensor& leaf) {
  const char* reason = untransferable_reason(leaf);
  if (reason == nullptr) return;
  if (reason == kQuantized) {  // named with its dtype
    TORCH_CHECK_VALUE(false, who, ": leaf ", key, " has the quantized dtype ",
                      dtype_name(leaf.scalar_type()),
                      ", whose storage is not numel * element "
                      "size bytes; dequantize() it first");
  }
  // NotImplementedError, as the reference fails on a DTensor (its sharding propagation has no
  // rule for the c10d ops).
  TORCH_CHECK_NOT_IMPLEMENTED(reason != kPythonSubclass, who, ": leaf ", key, " ", reason);
  TORCH_CHECK_VALUE(false, who, ": leaf ", key, " ", reason);
}

void mark_written(const at::Tensor& leaf) {
  if (leaf.defined() && !leaf.is_inference()) leaf.unsafeGetTensorImpl()->bump_version();
}

}  // namespace tensordict

#include "tensordict/dtypes.h"

#include <utility>

#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

namespace tensordict {
namespace {

using at::ScalarType;

// Python's str(dtype) for every ScalarType of the torch this is built against: 2.13's, and
// BComplex32 since 2.14 (Dtypes.NamesRoundTrip checks that none is missing).
constexpr std::pair<ScalarType, std::string_view> kNames[] = {
    {ScalarType::Byte, "torch.uint8"},
    {ScalarType::Char, "torch.int8"},
    {ScalarType::Short, "torch.int16"},
    {ScalarType::Int, "torch.int32"},
    {ScalarType::Long, "torch.int64"},
    {ScalarType::Half, "torch.float16"},
    {ScalarType::Float, "torch.float32"},
    {ScalarType::Double, "torch.float64"},
    {ScalarType::ComplexHalf, "torch.complex32"},
    {ScalarType::ComplexFloat, "torch.complex64"},
    {ScalarType::ComplexDouble, "torch.complex128"},
    {ScalarType::Bool, "torch.bool"},
    {ScalarType::QInt8, "torch.qint8"},
    {ScalarType::QUInt8, "torch.quint8"},
    {ScalarType::QInt32, "torch.qint32"},
    {ScalarType::BFloat16, "torch.bfloat16"},
    {ScalarType::QUInt4x2, "torch.quint4x2"},
    {ScalarType::QUInt2x4, "torch.quint2x4"},
    {ScalarType::Bits1x8, "torch.bits1x8"},
    {ScalarType::Bits2x4, "torch.bits2x4"},
    {ScalarType::Bits4x2, "torch.bits4x2"},
    {ScalarType::Bits8, "torch.bits8"},
    {ScalarType::Bits16, "torch.bits16"},
    {ScalarType::Float8_e5m2, "torch.float8_e5m2"},
    {ScalarType::Float8_e4m3fn, "torch.float8_e4m3fn"},
    {ScalarType::Float8_e5m2fnuz, "torch.float8_e5m2fnuz"},
    {ScalarType::Float8_e4m3fnuz, "torch.float8_e4m3fnuz"},
    {ScalarType::UInt16, "torch.uint16"},
    {ScalarType::UInt32, "torch.uint32"},
    {ScalarType::UInt64, "torch.uint64"},
    {ScalarType::UInt1, "torch.uint1"},
    {ScalarType::UInt2, "torch.uint2"},
    {ScalarType::UInt3, "torch.uint3"},
    {ScalarType::UInt4, "torch.uint4"},
    {ScalarType::UInt5, "torch.uint5"},
    {ScalarType::UInt6, "torch.uint6"},
    {ScalarType::UInt7, "torch.uint7"},
    {ScalarType::Int1, "torch.int1"},
    {ScalarType::Int2, "torch.int2"},
    {ScalarType::Int3, "torch.int3"},
    {ScalarType::Int4, "torch.int4"},
    {ScalarType::Int5, "torch.int5"},
    {ScalarType::Int6, "torch.int6"},
    {ScalarType::Int7, "torch.int7"},
    {ScalarType::Float8_e8m0fnu, "torch.float8_e8m0fnu"},
    {ScalarType::Float4_e2m1fn_x2, "torch.float4_e2m1fn_x2"},
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
    {ScalarType::BComplex32, "torch.bcomplex32"},
#endif
};

}  // namespace

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& [type, name] : kNames) {
    if (type == dtype) return std::string(name);
  }
  TORCH_INTERNAL_ASSERT(false, "no Python name for dtype ", c10::toString(dtype));
}

std::optional<at::ScalarType> dtype_from_name(std::string_view name) {
  for (const auto& [type, n] : kNames) {
    if (n == name) return type;
  }
  return std::nullopt;
}

}  // namespace tensordict

// What a leaf must be for its bytes to travel (leaf.h): every kind without plain strided
// storage is refused with the key and the reason.
#include <gtest/gtest.h>

#include "tensordict/leaf.h"
#include "tensordict/tensor_dict.h"

namespace tensordict {
namespace {

std::string error_of(const at::Tensor& leaf) {
  try {
    check_transferable("send", "('x', 'm')", leaf);
  } catch (const c10::ValueError& e) {
    return e.msg();
  }
  return "<no error>";
}

TEST(Leaf, PlainTensorsTravel) {
  for (const auto& t : {at::zeros({2, 3}), at::zeros({2, 3}).t(), at::zeros({0}),
                        at::zeros({}, at::kComplexFloat), at::zeros({4}).expand({2, 4})}) {
    EXPECT_EQ(untransferable_reason(t), nullptr);
    EXPECT_EQ(error_of(t), "<no error>");
  }
}

TEST(Leaf, StoragelessKindsAreRefusedByKey) {
  EXPECT_EQ(error_of(at::empty({2}, at::TensorOptions().device(at::kMeta))),
            "send: leaf ('x', 'm') is on the meta device, which holds no data to send or "
            "receive");
  EXPECT_EQ(error_of(at::eye(3).to_sparse()).rfind("send: leaf ('x', 'm') is a sparse tensor", 0),
            0u);
  EXPECT_EQ(error_of(at::eye(3).to_sparse_csr()).rfind("send: leaf ('x', 'm') is a sparse", 0), 0u);
  EXPECT_EQ(error_of(at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8)),
            "send: leaf ('x', 'm') has the quantized dtype torch.qint8, whose storage is not "
            "numel * element size bytes; dequantize() it first");
  EXPECT_EQ(error_of(at::Tensor()), "send: leaf ('x', 'm') is an undefined tensor");
}

// A TensorDict does not even hold one: no fixed shape to check against its batch size.
TEST(Leaf, NestedTensorsAreNoLeaves) {
  const auto nested = at::_nested_tensor_from_tensor_list({at::ones({2}), at::ones({3})});
  EXPECT_NE(untransferable_reason(nested), nullptr);
  try {
    TensorDict({{"n", nested}}, {2});
    ADD_FAILURE() << "expected TypeError";
  } catch (const c10::TypeError& e) {
    EXPECT_EQ(e.msg(),
              "cannot set key 'n' to a nested (jagged) tensor: a leaf needs a fixed shape");
  }
}

}  // namespace
}  // namespace tensordict

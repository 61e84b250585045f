// The repr must match the reference's detailed form character for character; the expected
// strings below were printed by tensordict 0.15.3 under set_printoptions(compact=False), and
// tests/python/test_repr_reference.py re-checks the same cases against the installed reference.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>

#include "tensordict/tensordict.h"

using tensordict::TensorDict;

TEST(Repr, NestedMatchesReference) {
  TensorDict td({{"b", at::ones({4, 3}, at::kLong)}, {"a", at::ones({4})}}, {4});
  td.set({"c", "d"}, at::zeros({4, 2}, at::kBool));
  td.set({"c", "e", "f"}, at::ones({4}));
  const std::string expected =
      "TensorDict(\n"
      "    fields={\n"
      "        a: Tensor(shape=torch.Size([4]), device=cpu, dtype=torch.float32, is_shared=False),\n"
      "        b: Tensor(shape=torch.Size([4, 3]), device=cpu, dtype=torch.int64, is_shared=False),\n"
      "        c: TensorDict(\n"
      "            fields={\n"
      "                d: Tensor(shape=torch.Size([4, 2]), device=cpu, dtype=torch.bool, is_shared=False),\n"
      "                e: TensorDict(\n"
      "                    fields={\n"
      "                        f: Tensor(shape=torch.Size([4]), device=cpu, dtype=torch.float32, is_shared=False)},\n"
      "                    batch_size=torch.Size([4]),\n"
      "                    device=None,\n"
      "                    is_shared=False)},\n"
      "            batch_size=torch.Size([4]),\n"
      "            device=None,\n"
      "            is_shared=False)},\n"
      "    batch_size=torch.Size([4]),\n"
      "    device=None,\n"
      "    is_shared=False)";
  EXPECT_EQ(td.repr(), expected);
  std::ostringstream os;
  os << td;
  EXPECT_EQ(os.str(), expected);
}

TEST(Repr, EmptyAndDevice) {
  EXPECT_EQ(TensorDict().repr(),
            "TensorDict(\n"
            "    fields={\n"
            "    },\n"
            "    batch_size=torch.Size([]),\n"
            "    device=None,\n"
            "    is_shared=False)");
  TensorDict td({{"x", at::scalar_tensor(1.0)}}, {}, at::Device("cpu"));
  EXPECT_EQ(td.repr(),
            "TensorDict(\n"
            "    fields={\n"
            "        x: Tensor(shape=torch.Size([]), device=cpu, dtype=torch.float32, is_shared=False)},\n"
            "    batch_size=torch.Size([]),\n"
            "    device=cpu,\n"
            "    is_shared=False)");
}

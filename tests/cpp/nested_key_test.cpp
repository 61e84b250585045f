#include <gtest/gtest.h>

#include "tensordict/dtypes.h"
#include "tensordict/nested_key.h"

using tensordict::NestedKey;

TEST(NestedKey, FromStringAndList) {
  NestedKey a = "a";
  EXPECT_EQ(a.size(), 1u);
  EXPECT_FALSE(a.is_nested());
  NestedKey ab{"a", "b"};
  EXPECT_TRUE(ab.is_nested());
  EXPECT_EQ(ab.front(), "a");
  EXPECT_EQ(ab.back(), "b");
  EXPECT_EQ(ab.parent(), NestedKey("a"));
  EXPECT_EQ(NestedKey("a").join(NestedKey{"b", "c"}), (NestedKey{"a", "b", "c"}));
  EXPECT_EQ(NestedKey(std::vector<std::string>{"x"}), NestedKey("x"));
}

TEST(NestedKey, StrLikePython) {
  EXPECT_EQ(NestedKey("b").str(), "'b'");
  EXPECT_EQ((NestedKey{"obs", "pixels"}).str(), "('obs', 'pixels')");
  EXPECT_EQ(NestedKey("it's").str(), "\"it's\"");
  EXPECT_EQ(NestedKey("a\\b").str(), "'a\\\\b'");
}

TEST(NestedKey, EmptyPathIsValueError) {
  EXPECT_THROW(NestedKey(std::vector<std::string>{}), c10::ValueError);
  EXPECT_THROW(NestedKey("a").parent(), c10::ValueError);
}

TEST(Dtypes, NamesRoundTrip) {
  for (int i = 0; i < static_cast<int>(at::ScalarType::NumOptions); ++i) {
    const auto t = static_cast<at::ScalarType>(i);
    if (t == at::ScalarType::Undefined) continue;
    const std::string name = tensordict::dtype_name(t);
    EXPECT_EQ(name.rfind("torch.", 0), 0u) << name;
    EXPECT_EQ(tensordict::dtype_from_name(name), t) << name;
  }
  EXPECT_EQ(tensordict::dtype_name(at::kFloat), "torch.float32");
  EXPECT_EQ(tensordict::dtype_name(at::kBFloat16), "torch.bfloat16");
  EXPECT_EQ(tensordict::dtype_name(at::kComplexDouble), "torch.complex128");
  EXPECT_EQ(tensordict::dtype_from_name("torch.float"), std::nullopt);
  EXPECT_EQ(tensordict::dtype_from_name("float32"), std::nullopt);
}

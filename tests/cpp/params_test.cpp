// TensorDictParams (params.h): a torch::nn::Module whose parameters and buffers are the leaves
// of a TensorDict (the same tensors), as the reference's tensordict.nn.TensorDictParams.
// The weight-sync flow over c10d (a receive into params()) is in dist_receivers_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>

#include "expect_throw.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/params.h"

namespace tensordict {
namespace {

std::vector<std::string> names(const torch::OrderedDict<std::string, at::Tensor>& d) {
  std::vector<std::string> out;
  for (const auto& item : d) out.push_back(item.key());
  return out;
}

bool same_impl(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

// f32 "a", f16 "h", i64 "i", bool "m", non-tensor "label", nested "n" {f64 "w", i32 "k"}.
TensorDict sample() {
  TensorDict n({{"w", at::ones({3}, at::kDouble)}, {"k", at::zeros({2}, at::kInt)}});
  TensorDict td({{"a", at::full({2, 2}, 2.0)},
                 {"h", at::ones({4}, at::kHalf)},
                 {"i", at::arange(3, at::kLong)},
                 {"m", at::ones({1}, at::kBool)},
                 {"n", n}});
  td.set_non_tensor("label", "policy");
  return td;
}

TEST(TensorDictParams, FloatLeavesBecomeParametersTheOthersBuffers) {
  TensorDict td = sample();
  const at::Tensor a = td.get("a").tensor();
  ASSERT_FALSE(a.requires_grad());
  TensorDictParams p(td);
  EXPECT_TRUE(p.params().is_same(td));  // wrapped, not copied
  EXPECT_EQ(names(p.named_parameters()), (std::vector<std::string>{"a", "h", "n.w"}));
  EXPECT_EQ(names(p.named_buffers()), (std::vector<std::string>{"i", "m", "n.k"}));
  for (const auto& item : p.named_parameters()) {
    EXPECT_TRUE(item.value().requires_grad()) << item.key();
  }
  // The module's tensors are the TensorDict's leaves (the same TensorImpl).
  const auto params = p.named_parameters();
  const auto buffers = p.named_buffers();
  EXPECT_TRUE(same_impl(params["a"], td.get("a").tensor()));
  EXPECT_TRUE(same_impl(params["a"], a));  // converted in place, not replaced
  EXPECT_TRUE(same_impl(params["n.w"], td.get({"n", "w"}).tensor()));
  EXPECT_TRUE(same_impl(buffers["n.k"], td.get({"n", "k"}).tensor()));
  EXPECT_TRUE(same_impl(buffers["i"], td.get("i").tensor()));
  EXPECT_EQ(p.parameters().size(), 3u);
  // The nested level is a submodule, a TensorDictParams of its own.
  auto child = std::dynamic_pointer_cast<TensorDictParams>(p.named_children()["n"]);
  ASSERT_NE(child, nullptr);
  EXPECT_TRUE(child->params().is_same(td.get("n").tensordict()));
  // The non-tensor entry stays in the TensorDict, unregistered.
  EXPECT_EQ(p.params().get_non_tensor("label"), JsonValue("policy"));
  EXPECT_FALSE(p.params().is_locked());
}

TEST(TensorDictParams, NoConvertRegistersByRequiresGrad) {
  TensorDict td({{"g", at::ones({2}).requires_grad_()},
                 {"f", at::ones({2})},
                 {"i", at::ones({2}, at::kLong)}});
  TensorDictParams p(td, {.no_convert = true});
  EXPECT_EQ(names(p.named_parameters()), (std::vector<std::string>{"g"}));
  EXPECT_EQ(names(p.named_buffers()), (std::vector<std::string>{"f", "i"}));
  EXPECT_FALSE(p.named_buffers()["f"].requires_grad());
}

TEST(TensorDictParams, NonLeafFloatTensorsAreDetached) {
  const at::Tensor base = at::ones({3}).requires_grad_();
  const at::Tensor derived = base * 2;  // has a grad_fn
  ASSERT_TRUE(derived.grad_fn());
  TensorDictParams p(TensorDict({{"d", derived}}));
  const at::Tensor d = p.params().get("d").tensor();
  EXPECT_FALSE(d.grad_fn());
  EXPECT_TRUE(d.requires_grad());
  EXPECT_TRUE(d.is_leaf());
  EXPECT_TRUE(same_impl(p.named_parameters()["d"], d));
  EXPECT_EQ(d.data_ptr(), derived.data_ptr());  // the same memory, detached
}

TEST(TensorDictParams, LockAndSet) {
  TensorDict td = sample();
  TensorDictParams p(td, {.lock = true});
  EXPECT_TRUE(p.params().is_locked());
  EXPECT_TRUE(p.params().get("n").tensordict().is_locked());
  EXPECT_THROW(TensorDict(p.params()).set("x", at::ones({1})), c10::Error);

  // set() of an existing key writes in place: the registered tensor stays the same.
  const at::Tensor before = p.named_parameters()["a"];
  const void* data = before.data_ptr();
  p.set("a", at::full({2, 2}, 9.0));
  EXPECT_TRUE(same_impl(p.named_parameters()["a"], before));
  EXPECT_EQ(p.named_parameters()["a"].data_ptr(), data);
  EXPECT_TRUE(before.eq(9).all().item<bool>());
  EXPECT_TRUE(before.requires_grad());
  p.set({"n", "w"}, at::full({3}, 4.0, at::kDouble));
  EXPECT_TRUE(p.named_parameters()["n.w"].eq(4).all().item<bool>());

  // A new key is registered as the constructor would, even on a locked TensorDict.
  p.set("b", at::zeros({5}));
  p.set({"n", "j"}, at::zeros({5}, at::kLong));
  EXPECT_TRUE(p.params().is_locked());
  EXPECT_TRUE(p.params().contains("b"));
  EXPECT_TRUE(same_impl(p.named_parameters()["b"], p.params().get("b").tensor()));
  EXPECT_TRUE(p.named_parameters()["b"].requires_grad());
  EXPECT_TRUE(same_impl(p.named_buffers()["n.j"], p.params().get({"n", "j"}).tensor()));
  // Under a nested level that does not exist: refused.
  EXPECT_THROW_MSG(p.set({"zz", "q"}, at::zeros({1})), c10::ValueError, "nested level");
  EXPECT_FALSE(p.params().contains("zz"));
}

TEST(TensorDictParams, RefusesWhatCannotBeRegistered) {
  EXPECT_THROW_MSG(TensorDictParams(TensorDict({{"a.b", at::ones({1})}})), c10::ValueError,
                   "'a.b'");
  const LazyStackedTensorDict lazy =
      lazy_stack({TensorDict({{"x", at::ones({1})}}), TensorDict({{"x", at::ones({1})}})});
  EXPECT_THROW_MSG(TensorDictParams(TensorDict(lazy)), c10::ValueError, "lazy stack");
}

TEST(TensorDictParams, FromModuleSharesTheModulesTensors) {
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                            torch::nn::Linear(4, 2));
  auto p = TensorDictParams::from_module(*net);
  const auto want_params = net->named_parameters();
  const auto want_buffers = net->named_buffers();
  EXPECT_EQ(names(p->named_parameters()), names(want_params));
  EXPECT_EQ(names(p->named_buffers()), names(want_buffers));
  for (const auto& item : want_params) {
    EXPECT_TRUE(same_impl(p->named_parameters()[item.key()], item.value())) << item.key();
  }
  for (const auto& item : want_buffers) {
    EXPECT_TRUE(same_impl(p->named_buffers()[item.key()], item.value())) << item.key();
  }
  // Nothing converted: the integer buffer stays a buffer, and the float buffers too.
  EXPECT_TRUE(p->named_buffers().contains("1.num_batches_tracked"));
  EXPECT_TRUE(p->named_buffers().contains("1.running_mean"));
  EXPECT_FALSE(p->named_parameters().contains("1.running_mean"));

  // Writes into the TensorDict are writes into the module.
  auto* lin = net[0]->as<torch::nn::Linear>();
  ASSERT_NE(lin, nullptr);
  p->set({"0", "weight"}, at::full({4, 3}, 0.5));
  EXPECT_TRUE(lin->weight.eq(0.5).all().item<bool>());
  {
    // params() is a plain TensorDict: as the reference's, in-place writes into leaves that
    // require grad need no-grad mode (set() and the receives take care of it).
    EXPECT_THROW(
        TensorDict(p->params()).update_(TensorDict({{{"0", "bias"}, at::full({4}, -1.0)}})),
        c10::Error);
    at::NoGradGuard no_grad;
    TensorDict(p->params()).update_(TensorDict({{{"0", "bias"}, at::full({4}, -1.0)}}));
  }
  EXPECT_TRUE(lin->bias.eq(-1).all().item<bool>());
  const at::Tensor out = net->forward(at::ones({2, 3}));
  EXPECT_EQ(out.sizes(), at::IntArrayRef({2, 2}));

  // lock.
  EXPECT_TRUE(TensorDictParams::from_module(*net, {.lock = true})->params().is_locked());
}

}  // namespace
}  // namespace tensordict

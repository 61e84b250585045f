// from_module / to_module over torch::nn::Module: the module's own tensors, nested by submodule.
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "expect_throw.h"
#include "tensordict/module.h"

using namespace tensordict;

namespace {

torch::nn::Sequential net() {
  return torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::ReLU(),
                               torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 2));
}

}  // namespace

TEST(Module, FromModuleHoldsTheModulesOwnTensors) {
  auto m = net();
  TensorDict td = from_module(*m);
  std::vector<std::string> keys;
  for (const auto& k : td.keys({.include_nested = true, .leaves_only = true}))
    keys.push_back(k.str());
  EXPECT_EQ(keys, (std::vector<std::string>{"('0', 'weight')", "('0', 'bias')", "('2', 'weight')",
                                            "('2', 'bias')", "('2', 'running_mean')",
                                            "('2', 'running_var')", "('2', 'num_batches_tracked')",
                                            "('3', 'weight')", "('3', 'bias')"}));
  const auto* lin = m[0]->as<torch::nn::Linear>();
  EXPECT_TRUE(td.get({"0", "weight"}).tensor().is_same(lin->weight));
  EXPECT_FALSE(td.contains("1"));  // ReLU holds nothing
  EXPECT_TRUE(from_module(*m, {.filter_empty = false}).contains("1"));
  EXPECT_TRUE(from_module(*m, {.lock = true}).is_locked());
}

TEST(Module, ToModuleSwapsAndRestores) {
  auto m = net();
  auto* lin = m[0]->as<torch::nn::Linear>();
  const at::Tensor before = lin->weight.detach().clone();
  TensorDict zeros = from_module(*m).apply([](const at::Tensor& t) { return at::zeros_like(t); });
  auto old = to_module(zeros, *m);
  ASSERT_TRUE(old.has_value());
  // The member handle the module's forward() uses sees the new values, and stays a parameter.
  EXPECT_TRUE(lin->weight.eq(0).all().item<bool>());
  EXPECT_TRUE(lin->weight.requires_grad());
  EXPECT_TRUE(old->get({"0", "weight"}).tensor().equal(before));
  to_module(*old, *m, {.return_swap = false});
  EXPECT_TRUE(lin->weight.equal(before));
  // In place: the same storage, the values copied.
  const void* data = lin->weight.data_ptr();
  TensorDict ones = from_module(*m).apply([](const at::Tensor& t) { return at::ones_like(t); });
  auto prev = to_module(ones, *m, {.inplace = true});
  EXPECT_EQ(lin->weight.data_ptr(), data);
  EXPECT_TRUE(lin->weight.eq(1).all().item<bool>());
  EXPECT_TRUE(prev->get({"0", "weight"}).tensor().equal(before));
}

TEST(Module, ToModuleNamesAMissingKey) {
  auto m = net();
  EXPECT_THROW_MSG(to_module(TensorDict({{{"0", "nope"}, at::zeros({1})}}), *m), KeyError,
                   "'nope' is not a parameter or buffer of torch::nn::LinearImpl");
  EXPECT_THROW_MSG(to_module(TensorDict({{{"9", "w"}, at::zeros({1})}}), *m), KeyError,
                   "'9' is not a submodule of torch::nn::SequentialImpl");
}

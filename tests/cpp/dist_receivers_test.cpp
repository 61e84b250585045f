// Receivers other than a plain TensorDict, on real processes over Gloo (127.0.0.1, FileStore
// rendezvous): the rows of a parent (SubTensorDict), unbatched leaves, and TensorDictParams
// whose leaves are a live module's parameters (the weight-sync flow).
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include "dist_test_util.h"
#include "expect_throw.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/collectives.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/params.h"
#include "tensordict/sub_tensor_dict.h"

namespace tensordict::dist {
namespace {

using at::indexing::Slice;
using testing::run_ranks;

// A parent of 6 rows, every leaf 0: a [6, 3] float, n.b [6] long, n.c [6, 2, 2] double.
TensorDict zero_parent() {
  TensorDict n({{"b", at::zeros({6}, at::kLong)}, {"c", at::zeros({6, 2, 2}, at::kDouble)}}, {6});
  return TensorDict({{"a", at::zeros({6, 3})}, {"n", n}}, {6});
}

// What the sender sends for `rows` rows: leaf values base + row + 1 (never 0).
TensorDict rows_of(int64_t rows, double base) {
  const auto r = [&](at::IntArrayRef shape, at::ScalarType t) {
    std::vector<int64_t> view(shape.size(), 1);
    view[0] = rows;
    return (at::arange(rows, at::kDouble).view(view) + base + 1).expand(shape).to(t).contiguous();
  };
  TensorDict n({{"b", r({rows}, at::kLong)}, {"c", r({rows, 2, 2}, at::kDouble)}}, {rows});
  return TensorDict({{"a", r({rows, 3}, at::kFloat)}, {"n", n}}, {rows});
}

// Rows `picked` of `parent` hold `sent`'s rows in order; every other row is still 0.
void expect_rows(const TensorDict& parent, const std::vector<int64_t>& picked,
                 const TensorDict& sent) {
  for (const auto& [key, leaf] : parent.items({.include_nested = true, .leaves_only = true})) {
    const at::Tensor t = leaf.tensor();
    const at::Tensor want = sent.get(key).tensor();
    for (int64_t row = 0; row < t.size(0); ++row) {
      const auto it = std::find(picked.begin(), picked.end(), row);
      if (it == picked.end()) {
        EXPECT_TRUE(t[row].eq(0).all().item<bool>()) << key.str() << " row " << row;
      } else {
        EXPECT_TRUE(at::equal(t[row], want[it - picked.begin()])) << key.str() << " row " << row;
      }
    }
  }
}

struct SubCase {
  const char* name;
  std::vector<at::indexing::TensorIndex> index;
  std::vector<int64_t> picked;  // the parent's rows that index selects, in order
};

std::vector<SubCase> sub_cases() {
  return {
      {"slice", {Slice(1, 3)}, {1, 2}},
      {"strided_slice", {Slice(0, 6, 2)}, {0, 2, 4}},
      {"index_tensor", {at::tensor({4, 0}, at::kLong)}, {4, 0}},
      {"mask", {at::tensor({0, 1, 0, 0, 1, 1}, at::kByte).to(at::kBool)}, {1, 4, 5}},
  };
}

// Per leaf and consolidated, blocking and not: the values land in the parent's rows, and the
// parent's leaves stay the same tensors.
TEST(DistSubTensorDict, RecvAndIrecvLandInTheParentsRows) {
  run_ranks(2, [](int rank, int) {
    double base = 0;
    for (const auto& c : sub_cases()) {
      for (int mode = 0; mode < 4; ++mode) {  // recv, irecv, recv consolidated, irecv consolidated
        SCOPED_TRACE(c10::str(c.name, " mode ", mode));
        const bool consolidated = mode >= 2;
        base += 10;
        const auto rows = static_cast<int64_t>(c.picked.size());
        if (rank == 0) {
          const TensorDict td = rows_of(rows, base);
          send(consolidated ? consolidate(td) : td, 1, {.consolidated = consolidated});
          continue;
        }
        TensorDict parent = zero_parent();
        const void* a_data = parent.get("a").tensor().data_ptr();
        const void* c_data = parent.get({"n", "c"}).tensor().data_ptr();
        SubTensorDict sub(parent, c.index);
        EXPECT_EQ(sub.batch_size(), at::IntArrayRef({rows}));
        if (mode % 2 == 0) {
          const auto tag = recv(sub, 0, {.consolidated = consolidated});
          if (consolidated) {
            EXPECT_EQ(tag, std::nullopt);
          } else {
            EXPECT_EQ(tag, 2);  // three leaves from init_tag 0
          }
        } else {
          irecv(sub, 0, {.consolidated = consolidated});
        }
        expect_rows(parent, c.picked, rows_of(rows, base));
        EXPECT_EQ(parent.get("a").tensor().data_ptr(), a_data);
        EXPECT_EQ(parent.get({"n", "c"}).tensor().data_ptr(), c_data);
      }
    }
  });
}

// Views that are not contiguous (a column of a 2-D batch) and an integer index (batch []).
TEST(DistSubTensorDict, NonContiguousRowsAndAnInteger) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      send(TensorDict({{"x", at::full({4, 3}, 7.0)}}, {4}), 1, {.init_tag = 5});
      send(TensorDict({{"x", at::full({2, 3}, 8.0)}}, {2}), 1, {.init_tag = 6});
      return;
    }
    TensorDict parent({{"x", at::zeros({4, 2, 3})}}, {4, 2});
    SubTensorDict column(parent, {Slice(), 1});
    ASSERT_TRUE(column.is_view());
    ASSERT_FALSE(column.view().get("x").tensor().is_contiguous());
    EXPECT_EQ(recv(column, 0, {.init_tag = 5}), 5);
    EXPECT_TRUE(parent.get("x").tensor().select(1, 1).eq(7).all().item<bool>());
    EXPECT_TRUE(parent.get("x").tensor().select(1, 0).eq(0).all().item<bool>());
    SubTensorDict row(parent, {3});
    EXPECT_EQ(row.batch_size(), at::IntArrayRef({2}));
    irecv(row, 0, {.init_tag = 6});
    EXPECT_TRUE(parent.get("x").tensor()[3].eq(8).all().item<bool>());
    EXPECT_TRUE(parent.get("x").tensor()[2].select(0, 1).eq(7).all().item<bool>());
  });
}

// Unbatched leaves travel per leaf like any other (in sorted key order), through send/recv,
// isend/irecv and all_reduce; a consolidated send refuses them before any message leaves.
TEST(DistUnbatched, PerLeafTransfersCarryThem) {
  run_ranks(2, [](int rank, int) {
    const auto make = [](double fill) {
      TensorDict n(
          {{"w", at::full({4, 2}, fill)}, {"v", Value::unbatched(at::full({5}, fill + 1))}}, {4});
      return TensorDict({{"u", Value::unbatched(at::full({2, 3}, fill + 2, at::kDouble))},
                         {"a", at::full({4}, fill + 3)},
                         {"n", n}},
                        {4});
    };
    const auto expect_filled = [](const TensorDict& td, double fill) {
      EXPECT_TRUE(td.get("u").is_unbatched());
      EXPECT_TRUE(td.get({"n", "v"}).is_unbatched());
      EXPECT_TRUE(td.get("u").tensor().eq(fill + 2).all().item<bool>());
      EXPECT_TRUE(td.get({"n", "v"}).tensor().eq(fill + 1).all().item<bool>());
      EXPECT_TRUE(td.get({"n", "w"}).tensor().eq(fill).all().item<bool>());
      EXPECT_TRUE(td.get("a").tensor().eq(fill + 3).all().item<bool>());
    };
    if (rank == 0) {
      send(make(1), 1);
      EXPECT_EQ(isend(make(2), 1, {.init_tag = 10}), 13);
      EXPECT_THROW_MSG(send(make(3), 1, {.consolidated = true}), c10::NotImplementedError,
                       "UnbatchedTensor entries cannot be consolidated yet, but 'u' is one.");
    } else {
      TensorDict td = make(0);
      const void* u_data = td.get("u").tensor().data_ptr();
      EXPECT_EQ(recv(td, 0), 3);  // four leaves: a, n.v, n.w, u
      expect_filled(td, 1);
      EXPECT_EQ(td.get("u").tensor().data_ptr(), u_data);  // in place
      irecv(td, 0, {.init_tag = 10});
      expect_filled(td, 2);
    }
    TensorDict mine = make(rank * 10.0);
    all_reduce(mine);
    // Leaf k holds f + k on each rank (f = 0 and 10): the sum is 10 + 2k, unbatched ones too.
    EXPECT_TRUE(mine.get("u").is_unbatched());
    EXPECT_TRUE(mine.get("u").tensor().eq(14).all().item<bool>());
    EXPECT_TRUE(mine.get({"n", "v"}).tensor().eq(12).all().item<bool>());
    EXPECT_TRUE(mine.get({"n", "w"}).tensor().eq(10).all().item<bool>());
    EXPECT_TRUE(mine.get("a").tensor().eq(16).all().item<bool>());
  });
}

// The weight-sync flow: rank 0 sends a module's parameters; rank 1 receives into the
// TensorDictParams of a live torch::nn::Linear, whose own Parameter tensors then hold them.
TEST(DistParams, WeightSyncIntoALiveModule) {
  run_ranks(2, [](int rank, int) {
    const auto weights = [](int step) {
      return std::make_pair(at::arange(12, at::kFloat).view({3, 4}) / 10 + step,
                            at::full({3}, -1.0f * step));
    };
    const at::Tensor x = at::arange(8, at::kFloat).view({2, 4});
    if (rank == 0) {
      torch::nn::Linear net(4, 3);
      const TensorDict td = from_module(*net);
      for (int step = 1; step <= 3; ++step) {
        const auto [w, b] = weights(step);
        {
          at::NoGradGuard no_grad;
          net->weight.copy_(w);
          net->bias.copy_(b);
        }
        if (step == 3) {
          send(consolidate(td), 1, {.consolidated = true});
        } else {
          send(td, 1, {.init_tag = step});
        }
      }
      return;
    }
    torch::nn::Linear net(4, 3);
    auto params = TensorDictParams::from_module(*net);
    const at::Tensor weight = net->weight;
    const auto* weight_impl = net->weight.unsafeGetTensorImpl();
    const void* weight_data = net->weight.data_ptr();
    const void* bias_data = net->bias.data_ptr();
    EXPECT_EQ(params->named_parameters()["weight"].unsafeGetTensorImpl(), weight_impl);
    for (int step = 1; step <= 3; ++step) {
      SCOPED_TRACE(step);
      if (step == 3) {
        // A consolidated message, through the whole parent as a SubTensorDict: received into
        // a consolidated copy, then written in place into the parameters.
        EXPECT_EQ(recv(SubTensorDict(params->params(), {}), 0, {.consolidated = true}),
                  std::nullopt);
      } else if (step == 2) {
        irecv(params->params(), 0, {.init_tag = step});
      } else {
        recv(params->params(), 0, {.init_tag = step});
      }
      const auto [w, b] = weights(step);
      // The module's own tensors: same TensorImpl, same memory, the new values.
      EXPECT_EQ(net->weight.unsafeGetTensorImpl(), weight_impl);
      EXPECT_EQ(net->weight.data_ptr(), weight_data);
      EXPECT_EQ(net->bias.data_ptr(), bias_data);
      EXPECT_TRUE(at::equal(net->weight, w));
      EXPECT_TRUE(at::equal(net->bias, b));
      EXPECT_TRUE(at::equal(weight, w));  // a handle taken before, as an optimizer holds
      EXPECT_TRUE(net->weight.requires_grad());
      const at::Tensor y = net->forward(x);
      EXPECT_TRUE(at::allclose(y, at::matmul(x, w.t()) + b)) << y;
      // Still trainable: a backward pass reaches the received parameters.
      y.sum().backward();
      ASSERT_TRUE(net->weight.grad().defined());
      EXPECT_TRUE(at::allclose(net->weight.grad(), x.sum(0).expand({3, 4})));
      net->zero_grad();
    }
  });
}

}  // namespace
}  // namespace tensordict::dist

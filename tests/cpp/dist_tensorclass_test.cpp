// Every transfer of a tensorclass, on real processes: point-to-point (per leaf, async,
// consolidated), init_remote / from_remote_init with the class name on the wire, the
// collectives over Gloo on 127.0.0.1, and the UCX pipe and server when built.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist_test_util.h"
#include "expect_throw.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/tensorclass.h"
#include "tensordict/tensorclass.h"

#ifdef TENSORDICT_WITH_PIPE
#include "pipe_test_util.h"
#include "tensordict/pipe/server.h"
#include "tensordict/pipe/tensorclass.h"
#endif

namespace {

using tensordict::TensorDict;
using tensordict::testing::error_of;
using tensordict::testing::run_ranks;
namespace dist = tensordict::dist;

TENSORDICT_TENSORCLASS(Inner, (at::Tensor, x), (int64_t, id));

// Named as a Python peer would name it ("<module>.<qualname>").
TENSORDICT_TENSORCLASS_NAMED(MyDistData, "__main__.MyDistData", (at::Tensor, obs),
                             (at::Tensor, reward), (std::string, label), (Inner, inner));

// The same fields under another name: a receiver of MyDistData must refuse it.
TENSORDICT_TENSORCLASS_NAMED(Other, "__main__.Other", (at::Tensor, obs), (at::Tensor, reward),
                             (std::string, label), (Inner, inner));

MyDistData sample(double fill, const std::string& label = "sent", int64_t id = 7) {
  return MyDistData(at::full({3, 2}, fill), at::full({3}, fill, at::kDouble), label,
                    Inner(at::full({3, 4}, fill, at::kLong), id, {3}), {3});
}

void expect_sample(const MyDistData& d, double fill, const std::string& label = "sent",
                   int64_t id = 7) {
  EXPECT_TRUE(at::equal(d.obs(), at::full({3, 2}, fill))) << d.obs();
  EXPECT_TRUE(at::equal(d.reward(), at::full({3}, fill, at::kDouble))) << d.reward();
  EXPECT_TRUE(at::equal(d.inner().x(), at::full({3, 4}, fill, at::kLong))) << d.inner().x();
  EXPECT_EQ(d.label(), label);
  EXPECT_EQ(d.inner().id(), id);
  EXPECT_EQ(d.batch_size(), at::IntArrayRef({3}));
}

// Writes `value` into every tensor field, in place.
void fill(const MyDistData& d, double value) {
  d.obs().fill_(value);
  d.reward().fill_(value);
  d.inner().x().fill_(value);
}

// Blocks until every rank of the default group reaches it.
void barrier() { dist::all_reduce(TensorDict({{"b", at::zeros({1})}}, {})); }

// A plain TensorDict with MyDistData's fields (what a sender that is not a tensorclass sends).
TensorDict plain(double fill, bool with_label = true) {
  TensorDict inner({{"x", at::full({3, 4}, fill, at::kLong)}}, {3});
  inner.set_non_tensor("id", 7);
  TensorDict td({{"obs", at::full({3, 2}, fill)}, {"reward", at::full({3}, fill, at::kDouble)}},
                {3});
  if (with_label) td.set_non_tensor("label", "sent");
  td.set("inner", inner);
  return td;
}

// send / recv / isend / irecv take a tensorclass as a TensorDict. Per leaf and consolidated,
// only tensors travel: the receiver keeps its own non-tensor values, as with the reference.
TEST(DistTensorClass, PointToPoint) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      dist::send(sample(1), 1);
      dist::send(sample(2), 1, {.init_tag = 5, .pseudo_rand = true});
      EXPECT_EQ(dist::isend(sample(3), 1), 2);  // three leaves: tags 0, 1, 2
      for (auto& w : dist::isend_early(sample(4), 1, {.init_tag = 9})) w->wait();
      dist::send(sample(5), 1, {.consolidated = true});
      dist::send(tensordict::consolidate(sample(6)), 1, {.consolidated = true});
      dist::send(sample(7), 1, {.checked = true});
    } else {
      MyDistData d = sample(0, "mine", 1);
      EXPECT_EQ(dist::recv(d, 0), 2);
      expect_sample(d, 1, "mine", 1);
      dist::recv(d, 0, {.init_tag = 5, .pseudo_rand = true});
      expect_sample(d, 2, "mine", 1);
      dist::irecv(d, 0);
      expect_sample(d, 3, "mine", 1);
      for (auto& w : dist::irecv_premature(d, 0, {.init_tag = 9})) w->wait();
      expect_sample(d, 4, "mine", 1);
      MyDistData c = tensordict::consolidate(sample(0, "mine", 1));
      for (double fill : {5.0, 6.0}) {
        dist::recv(c, 0, {.consolidated = true});
        expect_sample(c, fill, "mine", 1);
      }
      dist::recv(d, 0, {.checked = true});
      expect_sample(d, 7, "mine", 1);
    }
  });
}

// init_remote sends the class name; from_remote_init<T> checks it and returns a T whose
// storage later consolidated sends land in. Point-to-point and in broadcast mode.
TEST(DistTensorClass, InitRemoteThenSteadyState) {
  run_ranks(2, [](int rank, int) {
    for (bool use_broadcast : {false, true}) {
      SCOPED_TRACE(c10::str("use_broadcast ", use_broadcast));
      if (rank == 0) {
        MyDistData sent =
            dist::init_remote(sample(1, "first", 3), 1, {.use_broadcast = use_broadcast});
        EXPECT_TRUE(tensordict::is_consolidated(sent));
        EXPECT_EQ(sent.label(), "first");
        for (int step = 2; step < 5; ++step) {
          fill(sent, step);  // writes into the storage
          dist::send(sent, 1, {.consolidated = true});
        }
      } else {
        MyDistData got = dist::from_remote_init<MyDistData>(0, {.use_broadcast = use_broadcast});
        EXPECT_TRUE(tensordict::is_consolidated(got));
        expect_sample(got, 1, "first", 3);
        const void* storage = tensordict::consolidated_storage(got).data_ptr();
        for (int step = 2; step < 5; ++step) {
          dist::recv(got, 0, {.consolidated = true});
          EXPECT_EQ(tensordict::consolidated_storage(got).data_ptr(), storage);
          expect_sample(got, step, "first", 3);
        }
      }
    }
    // The wire carries the Python-visible name, as the reference's tensorclass sends it.
    if (rank == 0) {
      dist::init_remote(sample(8), 1);
    } else {
      std::optional<std::string> type;
      TensorDict td = dist::from_remote_init(0, {}, &type);
      EXPECT_EQ(type, std::optional<std::string>("__main__.MyDistData"));
      expect_sample(MyDistData::from_tensordict(td), 8);
    }
  });
}

// A receiver refuses another tensorclass (TypeError naming both) and a TensorDict whose fields
// do not validate (ValueError naming the field); it accepts a plain TensorDict that has the
// fields. The sender completes in every case.
TEST(DistTensorClass, FromRemoteInitChecksTheClass) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      dist::init_remote(Other(at::zeros({3, 2}), at::zeros({3}, at::kDouble), "o",
                              Inner(at::zeros({3, 4}, at::kLong), 7, {3}), {3}),
                        1);
      dist::init_remote(plain(4), 1);
      dist::init_remote(plain(5, /*with_label=*/false), 1);
      // The class name can be set by hand (e.g. for a TensorDict standing for a tensorclass).
      dist::init_remote(plain(6), 1, {.tensorclass_type = "__main__.MyDistData"});
      dist::init_remote(plain(6), 1, {.tensorclass_type = "__main__.Else"});
    } else {
      EXPECT_THROW_MSG(dist::from_remote_init<MyDistData>(0), c10::TypeError,
                       "from_remote_init: the sender's tensorclass is '__main__.Other' but the "
                       "receiver expects '__main__.MyDistData'");
      expect_sample(dist::from_remote_init<MyDistData>(0), 4);
      EXPECT_THROW_MSG(dist::from_remote_init<MyDistData>(0), c10::ValueError,
                       "from_remote_init: field 'label' of __main__.MyDistData is missing");
      expect_sample(dist::from_remote_init<MyDistData>(0), 6);
      EXPECT_THROW_MSG(dist::from_remote_init<MyDistData>(0), c10::TypeError,
                       "'__main__.Else' but the receiver expects '__main__.MyDistData'");
    }
  });
}

// broadcast, all_gather and scatter return tensorclasses. Three ranks, non-zero roots, and a
// subgroup.
TEST(DistTensorClass, CollectivesThreeRanks) {
  run_ranks(3, [](int rank, int) {
    auto label = [](int r) { return c10::str("rank", r); };
    {
      MyDistData got = dist::broadcast(rank == 2 ? sample(2, "b", 11) : MyDistData{}, 2);
      expect_sample(got, 2, "b", 11);
      EXPECT_TRUE(tensordict::is_consolidated(got));
    }
    {
      // A source of another class: the receivers refuse it after the transfer.
      Other other(at::zeros({3, 2}), at::zeros({3}, at::kDouble), "o",
                  Inner(at::zeros({3, 4}, at::kLong), 7, {3}), {3});
      if (rank == 1) {
        EXPECT_EQ(dist::broadcast(other, 1).label(), "o");
      } else {
        EXPECT_THROW_MSG(dist::broadcast(MyDistData{}, 1), c10::TypeError,
                         "broadcast: the sender's tensorclass is '__main__.Other'");
      }
    }
    {
      // init_remote(use_broadcast) reaches every other rank with the class name.
      if (rank == 1) {
        dist::init_remote(sample(3), std::nullopt, {.use_broadcast = true});
      } else {
        expect_sample(dist::from_remote_init<MyDistData>(1, {.use_broadcast = true}), 3);
      }
    }
    {
      auto all = dist::all_gather(sample(10 + rank, label(rank), rank));
      ASSERT_EQ(all.size(), 3u);
      for (int r = 0; r < 3; ++r) expect_sample(all[r], 10 + r, label(r), r);
    }
    {
      std::vector<MyDistData> parts;
      if (rank == 1) {
        for (int r = 0; r < 3; ++r) parts.push_back(sample(20 + r, label(r), r));
      }
      MyDistData mine = dist::scatter(1, parts);
      expect_sample(mine, 20 + rank, label(rank), rank);
      // Receivers may name the type and pass nothing.
      if (rank == 1) {
        dist::scatter(1, parts);
      } else {
        expect_sample(dist::scatter<MyDistData>(1, {}), 20 + rank, label(rank), rank);
      }
    }
    // On a subgroup, by group rank.
    auto sub = dist::new_group({1, 2});
    if (rank == 0) return;
    MyDistData got = dist::broadcast(rank == 2 ? sample(30) : MyDistData{}, std::nullopt,
                                     {.group = sub, .group_src = 1});
    expect_sample(got, 30);
    auto all = dist::all_gather(sample(40 + rank), {.group = sub});
    ASSERT_EQ(all.size(), 2u);
    expect_sample(all[1], 42);
  });
}

// all_reduce and reduce take a tensorclass as a TensorDict; non-tensor fields are skipped.
TEST(DistTensorClass, Reductions) {
  run_ranks(3, [](int rank, int) {
    const std::string label = c10::str("rank", rank);
    MyDistData d = sample(rank + 1, label);
    dist::all_reduce(d);
    expect_sample(d, 6, label);  // 1 + 2 + 3; the labels stay
    for (auto& w : dist::all_reduce_async(d, {.op = c10d::ReduceOp::MAX})) w->wait();
    expect_sample(d, 6, label);
    MyDistData e = sample(rank + 1, label);
    dist::reduce(e, 0, {.op = c10d::ReduceOp::MAX});
    if (rank == 0) expect_sample(e, 3, label);
  });
}

#ifdef TENSORDICT_WITH_PIPE
using tensordict::pipe::Pipe;
using tensordict::pipe::TensorDictServer;

// The listener's port, from rank 0 to every rank.
int share_port(int rank, int port) {
  TensorDict td({{"port", at::tensor(static_cast<int64_t>(rank == 0 ? port : 0))}}, {});
  return static_cast<int>(dist::broadcast(td, 0).get("port").tensor().item<int64_t>());
}

// A pipe between two processes: a new label is a new schema (the metadata travels again); the
// same schema lands in the previous result's storage.
TEST(DistTensorClass, PipeSendRecv) {
  run_ranks(2, [](int rank, int) {
    if (rank == 0) {
      Pipe p = Pipe::listen(0, "127.0.0.1", pipe_test::fast_options());
      share_port(rank, p.port());
      MyDistData a = tensordict::pipe::recv<MyDistData>(p);
      expect_sample(a, 1, "one");
      MyDistData b = tensordict::pipe::recv<MyDistData>(p, a);
      expect_sample(b, 2, "one");
      EXPECT_TRUE(b.td().is_same(a.td()));  // same schema: received in place
      MyDistData c = tensordict::pipe::recv<MyDistData>(p);
      expect_sample(c, 3, "two");  // the label changed: a new schema
      EXPECT_NE(error_of([&] {
                  tensordict::pipe::recv<MyDistData>(p);
                }).find("Pipe::recv: field 'label' of __main__.MyDistData is missing"),
                std::string::npos);
      p.send(sample(4, "back"));
      p.close();
    } else {
      Pipe p = Pipe::connect("127.0.0.1", share_port(rank, 0), pipe_test::fast_options());
      p.send(sample(1, "one"));
      p.send(sample(2, "one"));
      p.send(sample(3, "two"));
      p.send(plain(0, /*with_label=*/false));
      expect_sample(tensordict::pipe::recv<MyDistData>(p), 4, "back");
      p.close();
    }
  });
}

// A server in one process answers clients of another, each handler receiving tensorclasses.
TEST(DistTensorClass, Server) {
  run_ranks(2, [](int rank, int) {
    constexpr int kClients = 3;
    if (rank == 0) {
      TensorDictServer server(0, "127.0.0.1", pipe_test::fast_options());
      server.serve([](Pipe& p) {
        MyDistData d = tensordict::pipe::recv<MyDistData>(p);
        d.set_obs(d.obs() + 100).set_label(d.label() + "!");
        p.send(d);
      });
      share_port(rank, server.port());
      barrier();
      server.close();
      EXPECT_TRUE(server.handler_errors().empty());
      EXPECT_EQ(server.clients(), kClients);
    } else {
      const int port = share_port(rank, 0);
      for (int c = 0; c < kClients; ++c) {
        Pipe p = Pipe::connect("127.0.0.1", port, pipe_test::fast_options());
        p.send(sample(c, c10::str("client", c)));
        MyDistData reply = tensordict::pipe::recv<MyDistData>(p);
        EXPECT_TRUE(at::equal(reply.obs(), at::full({3, 2}, c + 100.0)));
        EXPECT_EQ(reply.label(), c10::str("client", c, "!"));
        p.close();
      }
      barrier();
    }
  });
}
#endif

}  // namespace

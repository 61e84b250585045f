// TensorDictServer over real UCX on loopback: many concurrent clients, each one's data
// verified, and a close() that leaves no thread, file descriptor or listener behind.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "pipe_test_util.h"
#include "tensordict/pipe/server.h"

using namespace tensordict;
using namespace pipe_test;
using tensordict::pipe::Pipe;
using tensordict::pipe::TensorDictServer;

namespace {

// Replies to each received TensorDict with its "id" leaf plus 1000, until the client leaves.
void echo_plus_1000(Pipe& pipe) {
  for (;;) {
    TensorDict td = pipe.recv();
    const at::Tensor id = td.get("id").tensor();
    pipe.send(TensorDict({{"id", id + 1000}, {"payload", td.get("payload").tensor()}}, {}));
  }
}

TEST(TensorDictServer, EightConcurrentClientsAndACleanClose) {
  Watchdog dog(120s);
  {  // warm-up: UCX's process-wide state (its async thread, config) is created once
    TensorDictServer warm(0, "127.0.0.1", fast_options());
    Pipe c = Pipe::connect("127.0.0.1", warm.port(), fast_options());
  }
  const int fds_before = open_fds();
  const int threads_before = threads();
  {
    TensorDictServer server(0, "127.0.0.1", fast_options());
    ASSERT_GT(server.port(), 0);
    server.serve(echo_plus_1000);
    constexpr int kClients = 8, kRounds = 5;
    std::atomic<int> verified{0};
    std::vector<std::thread> clients;
    for (int id = 0; id < kClients; ++id) {
      clients.emplace_back([&, id] {
        Pipe pipe = Pipe::connect("127.0.0.1", server.port(), fast_options());
        for (int r = 0; r < kRounds; ++r) {
          const at::Tensor payload = at::full({64, 16}, static_cast<float>(id * 100 + r));
          pipe.send(
              TensorDict({{"id", at::tensor(static_cast<int64_t>(id))}, {"payload", payload}}, {}));
          TensorDict reply = pipe.recv();
          if (reply.get("id").tensor().item<int64_t>() == id + 1000 &&
              at::equal(reply.get("payload").tensor(), payload)) {
            ++verified;
          }
        }
        pipe.close();
      });
    }
    for (auto& t : clients) t.join();
    EXPECT_EQ(verified.load(), kClients * kRounds);
    EXPECT_EQ(server.clients(), kClients);
    server.close();
    // The handlers ended because their clients left: those are real errors to report.
    for (const auto& err : server.handler_errors()) {
      try {
        std::rethrow_exception(err);
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what_without_backtrace()).find("recv"), std::string::npos)
            << e.what_without_backtrace();
      }
    }
  }
  EXPECT_EQ(open_fds(), fds_before);
  EXPECT_EQ(threads(), threads_before);
}

TEST(TensorDictServer, CloseUnblocksHandlersWaitingOnIdleClients) {
  Watchdog dog(60s);
  TensorDictServer server(0, "127.0.0.1", fast_options());
  std::atomic<int> entered{0};
  server.serve([&](Pipe& p) {
    ++entered;
    p.recv();  // the client never sends
  });
  std::vector<Pipe> idle;
  for (int i = 0; i < 3; ++i)
    idle.push_back(Pipe::connect("127.0.0.1", server.port(), fast_options()));
  while (entered.load() < 3) std::this_thread::sleep_for(10ms);
  const auto start = std::chrono::steady_clock::now();
  server.close();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 8s);
  EXPECT_TRUE(server.handler_errors().empty());  // errors caused by close() are not reported
  for (auto& p : idle) p.close();
}

TEST(TensorDictServer, AcceptOneAtATime) {
  Watchdog dog(60s);
  TensorDictServer server(0, "127.0.0.1", fast_options());
  EXPECT_FALSE(server.accept(100ms).has_value());  // nobody yet: bounded, no hang
  Pipe c1 = Pipe::connect("127.0.0.1", server.port(), fast_options());
  Pipe c2 = Pipe::connect("127.0.0.1", server.port(), fast_options());
  auto p1 = server.accept();
  auto p2 = server.accept();
  ASSERT_TRUE(p1 && p2);
  c1.send(worked_example(1));
  c2.send(worked_example(2));
  // Each accepted pipe carries its own client's stream (accept order = connection order, which
  // the two connects above do not fix): check both land, one each.
  const float v1 = p1->recv().get("a").tensor()[0].item<float>();
  const float v2 = p2->recv().get("a").tensor()[0].item<float>();
  EXPECT_EQ(v1 + v2, 3.0f);
  EXPECT_NE(v1, v2);
  server.close();
  EXPECT_THROW(p1->recv(), c10::Error);  // close() closed the pipes it handed out
  EXPECT_THROW(server.accept(), c10::Error);
}

TEST(TensorDictServer, ListeningPipeRejectsASecondClient) {
  Watchdog dog(60s);
  tensordict::pipe::PipeOptions o = fast_options();
  o.timeout = 3s;
  Pipe server = Pipe::listen(0, "127.0.0.1", o);
  Pipe first = Pipe::connect("127.0.0.1", server.port(), o);
  server.accept();
  EXPECT_THROW(Pipe::connect("127.0.0.1", server.port(), o), c10::Error);
  first.send(worked_example(7));
  expect_same(worked_example(7), server.recv());
}

}  // namespace

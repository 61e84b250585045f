// TensorDictPipe over real UCX on loopback: the framing byte for byte (docs/wire-format.md §6.1),
// the steady state without allocation, the uncollated mode, and every error path bounded in
// time. The pipes of a test live in one process (one or two threads).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include "core/testing.h"
#include "pipe_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/transfer_stats.h"
#include "wire/pipe_frames.h"

using namespace tensordict;
using namespace pipe_test;
using tensordict::pipe::Pipe;
using tensordict::pipe::PipeOptions;

namespace {

// The metadata message of worked_example() as the reference 0.15.3 sends it: insertion
// order, the transport keys last (docs/wire-format.md §6.1).
const char* kWorkedExampleWire =
    R"({"cls": "TensorDict", "non_tensors": {}, "leaves": {"a": ["torch.float32", [4], 0, 16, 0], "b": ["torch.float32", [4, 3], 16, 64, 0]}, "cls_metadata": {"device": null, "names": [null], "batch_size": [4], "is_locked": false}, "c": {"cls": "TensorDict", "non_tensors": {}, "leaves": {"d": ["torch.int64", [4], 64, 96, 0]}, "cls_metadata": {"device": null, "names": [null], "batch_size": [4], "is_locked": false}}, "_total_bytes": 96, "_device": "cpu"})";

// The same, sorted: the 449-byte line of docs/wire-format.md §3.4 (0.14's order, which
// receivers read alike), edited below into malformed messages.
const char* kWorkedExampleJson =
    R"({"_device": "cpu", "_total_bytes": 96, "c": {"cls": "TensorDict", "cls_metadata": {"batch_size": [4], "device": null, "is_locked": false, "names": [null]}, "leaves": {"d": ["torch.int64", [4], 64, 96, 0]}, "non_tensors": {}}, "cls": "TensorDict", "cls_metadata": {"batch_size": [4], "device": null, "is_locked": false, "names": [null]}, "leaves": {"a": ["torch.float32", [4], 0, 16, 0], "b": ["torch.float32", [4, 3], 16, 64, 0]}, "non_tensors": {}})";

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

std::pair<Pipe, Pipe> pair_of(PipeOptions server_options = fast_options(),
                              PipeOptions client_options = fast_options()) {
  Pipe server = Pipe::listen(0, "127.0.0.1", server_options);
  Pipe client = Pipe::connect("127.0.0.1", server.port(), client_options);
  return {server, client};
}

// Each transport list runs the data-path tests: tcp alone, and with shared memory (sockaddr
// connection establishment always goes through tcp).
class PipeTransport : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const char* old = std::getenv("UCX_TLS");
    saved_ = old ? old : "";
    had_ = old != nullptr;
    setenv("UCX_TLS", GetParam(), 1);
  }
  void TearDown() override {
    if (had_) {
      setenv("UCX_TLS", saved_.c_str(), 1);
    } else {
      unsetenv("UCX_TLS");
    }
  }
  std::string saved_;
  bool had_ = false;
};

TEST_P(PipeTransport, OneThreadListensConnectsAndExchanges) {
  Watchdog dog(60s);
  Pipe server = Pipe::listen(0, "127.0.0.1", fast_options());  // returns without a client
  ASSERT_GT(server.port(), 0);
  Pipe client = Pipe::connect("127.0.0.1", server.port(), fast_options());
  const TensorDict td = worked_example();  // not consolidated: the pipe consolidates it
  client.send(td);
  TensorDict got = server.recv();
  expect_same(td, got);
  EXPECT_TRUE(is_consolidated(got));
  // And the other direction on the same pipes.
  server.send(worked_example(5));
  expect_same(worked_example(5), client.recv());
}

TEST_P(PipeTransport, TwoThreadsStream) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  constexpr int kCount = 50;
  std::thread producer([&, c = client] {
    Pipe p = c;
    for (int i = 0; i < kCount; ++i) p.send(worked_example(static_cast<float>(i)));
  });
  for (int i = 0; i < kCount; ++i) {
    TensorDict got = server.recv();
    ASSERT_EQ(got.get("a").tensor()[0].item<float>(), static_cast<float>(i));
    ASSERT_EQ(got.get({"c", "d"}).tensor()[3].item<int64_t>(), 3 + i);
  }
  producer.join();
  EXPECT_EQ(server.stats().schema_recvs, 1);
  EXPECT_EQ(client.stats().schema_sends, 1);
}

TEST_P(PipeTransport, SteadyStateReusesTheSameStorage) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  TensorDict src = consolidate(worked_example());
  client.send(src);
  TensorDict first = server.recv();
  const void* storage_ptr = consolidated_storage(first).data_ptr();
  const void* leaf_ptr = first.get("b").tensor().data_ptr();
  for (int i = 1; i <= 5; ++i) {
    // Update the sender's consolidated leaves in place: the metadata object stays the same.
    src.get("a").tensor().fill_(static_cast<float>(10 * i));
    src.get({"c", "d"}).tensor().fill_(i);
    client.send(src);
    TensorDict got = server.recv();
    EXPECT_TRUE(got.is_same(first));
    EXPECT_EQ(consolidated_storage(got).data_ptr(), storage_ptr);
    EXPECT_EQ(got.get("b").tensor().data_ptr(), leaf_ptr);
    EXPECT_TRUE(at::all(got.get("a").tensor() == 10.0f * i).item<bool>());
    EXPECT_TRUE(at::all(got.get({"c", "d"}).tensor() == i).item<int64_t>());
  }
  // Passing the previous result explicitly lands in it too.
  client.send(src);
  TensorDict again = server.recv(first);
  EXPECT_TRUE(again.is_same(first));
  EXPECT_EQ(server.stats().schema_recvs, 1);
  EXPECT_EQ(client.stats().schema_sends, 1);
  EXPECT_EQ(client.stats().sends, 7);
}

TEST_P(PipeTransport, NestedManyDtypesZeroDimAndEmpty) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  TensorDict deepest(
      {{"empty", at::empty({2, 0}, at::kFloat)}, {"b", at::tensor({1, 0}).to(at::kBool)}}, {2});
  TensorDict mid({{"bf16", at::randn({2, 5}).to(at::kBFloat16)},
                  {"deeper", deepest},
                  {"i8", at::randint(-100, 100, {2, 3}, at::kChar)}},
                 {2});
  // complex128 first: consolidate's offsets are only 8-aligned, and a view needs 16 (§7.10).
  TensorDict td({{"c128", at::randn({2, 3}, at::kComplexDouble)},
                 {"f32", at::randn({2, 7})},
                 {"f64", at::randn({2})},
                 {"f16", at::randn({2, 3}).to(at::kHalf)},
                 {"i16", at::randint(-1000, 1000, {2, 1}, at::kShort)},
                 {"i32", at::randint(0, 1 << 30, {2, 2}, at::kInt)},
                 {"i64", at::randint(0, 1LL << 40, {2}, at::kLong)},
                 {"u8", at::randint(0, 255, {2, 9}, at::kByte)},
                 {"c64", at::randn({2, 2}, at::kComplexFloat)},
                 {"mid", mid}},
                {2});
  client.send(td);
  expect_same(td, server.recv());
  // A 0-dim leaf needs batch_size [].
  TensorDict scalar({{"x", at::scalar_tensor(3.5, at::kDouble)},
                     {"y", at::scalar_tensor(7, at::kShort)},
                     {"z", at::empty({0}, at::kLong)}});
  client.send(scalar);
  TensorDict got = server.recv();
  expect_same(scalar, got);
  EXPECT_EQ(got.get("x").tensor().dim(), 0);
  // An empty TensorDict: metadata only, a 0-byte storage.
  client.send(TensorDict());
  EXPECT_TRUE(server.recv().entries().empty());
  EXPECT_EQ(server.stats().schema_recvs, 3);
}

INSTANTIATE_TEST_SUITE_P(Transports, PipeTransport, ::testing::Values("tcp", "tcp,sm,self"),
                         [](const auto& info) {
                           return std::string(info.param) == "tcp" ? "tcp" : "tcp_sm";
                         });

TEST(Pipe, FramingIsTheReferencesByteForByte) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  const TensorDict src = consolidate(worked_example());
  client.send(src);
  EXPECT_EQ(server.recv_raw(TestKey{}, 1), std::string(1, '\x00'));
  const std::string json = kWorkedExampleWire;
  ASSERT_EQ(json.size(), 449u);
  EXPECT_EQ(server.recv_raw(TestKey{}, 8), u64_le(449));
  EXPECT_EQ(server.recv_raw(TestKey{}, 449), json);
  const at::Tensor storage = consolidated_storage(src);
  EXPECT_EQ(server.recv_raw(TestKey{}, 96),
            std::string(static_cast<const char*>(storage.const_data_ptr()), 96));
  // Same schema: 0x01, then the storage only; between peers of ours in one message (the
  // joined frame of §6.8), since the storage is small. The reference's two messages are
  // checked against the real reference in tests/python/test_pipe_interop.py.
  client.send(src);
  std::string joined(1, '\x01');
  joined.append(static_cast<const char*>(storage.const_data_ptr()), 96);
  EXPECT_EQ(server.recv_raw(TestKey{}, 97), joined);
  EXPECT_EQ(client.stats().bytes_sent, 1 + 8 + 449 + 96 + 1 + 96);
}

// Joined frames (docs/wire-format.md §6.8): a same-schema storage of at most kMaxJoinedStorage
// bytes rides with its flag byte; a larger one is the reference's two messages.
TEST(Pipe, OnlySmallSameSchemaStoragesAreJoined) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  EXPECT_TRUE(client.peer_is_tensordict_cpp());
  for (const int64_t n : {wire::frames::kMaxJoinedStorage, wire::frames::kMaxJoinedStorage + 1}) {
    const TensorDict td = consolidate(TensorDict({{"x", at::full({n}, 7, at::kByte)}}));
    const at::Tensor storage = consolidated_storage(td);
    const auto bytes = static_cast<size_t>(storage.numel());  // n, or padded to 8 past it
    ASSERT_GE(bytes, static_cast<size_t>(n));
    const std::string expected(static_cast<const char*>(storage.const_data_ptr()), bytes);
    client.send(td);
    expect_same(td, server.recv());  // the new schema
    client.send(td);
    if (n <= wire::frames::kMaxJoinedStorage) {
      EXPECT_EQ(server.recv_raw(TestKey{}, 1 + bytes), '\x01' + expected);
    } else {
      EXPECT_EQ(server.recv_raw(TestKey{}, 1), "\x01");
      EXPECT_EQ(server.recv_raw(TestKey{}, bytes), expected);
    }
  }
}

TEST(Pipe, AJoinedReceiveTakesTheTwoMessageFormAndRefusesAJoinedNewSchemaFlag) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  TensorDict td = consolidate(TensorDict({{"x", at::arange(4, at::kFloat)}}));
  client.send(td);
  TensorDict got = server.recv();
  // A peer of ours may still send the flag byte alone, then the storage (the reference's form):
  // it lands in the same TensorDict.
  const at::Tensor next = at::arange(10, 14, at::kFloat);
  client.send_raw(TestKey{}, "\x01", 1);
  client.send_raw(TestKey{}, next.const_data_ptr(), 16);
  TensorDict again = server.recv();
  EXPECT_TRUE(again.is_same(got));
  EXPECT_TRUE(at::equal(again.get("x").tensor(), next));
  // Only the same-schema flag carries a storage.
  std::string bad(17, '\0');
  client.send_raw(TestKey{}, bad.data(), bad.size());
  EXPECT_THROW_MSG(server.recv(), c10::Error, "joined a storage to the flag 0");
}

// Durations are counted in the CPU's time-stamp counter where it is invariant
// (transfer_stats.h): what transfer_stats() reports must still be nanoseconds.
TEST(Pipe, TransferTimesAreCountedInNanoseconds) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  reset_transfer_stats();
  const auto t0 = std::chrono::steady_clock::now();
  std::thread sender([&client] {
    std::this_thread::sleep_for(50ms);
    client.send(worked_example());
  });
  server.recv();  // waits for the sender's 50 ms
  sender.join();
  const int64_t wall =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  const TransferStats s = transfer_stats(Channel::kPipe);
  EXPECT_EQ(s.transfers, 2);
  EXPECT_GE(s.nanoseconds, 45'000'000);
  EXPECT_LE(s.nanoseconds, 2 * wall);  // two calls, each within the wall time
}

TEST(Pipe, AJoinedReceiveRefusesAnyOtherLength) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.send(consolidate(TensorDict({{"x", at::arange(4, at::kFloat)}})));
  server.recv();
  const std::string eight(9, '\x01');  // neither 1 nor 1 + 16 bytes
  client.send_raw(TestKey{}, eight.data(), eight.size());
  EXPECT_THROW_MSG(server.recv(), c10::Error, "sent a message of 9 bytes where 1 or 17 were");
}

TEST(Pipe, SchemaChangeResendsMetadata) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  const TensorDict a = worked_example();
  const TensorDict b({{"x", at::arange(6, at::kInt).view({2, 3})}}, {2});
  // A non-consolidated TensorDict is consolidated on each send, into a new metadata object
  // with the same text: still the same schema.
  for (const TensorDict* td : {&a, &a, &b, &b, &a}) {
    client.send(*td);
    expect_same(*td, server.recv());
  }
  EXPECT_EQ(client.stats().schema_sends, 3);
  EXPECT_EQ(server.stats().schema_recvs, 3);
  EXPECT_EQ(server.stats().recvs, 5);
  // A batch-size change with the same leaves is a schema change too.
  client.send(a.reshape({2, 2}));
  expect_same(a.reshape({2, 2}), server.recv());
  EXPECT_EQ(client.stats().schema_sends, 4);
}

TEST(Pipe, UncollatedMode) {
  Watchdog dog(60s);
  auto [server, client] = pair_of(fast_options(false), fast_options(false));
  TensorDict td({{"z", at::randn({3, 2})},
                 {"a", TensorDict({{"k", at::arange(3, at::kLong)},
                                   {"b", at::tensor({1, 0, 1}).to(at::kBool)}},
                                  {3})},
                 {"s", at::randn({3}).to(at::kDouble)}},
                {3});
  client.send(td);
  TensorDict first = server.recv();
  expect_same(td, first);
  EXPECT_FALSE(is_consolidated(first));
  client.send(td);
  TensorDict second = server.recv();
  EXPECT_FALSE(second.is_same(first));  // a new TensorDict every time, as the reference's
  expect_same(td, second);
  // 0-dim leaves with element size > 1 (the reference's §6.5.9 bug) and empty leaves.
  TensorDict scalar({{"x", at::scalar_tensor(2.5, at::kDouble)}, {"e", at::empty({0, 4})}});
  client.send(scalar);
  expect_same(scalar, server.recv());
}

TEST(Pipe, UncollatedHeaderIsThePythonOne) {
  Watchdog dog(60s);
  auto [server, client] = pair_of(fast_options(false), fast_options(false));
  TensorDict td(
      {{"b", at::zeros({2}, at::kLong)}, {"a", TensorDict({{"y", at::ones({2, 1})}}, {2})}}, {2});
  client.send(td);
  const std::string header =
      R"({"keys": [["a", "y"], "b"], "dtypes": ["torch.float32", "torch.int64"], "shapes": [[2, 1], [2]], "batch_size": [2], "unbatched": [], "non_tensors": []})";
  EXPECT_EQ(server.recv_raw(TestKey{}, 8), u64_le(header.size()));
  EXPECT_EQ(server.recv_raw(TestKey{}, header.size()), header);
  EXPECT_EQ(server.recv_raw(TestKey{}, 8).size(), 8u);    // ("a", "y"): one message per leaf
  EXPECT_EQ(server.recv_raw(TestKey{}, 16).size(), 16u);  // "b"
}

namespace {

// Non-tensor entries at three levels, with every kind of JSON-like data.
TensorDict with_non_tensors(float offset = 0) {
  TensorDict td = worked_example(offset);
  td.set_non_tensor("label", "cat \xc3\xa9");
  td.set_non_tensor({"c", "cfg"}, JsonValue::map({{"lr", 1e-07},
                                                  {"nan", std::nan("")},
                                                  {"l", JsonValue::list({1, nullptr, true})}}));
  td.set_non_tensor({"c", "e", "id"}, static_cast<int64_t>(offset));
  td.set_non_tensor("none", nullptr);
  return td;
}

}  // namespace

TEST(Pipe, NonTensorEntriesInBothModes) {
  Watchdog dog(60s);
  for (bool consolidated : {true, false}) {
    SCOPED_TRACE(consolidated);
    auto [server, client] = pair_of(fast_options(consolidated), fast_options(consolidated));
    client.send(with_non_tensors());
    TensorDict got = server.recv();
    expect_same(with_non_tensors(), got);
    EXPECT_TRUE(std::isnan(got.get_non_tensor({"c", "cfg"}).at("nan").as_float()));
    EXPECT_EQ(got.get({"c", "e", "id"}).non_tensor().batch_size(), at::IntArrayRef({4}));
    // A changed value is a new schema in the consolidated mode (the hash covers the data).
    client.send(with_non_tensors(1));
    expect_same(with_non_tensors(1), server.recv());
    if (consolidated) {
      EXPECT_EQ(server.stats().schema_recvs, 2);
    }
  }
}

TEST(Pipe, UncollatedHeaderWithNonTensorsIsThePythonOne) {
  Watchdog dog(60s);
  auto [server, client] = pair_of(fast_options(false), fast_options(false));
  TensorDict td({{"b", at::zeros({2}, at::kLong)}}, {2});
  td.set_non_tensor("z", "last");
  td.set_non_tensor({"a", "s"}, JsonValue::map({{"k", JsonValue::list({1.0, nullptr})}}));
  td.set({"a", "y"}, at::ones({2, 1}));
  client.send(td);
  // tests/python/test_non_tensor.py checks this line against the reference's sender.
  const std::string header =
      R"({"keys": [["a", "y"], "b"], "dtypes": ["torch.float32", "torch.int64"], "shapes": [[2, 1], [2]], "batch_size": [2], "unbatched": [], "non_tensors": [[["a", "s"], {"k": [1.0, null]}], ["z", "last"]]})";
  EXPECT_EQ(server.recv_raw(TestKey{}, 8), u64_le(header.size()));
  EXPECT_EQ(server.recv_raw(TestKey{}, header.size()), header);
  EXPECT_EQ(server.recv_raw(TestKey{}, 8).size(), 8u);    // ("a", "y"): one message per leaf
  EXPECT_EQ(server.recv_raw(TestKey{}, 16).size(), 16u);  // "b"
}

TEST(Pipe, SendsAlreadyConsolidatedAndReceivesIntoAGivenTarget) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  const TensorDict src = consolidate(worked_example(1));
  client.send(src);
  TensorDict first = server.recv();
  // A copy with the same layout, received into explicitly on the next same-schema message.
  TensorDict target = consolidate(worked_example(0).clone());
  client.send(src);
  TensorDict got = server.recv(target);
  EXPECT_TRUE(got.is_same(target));
  expect_same(src, got);
}

// A same-schema storage lands in the target's memory behind autograd's back: its leaves'
// version counters move, so a graph that saved one raises instead of using the new values.
TEST(Pipe, AnInPlaceReceiveBumpsTheLeavesVersions) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  const TensorDict src = consolidate(worked_example(1));
  client.send(src);
  TensorDict target = server.recv();
  const auto a = target.get("a").tensor()._version();
  const auto d = target.get({"c", "d"}).tensor()._version();
  client.send(src);
  server.recv(target);
  EXPECT_GT(target.get("a").tensor()._version(), a);
  EXPECT_GT(target.get({"c", "d"}).tensor()._version(), d);
}

// ---- robustness ---------------------------------------------------------------------------

TEST(Pipe, MetadataLengthOverTheCapIsRefused) {
  Watchdog dog(60s);
  PipeOptions small = fast_options();
  small.max_metadata_bytes = 100;
  auto [server, client] = pair_of(small);
  client.send(worked_example());  // 449 bytes of metadata
  EXPECT_THROW_MSG(server.recv(), c10::Error, "over the limit of 100");
  // The pipe is out of step now: later calls fail at once instead of reading garbage.
  EXPECT_THROW_MSG(server.recv(), c10::Error, "is broken: recv: peer");
}

TEST(Pipe, HugeAnnouncedLengthIsRefusedBeforeAllocating) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.send_raw(TestKey{}, std::string(1, '\x00').data(), 1);
  const std::string len = u64_le(uint64_t{1} << 62);
  client.send_raw(TestKey{}, len.data(), 8);
  EXPECT_THROW_MSG(server.recv(), c10::Error, "max_metadata_bytes");
}

TEST(Pipe, StorageOverTheCapIsRefused) {
  Watchdog dog(60s);
  PipeOptions small = fast_options();
  small.max_storage_bytes = 64;
  auto [server, client] = pair_of(small);
  client.send(worked_example());  // 96 bytes of storage
  EXPECT_THROW_MSG(server.recv(), c10::Error, "max_storage_bytes");
  // Uncollated: the sum of the leaves is capped the same way.
  PipeOptions small_u = fast_options(false);
  small_u.max_storage_bytes = 64;
  auto [server2, client2] = pair_of(small_u, fast_options(false));
  client2.send(worked_example());
  EXPECT_THROW_MSG(server2.recv(), c10::ValueError, "max_storage_bytes");
}

TEST(Pipe, UnknownFlagByteIsAnError) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.send_raw(TestKey{}, "\x07", 1);
  EXPECT_THROW_MSG(server.recv(), c10::Error, "Unknown TensorDictPipe protocol flag: 0x07");
}

TEST(Pipe, SameSchemaFlagWithoutTargetIsTheReferencesError) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.send_raw(TestKey{}, "\x01", 1);
  EXPECT_THROW_MSG(server.recv(), c10::Error,
                   "Received same-schema flag but no consolidated TensorDict is available for "
                   "in-place receive. The sender and receiver may be out of sync.");
}

TEST(Pipe, MalformedMetadataFailsTheSafeRebuild) {
  Watchdog dog(60s);
  auto send_metadata = [](Pipe& client, const std::string& json) {
    client.send_raw(TestKey{}, "\x00", 1);
    const std::string len = u64_le(json.size());
    client.send_raw(TestKey{}, len.data(), 8);
    client.send_raw(TestKey{}, json.data(), json.size());
  };
  {
    auto [server, client] = pair_of();
    send_metadata(client, "{not json");
    EXPECT_THROW_MSG(server.recv(), c10::ValueError, "invalid metadata");
  }
  {
    // Valid JSON, but a leaf that ends past _total_bytes.
    auto [server, client] = pair_of();
    std::string json = kWorkedExampleJson;
    json.replace(json.find("\"_total_bytes\": 96"), 18, "\"_total_bytes\": 32");
    send_metadata(client, json);
    EXPECT_THROW_MSG(server.recv(), c10::ValueError, "invalid metadata");
  }
  {
    // An unknown dtype.
    auto [server, client] = pair_of();
    std::string json = kWorkedExampleJson;
    json.replace(json.find("torch.int64"), 11, "torch.evil!");
    send_metadata(client, json);
    EXPECT_THROW_MSG(server.recv(), c10::ValueError, "invalid metadata");
  }
  // Malformed non-tensor entries are refused with the metadata, before the storage is read
  // (fuzz/pipe_frames.cpp once found a fault that surfaced after the receive state changed).
  const std::string last = "\"non_tensors\": {}}";
  for (const auto& [entry, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"(["hi", [3], null])", "does not start with the batch size [4]"},
           {R"(["hi", [4]])", "must be [data, batch_size, device]"},
           {R"(["hi", "4", null])", "batch_size of non-tensor entry 'text' must be a list"},
           {R"(["hi", [4], 7])", "device of non-tensor entry 'text' must be a string"},
           {"[" + std::string(300, '[') + std::string(300, ']') + ", [4], null]",
            "JSON nested deeper"}}) {
    auto [server, client] = pair_of();
    std::string json = kWorkedExampleJson;
    json.replace(json.rfind(last), last.size(), R"("non_tensors": {"text": )" + entry + "}}");
    send_metadata(client, json);
    EXPECT_THROW_MSG(server.recv(), c10::ValueError, needle);
  }
  {
    // Uncollated: malformed non_tensors entries.
    for (const auto& [nt, needle] : std::vector<std::pair<std::string, std::string>>{
             {R"([["x"]])", "must be [key, data]"},
             {R"([["x", [1], [2], 0]])", "do not match its batch size"},
             {R"([["x", [1], [1], 1]])", "invalid non-tensor stack"},
             {R"([["x", "ab", [2], 0]])", "invalid non-tensor stack"},
             {R"([[7, 1]])", "a key must be a string"},
             {R"([["a", 1]])", "keys must be unique"},
             {R"([[["a", "b"], 1]])", "cannot also have descendants"},
             {R"({"x": 1})", "non_tensors lists"}}) {
      auto [server, client] = pair_of(fast_options(false), fast_options(false));
      const std::string header =
          R"({"keys": ["a"], "dtypes": ["torch.float32"], "shapes": [[1]], "non_tensors": )" + nt +
          "}";
      const std::string len = u64_le(header.size());
      client.send_raw(TestKey{}, len.data(), 8);
      client.send_raw(TestKey{}, header.data(), header.size());
      EXPECT_THROW_MSG(server.recv(), c10::ValueError, needle);
    }
  }
  {
    // Uncollated: an unknown dtype in the header.
    auto [server, client] = pair_of(fast_options(false), fast_options(false));
    const std::string header = R"({"keys": ["a"], "dtypes": ["torch.nope"], "shapes": [[1]]})";
    const std::string len = u64_le(header.size());
    client.send_raw(TestKey{}, len.data(), 8);
    client.send_raw(TestKey{}, header.data(), header.size());
    EXPECT_THROW_MSG(server.recv(), c10::ValueError, "unknown torch dtype");
  }
  {
    // Uncollated: a quantized dtype, whose storage is not numel * element size bytes
    // (found by fuzz/pipe_frames.cpp: quint4x2 made the reader write past a leaf), is refused
    // on both sides.
    auto [server, client] = pair_of(fast_options(false), fast_options(false));
    const std::string header = R"({"keys": ["a"], "dtypes": ["torch.quint4x2"], "shapes": [[8]]})";
    const std::string len = u64_le(header.size());
    client.send_raw(TestKey{}, len.data(), 8);
    client.send_raw(TestKey{}, header.data(), header.size());
    EXPECT_THROW_MSG(server.recv(), c10::ValueError,
                     "the quantized dtype \"torch.quint4x2\" cannot be sent through the pipe");
  }
  {
    auto [server, client] = pair_of(fast_options(false), fast_options(false));
    auto q = at::quantize_per_tensor(at::ones({4}), 0.1, 0, at::kQUInt8);
    EXPECT_THROW_MSG(client.send(TensorDict({{"q", q}}, {})), c10::ValueError,
                     "leaf 'q' has the quantized dtype torch.quint8, which the pipe cannot carry");
  }
}

TEST(Pipe, AShortMessageIsRefusedAndBreaksThePipe) {
  // Every frame is one tag message of the size the framing announced: a shorter one is the
  // peer's fault, refused at once (not a wait for bytes that will never come).
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.send_raw(TestKey{}, "\x00", 1);
  const std::string len = u64_le(449);
  client.send_raw(TestKey{}, len.data(), 8);
  client.send_raw(TestKey{}, kWorkedExampleJson, 100);  // a third of the metadata
  EXPECT_THROW_MSG(server.recv(), MalformedPeerDataError,
                   "sent a message of 100 bytes where 449 were expected");
  EXPECT_THROW_MSG(server.recv(), PeerLostError, "is broken");
}

TEST(Pipe, PeerLeavingMidTensorDictFailsPromptly) {
  Watchdog dog(60s);
  PipeOptions o = fast_options();
  o.timeout = 8s;
  auto [server, client] = pair_of(o);
  client.send_raw(TestKey{}, "\x00", 1);
  const std::string len = u64_le(449);
  client.send_raw(TestKey{}, len.data(), 8);
  client.close();  // the metadata never comes
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW_MSG(server.recv(), PeerLostError, "disconnected");
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(elapsed, o.timeout);
  std::printf("peer loss detected after %lld ms\n",
              static_cast<long long>(
                  std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()));
}

TEST(Pipe, SenderThatClosesAtOnceLosesNothing) {
  // Tag messages a peer sent stay matchable on the receiver's worker after the connection
  // goes: a producer that sends then closes at once (no linger) loses nothing, and its close
  // marker ends the consumer's stream cleanly.
  Watchdog dog(60s);
  for (bool consolidated : {true, false}) {
    SCOPED_TRACE(consolidated);
    PipeOptions o = fast_options(consolidated);
    auto [server, client] = pair_of(o, o);
    std::thread producer([c = client]() mutable {
      for (int i = 0; i < 3; ++i) c.send(worked_example(i));
      c.close();
    });
    producer.join();  // closed before anything was read
    for (int i = 0; i < 3; ++i) expect_same(worked_example(i), server.recv());
    EXPECT_THROW_MSG(server.recv(), PeerClosedError, "closed the pipe");
    EXPECT_TRUE(server.peer_closed());
    EXPECT_THROW_MSG(server.send(worked_example()), PeerClosedError, "the peer closed the pipe");
    EXPECT_FALSE(client.peer_closed());
  }
}

TEST(Pipe, CloseReturnsPromptlyWhenThePeerDoesNotRead) {
  // docs/pipe.md: close() never waits for a peer that stopped reading (the default linger is
  // 0); what was sent stays readable by the peer.
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  for (int i = 0; i < 3; ++i) client.send(worked_example(i));
  server.send(worked_example(9));  // neither reads: each end has unread messages at the other
  const auto start = std::chrono::steady_clock::now();
  client.close();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  for (int i = 0; i < 3; ++i) expect_same(worked_example(i), server.recv());
  EXPECT_THROW(server.recv(), PeerClosedError);
  server.close();
}

TEST(Pipe, LingerWaitsForTheConsumerToStartReading) {
  Watchdog dog(60s);
  PipeOptions o = fast_options();
  o.linger = 700ms;
  auto [server, client] = pair_of(fast_options(), o);
  client.send(worked_example(1));
  const auto start = std::chrono::steady_clock::now();
  client.close();  // nobody reads: the whole linger
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 600ms);
  EXPECT_LT(waited, 3s);
  expect_same(worked_example(1), server.recv());
}

TEST(Pipe, FlowControlBoundsTheUnreceivedMessages) {
  // A producer gets at most max_unreceived TensorDicts ahead of its consumer; the next send
  // waits, and at the timeout fails having sent nothing, so the pipe goes on.
  Watchdog dog(60s);
  PipeOptions o = fast_options();
  o.max_unreceived = 4;
  o.timeout = 1s;
  auto [server, client] = pair_of(fast_options(), o);
  for (int i = 0; i < 4; ++i) client.send(worked_example(i));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW_MSG(client.send(worked_example(4)), TimeoutError,
                   "has not started receiving the last 4 messages");
  EXPECT_GE(std::chrono::steady_clock::now() - start, 900ms);
  for (int i = 0; i < 4; ++i) expect_same(worked_example(i), server.recv());
  client.send(worked_example(4));
  expect_same(worked_example(4), server.recv());
  EXPECT_EQ(client.stats().sends, 5);
}

// Drains `fd`, then waits up to 5 s for it to turn readable and `ready()` to hold.
template <typename Ready>
bool woken(int fd, Ready ready) {
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) > 0) {
      uint64_t value = 0;
      [[maybe_unused]] auto n = ::read(fd, &value, sizeof(value));
      if (ready()) return true;
    }
  }
  return false;
}

TEST(Pipe, EventLoopFormsNeverWaitForThePeer) {
  // event_fd / watch / recv_ready / try_send (docs/pipe.md, "From an event loop"): what
  // tensordict_cpp.pipe's coroutines are built on.
  Watchdog dog(60s);
  PipeOptions o = fast_options();
  o.max_unreceived = 4;
  Pipe server = Pipe::listen(0, "127.0.0.1", fast_options());
  const int fd = server.event_fd();
  server.watch(true);
  EXPECT_FALSE(server.recv_ready());  // no client yet
  Pipe client = Pipe::connect("127.0.0.1", server.port(), o);
  const TensorDict td = consolidate(worked_example(0));
  using Attempt = Pipe::SendAttempt;
  // A new schema may wait for the peer: nothing sent.
  EXPECT_EQ(client.try_send(td), Attempt::kWouldWait);
  EXPECT_EQ(client.stats().sends, 0);
  client.send(td);
  ASSERT_TRUE(woken(fd, [&] { return server.recv_ready(); }));
  expect_same(worked_example(0), server.recv());
  EXPECT_FALSE(server.recv_ready(std::chrono::microseconds(2000)));  // nothing more came
  // Same schema, small: sent at once until the window is full (the server does not read).
  int sent = 0;
  while (sent < 10 && client.try_send(td) == Attempt::kSent) ++sent;
  EXPECT_EQ(sent, 4);
  EXPECT_EQ(client.try_send(td), Attempt::kWindowFull);
  for (int i = 0; i < sent; ++i) {
    ASSERT_TRUE(server.recv_ready(std::chrono::microseconds(1000000)));  // all sent already
    expect_same(worked_example(0), server.recv());
  }
  // Over 8 KiB the storage may go by rendezvous, which waits for the peer: never try_send's.
  const TensorDict big = consolidate(TensorDict({{"x", at::ones({4096})}}));
  std::thread reader([&] { expect_same(big, server.recv()); });
  client.send(big);
  reader.join();
  EXPECT_EQ(client.try_send(big), Attempt::kWouldWait);
  // close() wakes a watcher, and a closed pipe's recv is ready (it throws at once).
  std::thread closer([&] {
    std::this_thread::sleep_for(100ms);
    server.close();
  });
  EXPECT_TRUE(woken(fd, [&] { return server.recv_ready(); }));
  closer.join();
  EXPECT_THROW(server.recv(), PipeClosedError);
  server.watch(false);
}

TEST(Pipe, TryRecvReceivesOnlyWhatHasWhollyArrivedAndKeepsTheRest) {
  // try_recv never waits for the peer (a peer stalled mid-TensorDict): a TensorDict stalled after
  // its flag and length, or after a same-schema flag, is not received; what arrived is kept, in
  // order, and the TensorDict is received whole once the rest comes.
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  const int fd = server.event_fd();
  server.watch(true);
  using Attempt = Pipe::RecvAttempt;
  Attempt attempt = Attempt::kReceived;
  const auto not_arrived = [&] {
    const auto start = std::chrono::steady_clock::now();
    const bool none = !server.try_recv(&attempt, std::nullopt, std::nullopt, 2ms);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 50ms);  // the spin, then returns
    return none && attempt == Attempt::kNotArrived;
  };
  const std::string wire = kWorkedExampleWire;
  const std::string len = u64_le(wire.size());
  client.send_raw(TestKey{}, "\x00", 1);
  client.send_raw(TestKey{}, len.data(), 8);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(not_arrived());
  client.send_raw(TestKey{}, wire.data(), wire.size());
  EXPECT_TRUE(not_arrived());  // the storage has not come
  const at::Tensor storage = consolidated_storage(consolidate(worked_example(1)));
  client.send_raw(TestKey{}, storage.const_data_ptr(), 96);
  std::optional<TensorDict> got;
  ASSERT_TRUE(woken(fd, [&] { return (got = server.try_recv(&attempt)).has_value(); }));
  EXPECT_EQ(attempt, Attempt::kReceived);
  expect_same(worked_example(1), *got);
  // A same-schema flag without its storage, then the storage.
  client.send_raw(TestKey{}, "\x01", 1);
  EXPECT_TRUE(not_arrived());
  const at::Tensor next = consolidated_storage(consolidate(worked_example(2)));
  client.send_raw(TestKey{}, next.const_data_ptr(), 96);
  ASSERT_TRUE(woken(fd, [&] { return (got = server.try_recv(&attempt)).has_value(); }));
  expect_same(worked_example(2), *got);
  // A message over the stash's limit needs a receiver: kWouldWait, then recv() takes it.
  const TensorDict big = consolidate(TensorDict({{"x", at::ones({1 << 19})}}));  // 2 MiB
  std::thread sender([&] { client.send(big); });
  ASSERT_TRUE(
      woken(fd, [&] { return !server.try_recv(&attempt) && attempt == Attempt::kWouldWait; }));
  expect_same(big, server.recv());
  sender.join();
  server.watch(false);
}

TEST(Pipe, ASendDeadlineCountsFromItsCall) {
  // PipeSendOptions::deadline (asend's, a peer that does not read): a send queued past its deadline
  // fails at once having sent nothing, and a window wait ends at the deadline; the pipe goes on.
  Watchdog dog(60s);
  PipeOptions o = fast_options();
  o.max_unreceived = 2;
  auto [server, client] = pair_of(fast_options(), o);
  const TensorDict td = consolidate(worked_example(0));
  using Clock = std::chrono::steady_clock;
  EXPECT_THROW_MSG(client.send(td, {.deadline = Clock::now() - 1ms}), TimeoutError,
                   "nothing was sent");
  EXPECT_EQ(client.stats().sends, 0);
  int sent = 0;
  auto start = Clock::now();
  try {
    for (; sent < 10; ++sent) client.send(td, {.deadline = start + 300ms});  // nobody reads
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("nothing was sent"), std::string::npos) << e.what();
  }
  const auto took = Clock::now() - start;
  EXPECT_LT(sent, 10);
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 2s);  // not the pipe's 10 s timeout
  for (int i = 0; i < sent; ++i) expect_same(worked_example(0), server.recv());
  client.send(td);
  expect_same(worked_example(0), server.recv());
}

TEST(Pipe, ClosingABrokenPipeReleasesItsWorkerThreadsAndDescriptors) {
  // A peer that dies or breaks the protocol: a closed pipe keeps no UCX worker, progress thread or
  // descriptor, even while its handle lives, whatever broke it (a stalled peer, a peer gone
  // mid-message, a protocol error).
  Watchdog dog(120s);
  PipeOptions o = fast_options();
  // Short, for the stalled cases' receives to time out quickly; long enough that connecting
  // (which waits under it too) never times out on a loaded machine under ASan.
  o.timeout = 500ms;
  {
    auto [server, client] = pair_of(o, o);  // UCX's process-wide state is made once
    client.send(worked_example(0));
    server.recv();
  }
  const int fds = open_fds(), tasks = threads();
  std::vector<Pipe> kept;
  for (int i = 0; i < 24; ++i) {
    auto [server, client] = pair_of(o, o);
    const int fd = server.event_fd();  // a watched pipe releases its fd too
    server.watch(true);
    const std::string len = u64_le(449);
    client.send_raw(TestKey{}, i % 3 == 2 ? "\x07" : "\x00", 1);
    client.send_raw(TestKey{}, len.data(), 8);
    if (i % 3 == 1) client.close();   // gone mid-message
    EXPECT_ANY_THROW(server.recv());  // a timeout, a lost peer, an unknown flag
    server.close();
    client.close();
    EXPECT_NE(::fcntl(fd, F_GETFD), -1) << "closed while still watched";
    server.watch(false);
    kept.push_back(server);
    kept.push_back(client);
  }
  EXPECT_EQ(open_fds(), fds);
  EXPECT_EQ(threads(), tasks);
  for (auto& p : kept) EXPECT_THROW(p.recv(), PipeClosedError);
}

TEST(Pipe, RecvAfterThePeerLeftFailsPromptly) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.send(worked_example(3));
  expect_same(worked_example(3), server.recv());
  client.close();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(server.recv(), PeerClosedError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(Pipe, ReportsItsPeerAndTransports) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.send(worked_example());
  server.recv();
  EXPECT_TRUE(server.peer_is_tensordict_cpp());
  EXPECT_TRUE(client.peer_is_tensordict_cpp());
  EXPECT_NE(client.transports().find("tcp/lo"), std::string::npos) << client.transports();
  EXPECT_NE(server.transports().find("tcp/lo"), std::string::npos) << server.transports();
}

// ucxx's peer-info exchange (docs/wire-format.md §6.6), with values computed by ucxx's own
// hash64bits (ucxx/_lib_async/utils.py) on this machine.
TEST(PipeFrames, PeerInfoIsUcxxs) {
  using namespace tensordict::wire::frames;
  EXPECT_EQ(hash64bits(0), 0x22dd0956b1627f9fULL);
  EXPECT_EQ(hash64bits(1234), 0x60f8172b0eed38baULL);
  EXPECT_EQ(hash64bits(~uint64_t{0}), 0x81ca8f731742cb98ULL);
  uint8_t info[16];
  write_peer_info(1234, info);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(info), 8), u64_le(1234));
  EXPECT_EQ(std::string(reinterpret_cast<char*>(info) + 8, 8), u64_le(0x60f8172b0eed38baULL));
  const PeerInfo theirs = read_peer_info(info);
  EXPECT_EQ(theirs.tag, 1234u);
  EXPECT_FALSE(theirs.ours);
  const uint64_t tag = make_our_tag();
  EXPECT_NE(tag, make_our_tag());
  write_peer_info(tag, info);
  EXPECT_TRUE(read_peer_info(info).ours);
  info[9] ^= 1;
  EXPECT_THROW_MSG(read_peer_info(info), MalformedPeerDataError, "Checksum invalid!");
}

TEST(Pipe, ClosedPipeErrors) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  client.close();
  EXPECT_TRUE(client.closed());
  EXPECT_THROW_MSG(client.send(worked_example()), PipeClosedError, "Cannot send on a closed pipe.");
  EXPECT_THROW_MSG(client.recv(), PipeClosedError, "Cannot recv on a closed pipe.");
  client.close();  // idempotent
  server.close();
  EXPECT_THROW_MSG(server.recv(), PipeClosedError, "Cannot recv on a closed pipe.");
}

TEST(Pipe, CloseFromAnotherThreadUnblocksARecv) {
  Watchdog dog(60s);
  auto [server, client] = pair_of();
  const auto start = std::chrono::steady_clock::now();
  std::thread closer([s = server]() mutable {
    std::this_thread::sleep_for(300ms);
    s.close();
  });
  EXPECT_THROW(server.recv(), c10::Error);
  closer.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 6s);
}

TEST(Pipe, ListenWithoutClientTimesOut) {
  Watchdog dog(60s);
  PipeOptions o = fast_options();
  o.timeout = 300ms;
  Pipe server = Pipe::listen(0, "127.0.0.1", o);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW_MSG(server.recv(), c10::Error, "no client connected");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(Pipe, ConnectToNobodyFails) {
  Watchdog dog(60s);
  PipeOptions o = fast_options();
  o.timeout = 3s;
  int port;
  {
    Pipe probe = Pipe::listen(0, "127.0.0.1", o);  // a port that was free a moment ago
    port = probe.port();
  }
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(Pipe::connect("127.0.0.1", port, o), c10::Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, o.timeout + 6s);
}

TEST(Pipe, BadArguments) {
  EXPECT_THROW(Pipe::listen(70000), c10::ValueError);
  EXPECT_THROW(Pipe::connect("no-such-host.invalid", 1234, fast_options()), c10::ValueError);
}

}  // namespace

// FrameReader::arrival (Pipe::try_recv's walk over the framing, no UCX): kWhole only once every
// message the receive reads has landed, and then the receive reads exactly those (it never
// waits for a message that has not come).
TEST(PipeFrames, ArrivalIsWholeExactlyWhenTheReceiveReadsOnlyLandedMessages) {
  using namespace tensordict::wire::frames;
  struct Messages final : ByteSource, MessagePeek {
    std::vector<std::string> msgs;
    size_t landed = 0, next = 0, limit = SIZE_MAX;
    Peeked peek(size_t i) override {
      if (i >= landed) return {Peeked::kNotYet};
      if (msgs[i].size() > limit) return {Peeked::kTooLarge, msgs[i].size()};
      return {Peeked::kLanded, msgs[i].size(), reinterpret_cast<const uint8_t*>(msgs[i].data())};
    }
    void read(void* data, size_t n, const at::Tensor&, const char* what) override {
      if (next >= landed) throw std::runtime_error(std::string("read unlanded ") + what);
      EXPECT_EQ(n, msgs[next].size()) << what;
      std::memcpy(data, msgs[next].data(), std::min(n, msgs[next].size()));
      ++next;
    }
    void fail(const std::string&) override {}
    [[noreturn]] void peer_left() override { throw std::runtime_error("closed"); }
    std::string peer() const override { return "test"; }
  };
  const FrameLimits limits{1 << 20, 1 << 20};
  const auto check = [&](FrameReader& reader, std::vector<std::string> msgs, bool consolidated) {
    Messages m;
    m.msgs = std::move(msgs);
    for (m.landed = 0; m.landed < m.msgs.size(); ++m.landed) {
      EXPECT_EQ(reader.arrival(m, consolidated), Arrival::kIncomplete) << m.landed;
    }
    EXPECT_EQ(reader.arrival(m, consolidated), Arrival::kWhole);
    m.limit = m.msgs.back().size() - 1;  // the last message too large for a stash
    EXPECT_EQ(reader.arrival(m, consolidated), Arrival::kNeedsReceiver);
    const TensorDict td = consolidated ? reader.recv_consolidated(m, std::nullopt, std::nullopt)
                                       : reader.recv_uncollated(m, std::nullopt);
    EXPECT_EQ(m.next, m.msgs.size());  // read every landed message, no other
    return td;
  };
  const at::Tensor storage = consolidated_storage(consolidate(worked_example(1)));
  const std::string bytes(static_cast<const char*>(storage.const_data_ptr()), 96);
  FrameReader reader(limits);
  const std::string wire = kWorkedExampleWire;
  expect_same(worked_example(1),
              check(reader, {std::string(1, '\0'), u64_le(wire.size()), wire, bytes}, true));
  expect_same(worked_example(1), check(reader, {"\x01", bytes}, true));  // same schema
  Messages bad;  // a message the receive refuses at once counts as whole: it fails, not waits
  bad.msgs = {"\x07"};
  bad.landed = 1;
  EXPECT_EQ(reader.arrival(bad, true), Arrival::kWhole);
  bad.msgs = {std::string(1, '\0'), u64_le(uint64_t{1} << 40)};  // over the metadata cap
  bad.landed = 2;
  EXPECT_EQ(reader.arrival(bad, true), Arrival::kWhole);
  const auto frame =
      uncollated_frame(worked_example(2), [](const NestedKey&, const at::Tensor&) {});
  std::vector<std::string> msgs{u64_le(frame.header.size()), frame.header};
  for (const at::Tensor& leaf : frame.leaves) {
    msgs.emplace_back(static_cast<const char*>(leaf.const_data_ptr()), leaf.nbytes());
  }
  FrameReader uncollated(limits);
  expect_same(worked_example(2), check(uncollated, msgs, false));
}

#pragma once
// Publication's contract: what the engine (src/wire/publication_publisher.cpp,
// publication_subscriber.cpp) does over every transport's link (wire/publication_link.h), run
// as the same scenarios over each, in one process: versions whole and increasing, timeouts and
// polls that leave the TensorDict as it was, a new epoch on the same link, min_version, a
// missing publisher, refused requests, a refused offer that ends the link and frees its slot,
// forged messages named, subscribers that stall, close or are lost while a version waits or is
// sent, the publisher's close, large versions one subscriber at a time within their turns, and
// pinned slots named by publish. Faults are injected by a FaultyLink around each end
// (publication_links.h), so that every transport meets the same ones; a transport that has a
// clean close of its own (a pipe's close marker) closes for real.
//
// Beside it, the link's own contract (LinkContract): a request's send completes once taken,
// a kind's messages arrive in order whatever the waits, short and longer messages are told, a
// kept request receive is the next one's, a clean close is a PeerClosedError.
//
// A transport joins with a few lines (tensorpipe's transport tests are the model):
//
//   struct MyTransport {
//     static constexpr const char* kName = "mine";
//     publication_contract::Connection connect();  // a new connection: the two ends' links
//   };
//   INSTANTIATE_PUBLICATION_CONTRACT(Mine, MyTransport);  // in namespace publication_contract
//
// (publication_contract_test.cpp: the loopback; publication_contract_gloo.cpp: a c10d group's
// GroupLink, four Gloo backends in one process; publication_contract_pipe.cpp: a pipe's PipeLink,
// a server and a connected pipe in one process.)
//
// Relays (docs/wire-format.md §9.9, RelayContract): a publisher whose route is a chain and three
// subscribers (ranks 1 to 3) that relay to each other: versions of 2 MiB taken whole and exact
// by every subscriber through one chain (ThreeSubscribersTakeEachVersionWholeThroughAChain:
// stats' relayed_from, -1 for one and another's rank for the others), then, as all three are of
// one host, by the first alone and read from its slots by the other two; the first relay's link
// to its child stalled (a FaultyLink on that pair), the child holding, then resuming at the
// publisher within the version, both ends naming the relay, which is a leaf of the next route
// (AStalledRelayIsRoutedAroundWithinTheVersion); a piece forged on that link (Faults::tamper)
// caught by its checksum, the child completing from the publisher and forwarding nothing
// forged (AForgingRelayIsCaughtAndTheChildCompletesFromThePublisher); that child's resume
// rewritten in flight to name another rank than its parent, which blames nobody
// (AResumeThatNamesAnotherRankThanItsParentBlamesNobody). Only a transport whose
// subscribers can reach each other joins them, with a Mesh: every endpoint's link to every
// other (0 the publisher), as the transport's Publisher and Subscriber make theirs:
//
//   struct MyTransport {
//     ...
//     publication_contract::Mesh mesh(int n);  // link(i, j) for every ordered pair of n
//   };
//   INSTANTIATE_RELAY_CONTRACT(Mine, MyTransport);  // in namespace publication_contract
//
// The loopback (LoopbackPeerLink, a wire each way between two subscribers) and Gloo (a channel
// among the four ranks) join; the pipe does not: a pipe joins one client to a server, its
// subscribers have no link to each other (pipe::Subscriber relays nothing: its RelayLinks are
// empty), so there is no mesh to make.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "publication_links.h"
#include "publication_test_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/errors.h"
#include "tensordict/publication.h"
#include "tensordict/tensor_dict.h"
#include "wire/publication_publisher.h"
#include "wire/publication_subscriber.h"

namespace publication_contract {

using namespace std::chrono_literals;
using pub::PublisherCore;
using pub::SubscriberCore;
using tensordict::PullOptions;
using tensordict::SubscriberStats;
using tensordict::TensorDict;

/// A new connection between a publisher's end and a subscriber's, as a transport makes it.
struct Connection {
  std::shared_ptr<pub::Link> publisher, subscriber;
  /// The transport's own clean close of one end, where it has one; null: injected instead.
  std::function<void(Side)> close{};
  /// What the links need alive (the transport's objects).
  std::shared_ptr<void> resources{};
};

// ---- helpers ------------------------------------------------------------------------------------

inline TensorDict weights(double v) {
  TensorDict inner({{"w", at::full({8, 3}, v, at::kDouble)}}, {});
  return TensorDict({{"bias", at::full({3}, v)},
                     {"layer", inner},
                     {"steps", at::full({2}, static_cast<int64_t>(v), at::kLong)}},
                    {});
}

/// A large version: one leaf of 8 MiB (docs/publication.md: sent one subscriber at a time).
inline TensorDict large(double v) {
  return TensorDict({{"w", at::full({int64_t{1} << 20}, v, at::kDouble)}}, {});
}

/// Every leaf of `td` holds `v`.
inline bool holds(const TensorDict& td, double v) {
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensordict()) {
      if (!holds(value.tensordict(), v)) return false;
    } else if (!value.tensor().eq(v).all().item<bool>()) {
      return false;
    }
  }
  return true;
}

/// What a call raised: its kind and message (kind "" when it raised nothing).
struct Outcome {
  std::string kind, message;
  bool raised(const char* k, const std::string& part) const {
    return kind == k && message.find(part) != std::string::npos;
  }
};

inline Outcome outcome_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const tensordict::NoPublisherError& e) {
    return {"NoPublisherError", e.msg()};
  } catch (const tensordict::MalformedPeerDataError& e) {
    return {"MalformedPeerDataError", e.msg()};
  } catch (const tensordict::SchemaMismatchError& e) {
    return {"SchemaMismatchError", e.msg()};
  } catch (const tensordict::PeerLostError& e) {
    return {"PeerLostError", e.msg()};
  } catch (const tensordict::PeerClosedError& e) {
    return {"PeerClosedError", e.msg()};
  } catch (const tensordict::TimeoutError& e) {
    return {"TimeoutError", e.msg()};
  } catch (const c10::Error& e) {
    return {"c10::Error", e.msg()};
  } catch (const std::exception& e) {
    return {"std::exception", e.what()};
  }
  return {};
}

inline std::ostream& operator<<(std::ostream& os, const Outcome& o) {
  return os << (o.kind.empty() ? "no error" : o.kind) << ": " << o.message;
}

/// Polls `pred` until it holds (true) or `timeout` passes (false).
inline bool eventually(const std::function<bool()>& pred, Clock::duration timeout = 5s) {
  const auto end = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

inline double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

/// A forged message as a tensor to post.
inline at::Tensor forged(const char* magic, uint32_t word, std::initializer_list<uint64_t> fields,
                         size_t size = 64) {
  std::string m = publication_test::message(magic, word, fields);
  m.resize(size, '\0');
  at::Tensor t = at::empty({static_cast<int64_t>(m.size())}, at::kByte);
  std::memcpy(t.data_ptr(), m.data(), m.size());
  return t;
}
inline uint32_t word_of(const at::Tensor& message) {
  const auto* p = message.data_ptr<uint8_t>();
  return p[12] | (p[13] << 8) | (p[14] << 16) | (uint32_t{p[15]} << 24);
}
inline uint64_t field_of(const at::Tensor& message, int offset) {
  return publication_test::get_u64(message.data_ptr<uint8_t>() + offset);
}

/// Aborts the process when a test outlives its budget: a hang fails, loudly.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds budget)
      : thread_([this, budget] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!done_cv_.wait_for(lock, budget, [&] { return done_; })) {
            std::fprintf(stderr, "watchdog: the test outlived its %llds\n",
                         static_cast<long long>(budget.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;
};

/// What subscribers leave in flight, kept for the life of the process: a transport may still
/// land a peer's bytes in their buffers (Gloo's receives cannot be withdrawn), as
/// dist::Subscriber's destructor keeps them.
inline std::vector<std::shared_ptr<pub::Leftover>>& leftovers() {
  static auto* kept = new std::vector<std::shared_ptr<pub::Leftover>>;
  return *kept;
}

// ---- the link's own contract (wire/publication_link.h) ----------------------------------------

template <typename Transport>
class LinkContract : public ::testing::Test {
 protected:
  Connection connect() {
    Connection c = transport_.connect();
    connections_.push_back(c);
    return c;
  }
  void TearDown() override { connections_.clear(); }

  Transport transport_;
  Watchdog watchdog_{std::chrono::seconds(60)};

 private:
  std::vector<Connection> connections_;
};

TYPED_TEST_SUITE_P(LinkContract);

/// A message of `n` bytes, each byte `fill`.
inline at::Tensor filled(int64_t n, uint8_t fill) { return at::full({n}, fill, at::kByte); }

TYPED_TEST_P(LinkContract, ARequestCompletesOnlyOnceTaken) {
  Connection c = this->connect();
  const at::Tensor request = filled(64, 7);
  auto sent = c.subscriber->post_send(request, Kind::kRequest);
  EXPECT_FALSE(c.subscriber->wait(sent, Clock::now() + 200ms));  // nobody takes it
  at::Tensor buffer = pub::message_buffer();
  auto in = c.publisher->post_recv(buffer, Kind::kRequest);
  ASSERT_TRUE(c.publisher->wait(in, Clock::now() + 5s));
  ASSERT_TRUE(c.subscriber->wait(sent, Clock::now() + 5s));
  EXPECT_TRUE(buffer.equal(request));
  EXPECT_FALSE(c.publisher->short_message(in));
}

TYPED_TEST_P(LinkContract, MessagesOfAKindArriveInOrderWhateverTheWaits) {
  Connection c = this->connect();
  std::vector<pub::PendingPtr> sends, recvs;
  std::vector<at::Tensor> buffers;
  for (uint8_t i = 1; i <= 3; ++i) {
    buffers.push_back(pub::message_buffer());
    recvs.push_back(c.subscriber->post_recv(buffers.back(), Kind::kOffer));
  }
  EXPECT_FALSE(c.subscriber->wait(recvs[0], Clock::now()));  // a wait that gives up: posted still
  for (uint8_t i = 1; i <= 3; ++i)
    sends.push_back(c.publisher->post_send(filled(64, i), Kind::kOffer));
  for (int i = 2; i >= 0; --i) {
    ASSERT_TRUE(c.subscriber->wait(recvs[i], Clock::now() + 5s));
    EXPECT_TRUE(buffers[i].equal(filled(64, static_cast<uint8_t>(i + 1))));
  }
  for (const auto& s : sends) EXPECT_TRUE(c.publisher->wait(s, Clock::now() + 5s));
}

TYPED_TEST_P(LinkContract, ShortAndLongerMessagesAreTold) {
  Connection c = this->connect();
  at::Tensor data = pub::recv_buffer(1000);
  auto in = c.subscriber->post_recv(data, Kind::kData);
  auto sent = c.publisher->post_send(filled(600, 3), Kind::kData);
  ASSERT_TRUE(c.subscriber->wait(in, Clock::now() + 5s));
  EXPECT_TRUE(c.subscriber->short_message(in));
  EXPECT_TRUE(data.narrow(0, 0, 600).equal(filled(600, 3)));
  ASSERT_TRUE(c.publisher->wait(sent, Clock::now() + 5s));
  // Longer than the buffer (within the room kept after it): a named error, not an abort.
  Connection d = this->connect();
  at::Tensor small = pub::recv_buffer(100);
  auto in_d = d.subscriber->post_recv(small, Kind::kData);
  auto sent_d = d.publisher->post_send(filled(200, 4), Kind::kData);
  const Outcome o = outcome_of([&] { d.subscriber->wait(in_d, Clock::now() + 5s); });
  EXPECT_EQ(o.kind, "MalformedPeerDataError") << o;
  d.subscriber->keep({in_d});
  d.publisher->keep({sent_d});
  // A request or an offer is 64 bytes: a longer one is named too.
  Connection e = this->connect();
  at::Tensor offer = pub::message_buffer();
  auto in_e = e.subscriber->post_recv(offer, Kind::kOffer);
  auto sent_e = e.publisher->post_send(filled(80, 5), Kind::kOffer);
  const Outcome oe = outcome_of([&] { e.subscriber->wait(in_e, Clock::now() + 5s); });
  EXPECT_EQ(oe.kind, "MalformedPeerDataError") << oe;
  e.subscriber->keep({in_e});
  e.publisher->keep({sent_e});
}

TYPED_TEST_P(LinkContract, AKeptRequestReceiveIsTheNextOnes) {
  // What a closing publisher leaves posted: the next end on the same link takes it over.
  Connection c = this->connect();
  at::Tensor left = pub::message_buffer();
  auto kept = c.publisher->post_recv(left, Kind::kRequest);
  EXPECT_FALSE(c.publisher->wait(kept, Clock::now() + 50ms));
  c.publisher->keep({kept});
  at::Tensor buffer = pub::message_buffer();
  auto in = c.publisher->post_recv(buffer, Kind::kRequest);
  auto sent = c.subscriber->post_send(filled(64, 9), Kind::kRequest);
  ASSERT_TRUE(c.publisher->wait(in, Clock::now() + 5s));
  EXPECT_TRUE(buffer.equal(filled(64, 9)));
  ASSERT_TRUE(c.subscriber->wait(sent, Clock::now() + 5s));
}

TYPED_TEST_P(LinkContract, ACleanCloseIsPeerClosedError) {
  Connection c = this->connect();
  if (!c.close) GTEST_SKIP() << TypeParam::kName << " has no clean close (its peers are lost)";
  at::Tensor request = pub::message_buffer();
  auto in = c.publisher->post_recv(request, Kind::kRequest);
  c.close(Side::kSubscriber);
  const Outcome o = outcome_of([&] { c.publisher->wait(in, Clock::now() + 5s); });
  EXPECT_EQ(o.kind, "PeerClosedError") << o;
  c.publisher->keep({in});
}

REGISTER_TYPED_TEST_SUITE_P(LinkContract, ARequestCompletesOnlyOnceTaken,
                            MessagesOfAKindArriveInOrderWhateverTheWaits,
                            ShortAndLongerMessagesAreTold, AKeptRequestReceiveIsTheNextOnes,
                            ACleanCloseIsPeerClosedError);

// ---- the fixture --------------------------------------------------------------------------------

template <typename Transport>
class PublicationContract : public ::testing::Test {
 protected:
  /// One connection, its ends wrapped in FaultyLinks that obey `faults`.
  struct End {
    Connection connection;
    std::shared_ptr<Faults> faults = std::make_shared<Faults>();
    std::shared_ptr<pub::Link> publisher, subscriber;
    /// `side` closes its end: the transport's own clean close, or injected.
    void close(Side side) {
      if (connection.close) {
        connection.close(side);
      } else {
        faults->close(side);
      }
    }
  };

  End& connect() {
    auto end = std::make_unique<End>();
    end->connection = transport_.connect();
    end->publisher =
        std::make_shared<FaultyLink>(end->connection.publisher, end->faults, Side::kPublisher);
    end->subscriber =
        std::make_shared<FaultyLink>(end->connection.subscriber, end->faults, Side::kSubscriber);
    ends_.push_back(std::move(end));
    return *ends_.back();
  }

  PublisherCore& publisher(int64_t max_slots, pub::Transport transport = pub::Transport::kSocket) {
    cores_.push_back({std::make_unique<PublisherCore>(max_slots, transport), {}});
    return *cores_.back().core;
  }

  /// Serves `end`'s subscriber from `core`, on a thread of its own (as every transport does).
  PublisherCore::Subscription& serve(PublisherCore& core, End& end) {
    SubscriberStats stats;
    stats.peer = end.publisher->peer();
    PublisherCore::Subscription& s = core.add(std::move(stats));
    for (auto& c : cores_) {
      if (c.core.get() == &core) {
        c.threads.emplace_back([&core, &s, link = end.publisher] { core.serve(s, *link); });
      }
    }
    return s;
  }

  /// Closes `core` and waits for its threads: they return within a slice of their waits.
  void stop(PublisherCore& core) {
    core.close();
    for (auto& c : cores_) {
      if (c.core.get() != &core) continue;
      for (auto& t : c.threads) t.join();
      c.threads.clear();
    }
  }

  SubscriberCore& subscribe(End& end, int64_t max_total_bytes = int64_t{1} << 30,
                            pub::Transport transport = pub::Transport::kSocket) {
    subscribers_.push_back(std::make_unique<SubscriberCore>(
        end.subscriber, c10::str("Subscriber.pull (", Transport::kName, ")"), max_total_bytes,
        transport));
    return *subscribers_.back();
  }

  void TearDown() override {
    for (auto& c : cores_) stop(*c.core);
    for (auto& s : subscribers_) {
      if (auto left = s->release()) leftovers().push_back(std::move(left));
    }
    subscribers_.clear();
    cores_.clear();
    ends_.clear();
  }

  Transport transport_;
  Watchdog watchdog_{std::chrono::seconds(60)};

 private:
  struct Serving {
    std::unique_ptr<PublisherCore> core;
    std::vector<std::thread> threads;
  };
  std::deque<std::unique_ptr<End>> ends_;
  std::deque<Serving> cores_;
  std::deque<std::unique_ptr<SubscriberCore>> subscribers_;
};

TYPED_TEST_SUITE_P(PublicationContract);

// ---- the scenarios ------------------------------------------------------------------------------

TYPED_TEST_P(PublicationContract, VersionsAreWholeAndIncreasing) {
  constexpr int kVersions = 30;
  PublisherCore& core = this->publisher(2);
  auto& a = this->connect();
  auto& b = this->connect();
  this->serve(core, a);
  this->serve(core, b);
  // Each subscriber pulls a new TensorDict, then pulls into it in place until the last version.
  const auto pulls = [](SubscriberCore& sub) {
    return std::async(std::launch::async, [&sub]() -> std::string {
      auto first = sub.pull(PullOptions{.timeout = 10s});
      if (!first) return "no first version";
      TensorDict td = first->td;
      if (!holds(td, static_cast<double>(first->version))) return "a torn first version";
      const void* storage = tensordict::consolidated_storage(td).data_ptr();
      for (int64_t last = first->version; last < kVersions;) {
        const auto v = sub.pull(td, {.timeout = 10s});
        if (!v) return c10::str("no version after ", last);
        if (*v <= last) return c10::str("version ", *v, " after ", last);
        if (!holds(td, static_cast<double>(*v))) return c10::str("version ", *v, " torn");
        last = *v;
      }
      if (tensordict::consolidated_storage(td).data_ptr() != storage) return "not in place";
      return "";
    });
  };
  auto from_a = pulls(this->subscribe(a));
  auto from_b = pulls(this->subscribe(b));
  for (int v = 1; v <= kVersions; ++v) {
    EXPECT_EQ(core.publish(weights(v), std::nullopt, std::nullopt), v);
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(from_a.get(), "");
  EXPECT_EQ(from_b.get(), "");
  EXPECT_EQ(core.version(), kVersions);
  EXPECT_TRUE(eventually([&] {
    const auto stats = core.stats();
    return stats.size() == 2 && stats[0].version == kVersions && stats[1].version == kVersions;
  }));
  for (const auto& s : core.stats()) {
    EXPECT_GE(s.pulls, 2) << s.peer;
    EXPECT_FALSE(s.lost) << s.error;
    EXPECT_FALSE(s.pinned.has_value());
  }
}

TYPED_TEST_P(PublicationContract, TimeoutsAndPollsLeaveTheTensorDictUnchanged) {
  PublisherCore& core = this->publisher(2);
  auto& e = this->connect();
  this->serve(core, e);
  SubscriberCore& sub = this->subscribe(e);
  TensorDict td = weights(0);
  auto t0 = Clock::now();
  EXPECT_FALSE(sub.pull(td, {.timeout = 100ms}).has_value());
  EXPECT_GE(Clock::now() - t0, 100ms);
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_FALSE(sub.pull(td, {.timeout = 0ms}).has_value());  // a poll
  EXPECT_TRUE(holds(td, 0));
  EXPECT_EQ(sub.version(), 0);

  core.publish(weights(1), std::nullopt, std::nullopt);
  std::optional<int64_t> got;  // polls: the first may only send the request
  EXPECT_TRUE(eventually([&] { return (got = sub.pull(td, {.timeout = 0ms})).has_value(); }));
  EXPECT_EQ(got, 1);
  EXPECT_TRUE(holds(td, 1));
  t0 = Clock::now();
  EXPECT_FALSE(sub.pull(td, {.timeout = 100ms}).has_value());  // nothing newer
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_TRUE(holds(td, 1));

  // A version still arriving when the pull gives up: td as it was, a later pull takes it.
  e.faults->stall(Kind::kData);
  core.publish(weights(2), std::nullopt, std::nullopt);
  EXPECT_FALSE(sub.pull(td, {.timeout = 300ms}).has_value());
  EXPECT_FALSE(sub.pull(td, {.timeout = 0ms}).has_value());
  EXPECT_TRUE(holds(td, 1));
  EXPECT_EQ(sub.version(), 1);
  EXPECT_TRUE(eventually([&] { return core.stats()[0].pinned == 2; }));
  e.faults->release();
  EXPECT_EQ(sub.pull(td, {.timeout = 5s}), 2);
  EXPECT_TRUE(holds(td, 2));
}

TYPED_TEST_P(PublicationContract, ANewPublisherOnTheSameLinkIsANewEpoch) {
  PublisherCore& first = this->publisher(2);
  auto& e = this->connect();
  this->serve(first, e);
  SubscriberCore& sub = this->subscribe(e);
  first.publish(weights(3), std::nullopt, std::nullopt);
  first.publish(weights(4), std::nullopt, std::nullopt);
  auto pulled = sub.pull(PullOptions{.timeout = 5s});
  ASSERT_TRUE(pulled.has_value());
  EXPECT_EQ(pulled->version, 2);
  EXPECT_EQ(sub.epoch(), first.epoch());
  TensorDict td = pulled->td;

  // The first publisher goes (its request receive left to the link); a new one serves the same
  // link: its version 1 is newer than version 2 of the old epoch.
  this->stop(first);
  PublisherCore& second = this->publisher(2);
  EXPECT_NE(second.epoch(), first.epoch());
  this->serve(second, e);
  EXPECT_EQ(second.publish(weights(5), std::nullopt, std::nullopt), 1);
  EXPECT_EQ(sub.pull(td, {.timeout = 5s}), 1);
  EXPECT_TRUE(holds(td, 5));
  EXPECT_EQ(sub.epoch(), second.epoch());
  EXPECT_EQ(sub.version(), 1);

  // Another structure: the schema is read again; a pull into the old one is refused by name,
  // td unchanged, and a pull into a new TensorDict has it.
  TensorDict grown = weights(6);
  grown.set("extra", at::full({2}, 6.0));
  EXPECT_EQ(second.publish(grown, std::nullopt, std::nullopt), 2);
  const Outcome o = outcome_of([&] { sub.pull(td, {.timeout = 5s}); });
  EXPECT_TRUE(o.raised("SchemaMismatchError", "extra")) << o;
  EXPECT_TRUE(holds(td, 5));
  auto fresh = sub.pull(PullOptions{.timeout = 5s});
  ASSERT_TRUE(fresh.has_value());
  EXPECT_EQ(fresh->version, 2);
  EXPECT_TRUE(fresh->td.contains("extra"));
  EXPECT_TRUE(holds(fresh->td, 6));
}

TYPED_TEST_P(PublicationContract, MinVersionWaitsForThatVersion) {
  PublisherCore& core = this->publisher(2);
  auto& e = this->connect();
  this->serve(core, e);
  SubscriberCore& sub = this->subscribe(e);
  for (int v = 1; v <= 3; ++v) core.publish(weights(v), std::nullopt, std::nullopt);
  TensorDict td = weights(0);
  auto pull = std::async(std::launch::async,
                         [&] { return sub.pull(td, {.timeout = 10s, .min_version = 5}); });
  EXPECT_EQ(pull.wait_for(300ms), std::future_status::timeout);  // 3 is not enough
  core.publish(weights(4), std::nullopt, std::nullopt);
  EXPECT_EQ(pull.wait_for(200ms), std::future_status::timeout);  // nor 4
  core.publish(weights(5), std::nullopt, std::nullopt);
  EXPECT_EQ(pull.get(), 5);
  EXPECT_TRUE(holds(td, 5));
  // At or below the version held: the next newer one.
  core.publish(weights(6), std::nullopt, std::nullopt);
  EXPECT_EQ(sub.pull(td, {.timeout = 5s, .min_version = 2}), 6);
}

TYPED_TEST_P(PublicationContract, NoPublisherIsNamedAndTheRequestStaysQueued) {
  auto& e = this->connect();
  SubscriberCore& sub = this->subscribe(e);
  TensorDict td = weights(0);
  const auto t0 = Clock::now();
  const Outcome o = outcome_of([&] { sub.pull(td, {.timeout = 300ms}); });
  EXPECT_TRUE(o.raised("NoPublisherError", e.subscriber->no_publisher())) << o;
  EXPECT_GE(Clock::now() - t0, 300ms);
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_TRUE(holds(td, 0));
  // A publisher that starts takes the request left queued.
  PublisherCore& core = this->publisher(1);
  this->serve(core, e);
  core.publish(weights(3), std::nullopt, std::nullopt);
  EXPECT_EQ(sub.pull(td, {.timeout = 5s}), 1);
  EXPECT_TRUE(holds(td, 3));
}

TYPED_TEST_P(PublicationContract, RefusedRequestsEndTheSubscription) {
  PublisherCore& core = this->publisher(1);
  // A request that is not one: answered "refused", with the seq it carried, and recorded.
  auto& a = this->connect();
  this->serve(core, a);
  at::Tensor offer = pub::message_buffer();
  auto offer_in = a.subscriber->post_recv(offer, Kind::kOffer);
  auto sent = a.subscriber->post_send(forged("TDPUBXXX", 0, {7, 0, 0, 0, 1000, 0}), Kind::kRequest);
  ASSERT_TRUE(a.subscriber->wait(offer_in, Clock::now() + 5s));
  EXPECT_EQ(word_of(offer), 4u);  // refused
  EXPECT_EQ(field_of(offer, 16), 7u);
  // A second request before the first was answered: the subscriber is out of step.
  auto& b = this->connect();
  this->serve(core, b);
  at::Tensor offer_b = pub::message_buffer();
  auto offer_b_in = b.subscriber->post_recv(offer_b, Kind::kOffer);
  auto first = b.subscriber->post_send(
      forged("TDPUBREQ", 0, {1, 0, 0, 0, static_cast<uint64_t>(-1), 0}), Kind::kRequest);
  ASSERT_TRUE(b.subscriber->wait(first, Clock::now() + 5s));
  auto second = b.subscriber->post_send(
      forged("TDPUBREQ", 0, {2, 0, 0, 0, static_cast<uint64_t>(-1), 0}), Kind::kRequest);
  ASSERT_TRUE(eventually([&] {
    const auto s = core.stats();
    return s[0].lost && s[1].lost;
  }));
  const auto stats = core.stats();
  EXPECT_NE(stats[0].error.find("magic"), std::string::npos) << stats[0].error;
  EXPECT_NE(stats[1].error.find("request 2 came before request 1 was answered"), std::string::npos)
      << stats[1].error;
  for (const auto& s : stats) EXPECT_EQ(s.error.find("Exception raised from"), std::string::npos);
  // The publisher serves the others still.
  auto& c = this->connect();
  this->serve(core, c);
  core.publish(weights(2), std::nullopt, std::nullopt);
  const auto pulled = this->subscribe(c).pull(PullOptions{.timeout = 5s});
  ASSERT_TRUE(pulled.has_value());
  EXPECT_EQ(pulled->version, 1);
  // What the raw subscribers posted stays posted, its buffers alive, as the engine keeps its own.
  a.subscriber->keep({offer_in, sent});
  b.subscriber->keep({offer_b_in, first, second});
}

TYPED_TEST_P(PublicationContract, ARefusedOfferEndsTheLinkAndFreesItsSlot) {
  PublisherCore& core = this->publisher(1);
  auto& a = this->connect();
  auto& b = this->connect();
  this->serve(core, a);
  this->serve(core, b);
  SubscriberCore& small = this->subscribe(a, /*max_total_bytes=*/64);
  SubscriberCore& healthy = this->subscribe(b);
  core.publish(weights(1), std::nullopt, std::nullopt);
  TensorDict td = weights(0);
  const Outcome o = outcome_of([&] { small.pull(td, {.timeout = 5s}); });
  EXPECT_TRUE(o.raised("MalformedPeerDataError", "max_total_bytes")) << o;
  // Later pulls raise the same at once: the link ended.
  const auto t0 = Clock::now();
  EXPECT_EQ(outcome_of([&] { small.pull(td, {.timeout = 5s}); }).message, o.message);
  EXPECT_LT(Clock::now() - t0, 1s);
  EXPECT_TRUE(holds(td, 0));
  // The publisher was told: it serves that subscriber no more and its slot is free (with one
  // slot, a publish would otherwise wait for ever).
  EXPECT_TRUE(eventually([&] { return core.stats()[0].lost; }));
  const auto stats = core.stats();
  EXPECT_NE(stats[0].error.find("refused version 1"), std::string::npos) << stats[0].error;
  EXPECT_NE(stats[0].error.find("max_total_bytes"), std::string::npos) << stats[0].error;
  EXPECT_FALSE(stats[0].pinned.has_value());
  EXPECT_EQ(core.publish(weights(2), 3s, std::nullopt), 2);
  EXPECT_EQ(healthy.pull(td, {.timeout = 5s}), 2);
  EXPECT_TRUE(holds(td, 2));
}

TYPED_TEST_P(PublicationContract, ForgedOffersAreNamedAndRefused) {
  // The test is the publisher: an offer of epoch 0 is refused by name, and the refusal comes
  // back on the request's tag.
  auto& e = this->connect();
  SubscriberCore& sub = this->subscribe(e);
  at::Tensor request = pub::message_buffer();
  auto request_in = e.publisher->post_recv(request, Kind::kRequest);
  TensorDict td = weights(0);
  auto pull = std::async(std::launch::async,
                         [&] { return outcome_of([&] { sub.pull(td, {.timeout = 5s}); }); });
  ASSERT_TRUE(e.publisher->wait(request_in, Clock::now() + 5s));
  const uint64_t seq = field_of(request, 16);
  auto offer = e.publisher->post_send(forged("TDPUBOFR", 1, {seq, 0, 1, 16, 10, 1}), Kind::kOffer);
  const Outcome o = pull.get();
  EXPECT_TRUE(o.raised("MalformedPeerDataError", "epoch 0")) << o;
  at::Tensor refusal = pub::message_buffer();
  auto refusal_in = e.publisher->post_recv(refusal, Kind::kRequest);
  ASSERT_TRUE(e.publisher->wait(refusal_in, Clock::now() + 5s));
  EXPECT_EQ(word_of(refusal), 1u);  // an offer that breaks the protocol
  EXPECT_EQ(field_of(refusal, 16), seq);
  EXPECT_EQ(outcome_of([&] { sub.pull(td, {.timeout = 0ms}); }).message, o.message);
  EXPECT_TRUE(holds(td, 0));

  // An offer longer than 64 bytes is named too, not a crash.
  auto& f = this->connect();
  SubscriberCore& other = this->subscribe(f);
  at::Tensor request_f = pub::message_buffer();
  auto request_f_in = f.publisher->post_recv(request_f, Kind::kRequest);
  auto pull_f = std::async(std::launch::async,
                           [&] { return outcome_of([&] { other.pull(td, {.timeout = 5s}); }); });
  ASSERT_TRUE(f.publisher->wait(request_f_in, Clock::now() + 5s));
  auto long_offer = f.publisher->post_send(
      forged("TDPUBOFR", 2, {field_of(request_f, 16), 1, 0, 0, 0, 0}, 100), Kind::kOffer);
  const Outcome long_o = pull_f.get();
  EXPECT_EQ(long_o.kind, "MalformedPeerDataError") << long_o;
  EXPECT_TRUE(holds(td, 0));
  e.publisher->keep({offer, refusal_in});
  f.publisher->keep({request_f_in, long_offer});
}

TYPED_TEST_P(PublicationContract, ASubscriberThatLeavesWhileItWaitsIsForgotten) {
  PublisherCore& core = this->publisher(1);
  auto& a = this->connect();
  auto& b = this->connect();
  this->serve(core, a);
  this->serve(core, b);
  SubscriberCore& closing = this->subscribe(a);
  SubscriberCore& lost = this->subscribe(b);
  TensorDict td = weights(0);
  auto pull_a = std::async(std::launch::async,
                           [&] { return outcome_of([&] { closing.pull(td, {.timeout = 5s}); }); });
  TensorDict td_b = weights(0);
  auto pull_b = std::async(std::launch::async,
                           [&] { return outcome_of([&] { lost.pull(td_b, {.timeout = 5s}); }); });
  ASSERT_TRUE(eventually([&] {
    const auto s = core.stats();
    return s[0].waiting && s[1].waiting;
  }));
  // While their requests wait for a version: one closes its end, the other's connection goes.
  const auto t0 = Clock::now();
  a.close(Side::kSubscriber);
  b.faults->lose();
  EXPECT_TRUE(eventually([&] {
    const auto s = core.stats();
    return s[0].lost && s[1].lost && !s[0].waiting && !s[1].waiting;
  }));
  EXPECT_LT(Clock::now() - t0, 2s);  // a slice of the publisher's wait, not the request's
  closing.interrupt(true);
  pull_a.get();
  EXPECT_EQ(pull_b.get().kind, "PeerLostError");
  EXPECT_TRUE(holds(td, 0));
  EXPECT_TRUE(holds(td_b, 0));
}

TYPED_TEST_P(PublicationContract, ASubscriberThatLeavesWhileAVersionIsSentFreesItsSlot) {
  PublisherCore& core = this->publisher(1);
  auto& a = this->connect();
  auto& b = this->connect();
  auto& c = this->connect();
  this->serve(core, a);
  this->serve(core, b);
  this->serve(core, c);
  SubscriberCore& closing = this->subscribe(a);
  SubscriberCore& lost = this->subscribe(b);
  SubscriberCore& healthy = this->subscribe(c);
  TensorDict td = weights(0);
  for (auto* e : {&a, &b}) e->faults->stall(Kind::kData);
  core.publish(weights(1), std::nullopt, std::nullopt);
  EXPECT_FALSE(closing.pull(td, {.timeout = 200ms}).has_value());
  EXPECT_FALSE(lost.pull(td, {.timeout = 200ms}).has_value());
  ASSERT_TRUE(eventually([&] {
    const auto s = core.stats();
    return s[0].pinned == 1 && s[1].pinned == 1;
  }));
  a.close(Side::kSubscriber);
  b.faults->lose();
  EXPECT_TRUE(eventually([&] {
    const auto s = core.stats();
    return s[0].lost && s[1].lost && !s[0].pinned && !s[1].pinned;
  }));
  // The one slot is free: the next version goes to the healthy subscriber.
  EXPECT_EQ(core.publish(weights(2), 3s, std::nullopt), 2);
  EXPECT_EQ(healthy.pull(td, {.timeout = 5s}), 2);
  EXPECT_TRUE(holds(td, 2));
  EXPECT_EQ(outcome_of([&] { lost.pull(td, {.timeout = 1s}); }).kind, "PeerLostError");
}

TYPED_TEST_P(PublicationContract, AStalledSubscriberPinsOneSlotAndCostsTheOthersNothing) {
  PublisherCore& core = this->publisher(2);
  auto& a = this->connect();
  auto& b = this->connect();
  this->serve(core, a);
  this->serve(core, b);
  SubscriberCore& stalled = this->subscribe(a);
  SubscriberCore& healthy = this->subscribe(b);
  a.faults->stall(Kind::kData);
  core.publish(weights(1), std::nullopt, std::nullopt);
  TensorDict td_a = weights(0);
  EXPECT_FALSE(stalled.pull(td_a, {.timeout = 200ms}).has_value());
  ASSERT_TRUE(eventually([&] { return core.stats()[0].pinned == 1; }));
  TensorDict td_b = weights(0);
  for (int v = 2; v <= 4; ++v) {
    EXPECT_EQ(core.publish(weights(v), 2s, std::nullopt), v);  // the other slot
    EXPECT_EQ(healthy.pull(td_b, {.timeout = 5s}), v);
    EXPECT_TRUE(holds(td_b, v));
  }
  EXPECT_EQ(core.stats()[0].pinned, 1);
  // Going on, it completes the version it was receiving, whole, then takes the newest.
  a.faults->release();
  EXPECT_EQ(stalled.pull(td_a, {.timeout = 5s}), 1);
  EXPECT_TRUE(holds(td_a, 1));
  EXPECT_EQ(stalled.pull(td_a, {.timeout = 5s}), 4);
  EXPECT_TRUE(holds(td_a, 4));
}

TYPED_TEST_P(PublicationContract, PinnedSlotsAreNamedByPublish) {
  PublisherCore& core = this->publisher(1);
  auto& e = this->connect();
  this->serve(core, e);
  SubscriberCore& sub = this->subscribe(e);
  e.faults->stall(Kind::kData);
  core.publish(weights(1), std::nullopt, std::nullopt);
  TensorDict td = weights(0);
  EXPECT_FALSE(sub.pull(td, {.timeout = 200ms}).has_value());
  ASSERT_TRUE(eventually([&] { return core.stats()[0].pinned == 1; }));
  const auto t0 = Clock::now();
  const Outcome o = outcome_of([&] { core.publish(weights(2), 200ms, std::nullopt); });
  EXPECT_GE(Clock::now() - t0, 200ms);
  EXPECT_TRUE(o.raised("TimeoutError", "every one of the 1 slots is pinned")) << o;
  EXPECT_TRUE(o.raised("TimeoutError", c10::str(e.publisher->peer(), " (version 1)"))) << o;
  e.faults->release();
  EXPECT_EQ(sub.pull(td, {.timeout = 5s}), 1);
  EXPECT_EQ(core.publish(weights(2), 3s, std::nullopt), 2);
}

TYPED_TEST_P(PublicationContract, APublisherThatClosesAnswersTheWaitingPulls) {
  PublisherCore& core = this->publisher(1);
  auto& e = this->connect();
  this->serve(core, e);
  SubscriberCore& sub = this->subscribe(e);
  TensorDict td = weights(0);
  auto pull = std::async(std::launch::async,
                         [&] { return outcome_of([&] { sub.pull(td, {.timeout = 10s}); }); });
  ASSERT_TRUE(eventually([&] { return core.stats()[0].waiting; }));
  const auto t0 = Clock::now();
  this->stop(core);
  const Outcome o = pull.get();
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_TRUE(o.raised("NoPublisherError", "closed")) << o;
  EXPECT_TRUE(sub.publisher_closed());
  EXPECT_TRUE(holds(td, 0));
  EXPECT_EQ(outcome_of([&] { core.publish(weights(1), std::nullopt, std::nullopt); }).kind,
            "c10::Error");
}

TYPED_TEST_P(PublicationContract, LargeVersionsGoToOneSubscriberAtATimeWithinTheirTurns) {
  // docs/publication.md: a version of 8 MiB and up goes to one subscriber at a time; each
  // send's turn is twice the last such send's time, within 5 to 100 ms, and a send past its
  // turn does not hold the others back.
  PublisherCore& core = this->publisher(3);
  auto& a = this->connect();
  auto& b = this->connect();
  auto& c = this->connect();
  for (auto* e : {&a, &b, &c}) this->serve(core, *e);
  SubscriberCore& sa = this->subscribe(a);
  SubscriberCore& sb = this->subscribe(b);
  SubscriberCore& sc = this->subscribe(c);
  TensorDict ta = large(0), tb = large(0), tc = large(0);
  int64_t version = 0;

  // One at a time: three pulls at once, each send taking 20 ms (the turns are 40 ms and more):
  // no send starts before every earlier one has ended or spent its turn.
  for (auto* e : {&a, &b, &c}) e->faults->delay(Kind::kData, 20ms);
  version = core.publish(large(1), std::nullopt, std::nullopt);
  {
    auto fa = std::async(std::launch::async, [&] { return sa.pull(ta, {.timeout = 10s}); });
    auto fb = std::async(std::launch::async, [&] { return sb.pull(tb, {.timeout = 10s}); });
    auto fc = std::async(std::launch::async, [&] { return sc.pull(tc, {.timeout = 10s}); });
    EXPECT_EQ(fa.get(), version);
    EXPECT_EQ(fb.get(), version);
    EXPECT_EQ(fc.get(), version);
  }
  // The subscribers have their data before the publisher sees its sends taken: wait for that.
  using End = typename TestFixture::End;
  const auto taken = [](End& e) {
    return eventually(
        [&] { return e.faults->data_sends().back().taken != Clock::time_point::max(); });
  };
  std::vector<Faults::Send> sends;
  for (auto* e : {&a, &b, &c}) {
    ASSERT_TRUE(taken(*e));
    const auto s = e->faults->data_sends();
    ASSERT_EQ(s.size(), 1u);
    sends.push_back(s.back());
    e->faults->release();
  }
  // (An answer starts with its offer: its turn is counted from there.)
  std::sort(sends.begin(), sends.end(),
            [](const auto& x, const auto& y) { return x.offered < y.offered; });
  for (size_t i = 1; i < sends.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      const auto free_at = std::min(sends[j].taken, sends[j].offered + 40ms);
      EXPECT_GE(ms(sends[i].offered - free_at), -3.0)
          << "send " << i << " started " << ms(free_at - sends[i].offered) << " ms before send "
          << j << " ended or spent its turn";
    }
  }

  // One large send by a that takes `d`, then one that a never takes (stalled): b's send starts
  // a turn after a's, while a's is still pinned. Returns that gap.
  const auto gap_after = [&](Clock::duration d) -> std::optional<Clock::duration> {
    a.faults->delay(Kind::kData, d);
    version = core.publish(large(static_cast<double>(version + 1)), 3s, std::nullopt);
    if (sa.pull(ta, {.timeout = 10s}) != version || !taken(a)) return std::nullopt;
    a.faults->release();
    a.faults->stall(Kind::kData);
    version = core.publish(large(static_cast<double>(version + 1)), 3s, std::nullopt);
    const size_t before = a.faults->data_sends().size();
    auto fa = std::async(std::launch::async, [&] { return sa.pull(ta, {.timeout = 10s}); });
    if (!a.faults->await_data_sends(before + 1, 5s)) return std::nullopt;
    const auto a_start = a.faults->data_sends().back().offered;
    const bool b_pulled = sb.pull(tb, {.timeout = 5s}) == version;  // while a's is stalled
    const auto b_start = b.faults->data_sends().back().offered;
    EXPECT_EQ(a.faults->data_sends().back().taken, Clock::time_point::max());
    a.faults->release();
    if (fa.get() != version || !b_pulled || !holds(tb, static_cast<double>(version))) {
      return std::nullopt;
    }
    return b_start - a_start;
  };
  // Twice the last send's time: 30 ms, so at least 60 ms.
  const auto twice = gap_after(30ms);
  ASSERT_TRUE(twice.has_value());
  EXPECT_GE(*twice, 60ms - 3ms) << ms(*twice);
  EXPECT_LT(*twice, 100ms + 200ms) << ms(*twice);
  // At most 100 ms: twice 150 ms would be 300.
  const auto most = gap_after(150ms);
  ASSERT_TRUE(most.has_value());
  EXPECT_GE(*most, 100ms - 3ms) << ms(*most);
  EXPECT_LT(*most, 250ms) << ms(*most);
  // At least 5 ms, however fast the last send was.
  const auto least = gap_after(0ms);
  ASSERT_TRUE(least.has_value());
  EXPECT_GE(*least, 5ms - 3ms) << ms(*least);
  EXPECT_LT(*least, 100ms + 200ms) << ms(*least);
}

// ---- shared memory (docs/publication.md "Shared memory", docs/wire-format.md §9.8) -----------
// In one process the publisher's segments map as in another on the same host (/proc/<pid>/fd).

constexpr auto kAuto = pub::Transport::kAuto;

/// Every leaf of `td` holds `v`, element by element, as a double.
inline bool all_equal(const TensorDict& td, double v) { return holds(td, v); }

TYPED_TEST_P(PublicationContract, OverSharedMemoryPullsSendNoMessageAndAreNeverTorn) {
  PublisherCore& core = this->publisher(3, kAuto);
  auto& e = this->connect();
  this->serve(core, e);
  SubscriberCore& sub = this->subscribe(e, int64_t{1} << 30, kAuto);
  core.publish(weights(1), std::nullopt, std::nullopt);
  TensorDict td = weights(0);
  ASSERT_EQ(sub.pull(td, {.timeout = 5s}), 1);
  EXPECT_EQ(sub.transport(), "shm");
  EXPECT_TRUE(eventually([&] { return core.stats()[0].transport == "shm"; }));
  // From here no message moves: requests are stalled, and every pull still takes its version.
  e.faults->stall(Kind::kRequest);
  e.faults->stall(Kind::kOffer);
  auto publisher = std::async(std::launch::async, [&] {
    return outcome_of([&] {
      for (int v = 2; v <= 400; ++v) core.publish(weights(v), 5s, std::nullopt);
    });
  });
  int64_t last = 1, pulls = 0, torn = 0;
  TensorDict views = weights(0);
  while (last < 400) {
    const bool zero_copy = (pulls % 2) == 1;
    TensorDict& target = zero_copy ? views : td;
    const auto v = sub.pull(target, {.timeout = 5s, .zero_copy = zero_copy});
    if (!v.has_value()) break;
    EXPECT_GT(*v, last);
    torn += !all_equal(target, static_cast<double>(*v));
    last = std::max(last, *v);
    ++pulls;
  }
  const Outcome published = publisher.get();
  EXPECT_EQ(published.kind, "") << published;
  EXPECT_EQ(torn, 0);
  EXPECT_EQ(last, 400);
  const auto stats = core.stats();
  EXPECT_EQ(stats[0].version, 400);
  EXPECT_EQ(stats[0].pulls, pulls + 1);
  EXPECT_FALSE(stats[0].lost) << stats[0].error;
  e.faults->release();
  // Lost, it keeps what it pulled in stats() (its entry in shared memory cleared).
  e.faults->lose();
  EXPECT_TRUE(eventually([&] {
    const auto s = core.stats()[0];
    return s.lost && s.version == 400 && s.pulls == pulls + 1 && !s.pinned;
  }));
}

TYPED_TEST_P(PublicationContract, AZeroCopyPullPinsItsSlotUntilTheNextPullOrRelease) {
  PublisherCore& core = this->publisher(1, kAuto);
  auto& e = this->connect();
  this->serve(core, e);
  SubscriberCore& sub = this->subscribe(e, int64_t{1} << 30, kAuto);
  core.publish(weights(1), std::nullopt, std::nullopt);
  TensorDict td = weights(0);
  const at::Tensor bias = td.get("bias").tensor();
  ASSERT_EQ(sub.pull(td, {.timeout = 5s, .zero_copy = true}), 1);
  // The same tensor object, now viewing the slot.
  EXPECT_TRUE(td.get("bias").tensor().is_same(bias));
  EXPECT_TRUE(holds(td, 1));
  EXPECT_EQ(core.stats()[0].pinned, 1);
  // The only slot pinned: publish waits, then names the subscriber.
  const Outcome o = outcome_of([&] { core.publish(weights(2), 100ms, std::nullopt); });
  EXPECT_TRUE(o.raised("TimeoutError", "(version 1, in shared memory)")) << o;
  EXPECT_TRUE(holds(td, 1));  // never rewritten while pinned
  sub.release_pin();
  EXPECT_FALSE(core.stats()[0].pinned.has_value());
  EXPECT_EQ(core.publish(weights(2), 1s, std::nullopt), 2);
  ASSERT_EQ(sub.pull(td, {.timeout = 5s, .zero_copy = true}), 2);
  EXPECT_EQ(sub.pull(td, {.timeout = 0ms}), std::nullopt);  // a poll keeps the pin
  EXPECT_EQ(core.stats()[0].pinned, 2);
  sub.release_pin();
  core.publish(weights(3), 1s, std::nullopt);
  // A copying pull into views of a slot gives the leaves memory of their own first.
  ASSERT_EQ(sub.pull(td, {.timeout = 5s}), 3);
  EXPECT_TRUE(holds(td, 3));
  EXPECT_FALSE(core.stats()[0].pinned.has_value());
  core.publish(weights(4), 1s, std::nullopt);
  EXPECT_TRUE(holds(td, 3));
  // A pull into a new TensorDict: zero-copy views the slot and pins it.
  auto pulled = sub.pull({.timeout = 5s, .zero_copy = true});
  ASSERT_TRUE(pulled.has_value());
  EXPECT_EQ(pulled->version, 4);
  EXPECT_TRUE(holds(pulled->td, 4));
  EXPECT_EQ(core.stats()[0].pinned, 4);
}

TYPED_TEST_P(PublicationContract, ASubscriberThatCannotMapFallsBackAndSaysWhy) {
  PublisherCore& core = this->publisher(2, kAuto);
  auto& a = this->connect();
  auto& b = this->connect();
  this->serve(core, a);
  this->serve(core, b);
  core.publish(weights(1), std::nullopt, std::nullopt);
  ::setenv("TENSORDICT_TEST_SHM_UNMAPPABLE", "1", 1);
  SubscriberCore& refused = this->subscribe(a, int64_t{1} << 30, kAuto);
  TensorDict td = weights(0);
  const auto v = refused.pull(td, {.timeout = 5s});
  ::unsetenv("TENSORDICT_TEST_SHM_UNMAPPABLE");
  EXPECT_EQ(v, 1);
  EXPECT_TRUE(holds(td, 1));
  EXPECT_EQ(refused.transport(),
            "socket (shared memory refused: TENSORDICT_TEST_SHM_UNMAPPABLE is set (a test hook))");
  EXPECT_TRUE(eventually([&] {
    return core.stats()[0].transport ==
           "socket (shared memory refused: the subscriber could not open or map the segments)";
  })) << core.stats()[0].transport;
  core.publish(weights(2), std::nullopt, std::nullopt);
  EXPECT_EQ(refused.pull(td, {.timeout = 5s}), 2);
  // A subscriber that insists on shared memory where it gets none raises, naming why.
  ::setenv("TENSORDICT_TEST_SHM_UNMAPPABLE", "1", 1);
  SubscriberCore& strict = this->subscribe(b, int64_t{1} << 30, pub::Transport::kShm);
  const Outcome o = outcome_of([&] { strict.pull(td, {.timeout = 5s}); });
  ::unsetenv("TENSORDICT_TEST_SHM_UNMAPPABLE");
  EXPECT_TRUE(o.raised("c10::Error", "transport=\"shm\", but socket (shared memory refused: "))
      << o;
  EXPECT_TRUE(holds(td, 2));
}

TYPED_TEST_P(PublicationContract, TransportSocketIsNeverSharedMemory) {
  PublisherCore& core = this->publisher(2);  // kSocket
  auto& a = this->connect();
  auto& b = this->connect();
  this->serve(core, a);
  this->serve(core, b);
  SubscriberCore& asks = this->subscribe(a, int64_t{1} << 30, kAuto);
  SubscriberCore& plain = this->subscribe(b);
  core.publish(weights(1), std::nullopt, std::nullopt);
  TensorDict td = weights(0);
  EXPECT_EQ(asks.pull(td, {.timeout = 5s}), 1);
  EXPECT_EQ(asks.transport(), "socket (shared memory refused: the publisher offers none)");
  EXPECT_EQ(plain.pull(td, {.timeout = 5s}), 1);
  EXPECT_EQ(plain.transport(), "socket");
  EXPECT_EQ(core.stats()[0].transport,
            "socket (shared memory refused: the publisher's transport is \"socket\")");
  EXPECT_EQ(core.stats()[1].transport, "socket");
}

TYPED_TEST_P(PublicationContract, OverSharedMemoryCloseAndGrowthAreSeen) {
  PublisherCore& core = this->publisher(2, kAuto);
  auto& e = this->connect();
  this->serve(core, e);
  SubscriberCore& sub = this->subscribe(e, int64_t{1} << 30, kAuto);
  core.publish(weights(1), std::nullopt, std::nullopt);
  auto first = sub.pull({.timeout = 5s, .zero_copy = true});
  ASSERT_TRUE(first.has_value());
  ASSERT_EQ(sub.transport(), "shm");
  // A version larger than the slots: a new segment, which the subscriber maps (the link once).
  core.publish(large(2), std::nullopt, std::nullopt);
  auto second = sub.pull({.timeout = 5s});
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->version, 2);
  EXPECT_TRUE(holds(second->td, 2));
  EXPECT_EQ(sub.transport(), "shm");
  EXPECT_TRUE(holds(first->td, 1));  // the old segment's views stay readable, never rewritten
  // A pull waiting on shared memory sees the publisher close.
  auto pull = std::async(std::launch::async,
                         [&] { return outcome_of([&] { sub.pull({.timeout = 10s}); }); });
  // Its wait shows in stats() as a request held over a link does.
  ASSERT_TRUE(eventually([&] { return core.stats()[0].waiting; }));
  const auto t0 = Clock::now();
  this->stop(core);
  const Outcome o = pull.get();
  EXPECT_LT(Clock::now() - t0, 1s);
  EXPECT_TRUE(o.raised("NoPublisherError", "closed")) << o;
  EXPECT_TRUE(sub.publisher_closed());
}

REGISTER_TYPED_TEST_SUITE_P(
    PublicationContract, VersionsAreWholeAndIncreasing,
    OverSharedMemoryPullsSendNoMessageAndAreNeverTorn,
    AZeroCopyPullPinsItsSlotUntilTheNextPullOrRelease, ASubscriberThatCannotMapFallsBackAndSaysWhy,
    TransportSocketIsNeverSharedMemory, OverSharedMemoryCloseAndGrowthAreSeen,
    TimeoutsAndPollsLeaveTheTensorDictUnchanged, ANewPublisherOnTheSameLinkIsANewEpoch,
    MinVersionWaitsForThatVersion, NoPublisherIsNamedAndTheRequestStaysQueued,
    RefusedRequestsEndTheSubscription, ARefusedOfferEndsTheLinkAndFreesItsSlot,
    ForgedOffersAreNamedAndRefused, ASubscriberThatLeavesWhileItWaitsIsForgotten,
    ASubscriberThatLeavesWhileAVersionIsSentFreesItsSlot,
    AStalledSubscriberPinsOneSlotAndCostsTheOthersNothing, PinnedSlotsAreNamedByPublish,
    APublisherThatClosesAnswersTheWaitingPulls,
    LargeVersionsGoToOneSubscriberAtATimeWithinTheirTurns);

// ---- relays (docs/wire-format.md §9.9) ---------------------------------------------------------

/// The links of one publication whose subscribers can reach each other: `n` endpoints, 0 the
/// publisher, 1 to n - 1 its subscribers (each also its rank: SubscriberStats::rank and what a
/// route names). link(i, j) is i's link to j, for every ordered pair i != j; the publisher
/// serves subscriber r over link(0, r) and r pulls over link(r, 0); link(r, q) between two
/// subscribers carries relayed pieces (Kind::kPiece) both ways. Called once per ordered pair.
struct Mesh {
  std::function<std::shared_ptr<pub::Link>(int from, int to)> link;
  /// What the links need alive (the transport's objects).
  std::shared_ptr<void> resources{};
};

/// A transport whose subscribers can reach each other: it makes a Mesh.
template <typename T>
concept HasMesh = requires(T t) {
  { t.mesh(4) } -> std::same_as<Mesh>;
};

/// A version of 2 MiB, every element distinct within it and from every other version's: a piece
/// of the wrong version, or at the wrong place, is never equal to the right one.
inline TensorDict relayed(int64_t v) {
  TensorDict inner({{"b", at::arange(int64_t{131072}, at::kInt) + static_cast<int>(v * 1000003)}},
                   {});
  return TensorDict({{"w", at::arange(int64_t{196608}, at::kDouble) + static_cast<double>(v) * 1e6},
                     {"inner", inner}},
                    {});
}

/// Whether every leaf of `expected` is in `td`, exactly (dtype, shape, bytes).
inline bool same(const TensorDict& td, const TensorDict& expected) {
  if (td.entries().size() != expected.entries().size()) return false;
  for (const auto& [key, value] : expected.entries()) {
    const auto* got = td.find(key);
    if (got == nullptr || got->is_tensordict() != value.is_tensordict()) return false;
    if (value.is_tensordict()) {
      if (!same(got->tensordict(), value.tensordict())) return false;
    } else if (got->tensor().scalar_type() != value.tensor().scalar_type() ||
               !got->tensor().equal(value.tensor())) {
      return false;
    }
  }
  return true;
}

template <typename Transport>
class RelayContract : public ::testing::Test {
 protected:
  static constexpr int kSubscribers = 3;
  static constexpr int kEnds = kSubscribers + 1;

  void SetUp() override {
    mesh_ = transport_.mesh(kEnds);
    for (int i = 0; i < kEnds; ++i) {
      for (int j = i + 1; j < kEnds; ++j)
        faults_[i][j] = faults_[j][i] = std::make_shared<Faults>();
    }
  }

  /// The faults of the connection between endpoints `i` and `j` (both directions).
  Faults& faults(int64_t i, int64_t j) { return *faults_[i][j]; }

  /// i's link to j, made once, wrapped in the FaultyLink of their connection (the lower
  /// endpoint its publisher's side).
  std::shared_ptr<pub::Link> link(int i, int j) {
    std::lock_guard<std::mutex> lock(links_mutex_);
    auto& l = links_[i][j];
    if (!l) {
      l = std::make_shared<FaultyLink>(mesh_.link(i, j), faults_[i][j],
                                       i < j ? Side::kPublisher : Side::kSubscriber);
    }
    return l;
  }

  /// A publisher whose route is a chain (or `routing`'s), serving every subscriber (rank r over
  /// link(0, r)), each on a thread of its own; then the subscribers, each relaying over its
  /// links to the others.
  void start(pub::Routing routing = pub::Routing::kChain) {
    core_ = std::make_unique<PublisherCore>(2, pub::Transport::kSocket, routing);
    for (int r = 1; r < kEnds; ++r) {
      SubscriberStats stats;
      stats.rank = r;
      stats.peer = c10::str("subscriber ", r);
      PublisherCore::Subscription& s = core_->add(std::move(stats));
      threads_.emplace_back([core = core_.get(), &s, l = link(0, r)] { core->serve(s, *l); });
    }
    for (int r = 1; r < kEnds; ++r) {
      pub::RelayLinks relays = [this, r](int64_t rank) -> std::shared_ptr<pub::Link> {
        TD_CHECK_PEER(rank >= 1 && rank < kEnds && rank != r, "the route names rank ", rank,
                      ", not another subscriber");
        return link(r, static_cast<int>(rank));
      };
      subscribers_.push_back(std::make_unique<SubscriberCore>(
          link(r, 0), c10::str("Subscriber.pull (", Transport::kName, ", rank ", r, ")"),
          int64_t{1} << 30, pub::Transport::kSocket, std::move(relays)));
    }
  }

  SubscriberCore& subscriber(int64_t rank) { return *subscribers_[static_cast<size_t>(rank - 1)]; }
  PublisherCore& core() { return *core_; }

  /// One version through the chain: every subscriber pulls on a thread of its own, the version
  /// is published once every pull waits for it, and each pull must bring it whole within
  /// `bound`. What each pull returned (ranks 1..), and how long the slowest took.
  struct Round {
    std::vector<std::optional<tensordict::Pulled>> pulled;
    std::vector<Outcome> failed;
    Clock::duration took{};
  };
  Round round(int64_t v, Clock::duration bound = 5s) {
    Round out;
    out.pulled.resize(kSubscribers);
    out.failed.resize(kSubscribers);
    std::vector<std::thread> pulls;
    for (int i = 0; i < kSubscribers; ++i) {
      pulls.emplace_back([&, i] {
        out.failed[i] = outcome_of([&] {
          out.pulled[i] = subscribers_[i]->pull(
              {.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(bound)});
        });
      });
    }
    const bool all_waiting = eventually([&] {
      const auto stats = core_->stats();
      return std::all_of(stats.begin(), stats.end(), [](const auto& s) { return s.waiting; });
    });
    const auto t0 = Clock::now();
    if (all_waiting) core_->publish(relayed(v), std::nullopt, std::nullopt);
    for (auto& t : pulls) t.join();
    out.took = Clock::now() - t0;
    EXPECT_TRUE(all_waiting) << "the pulls of version " << v << " did not all wait for it";
    for (int i = 0; i < kSubscribers; ++i) {
      EXPECT_TRUE(out.failed[i].kind.empty()) << "rank " << i + 1 << ": " << out.failed[i];
      EXPECT_TRUE(out.pulled[i].has_value()) << "rank " << i + 1 << " got nothing of version " << v;
      if (!out.pulled[i]) continue;
      EXPECT_EQ(out.pulled[i]->version, v) << "rank " << i + 1;
      EXPECT_TRUE(same(out.pulled[i]->td, relayed(v)))
          << "rank " << i + 1 << ": version " << v << " is not whole and exact";
    }
    return out;
  }

  /// The chain of the last relayed version, from the publisher's stats: ranks from the head
  /// (relayed_from -1) on, each the child of the one before; empty when they do not form one.
  std::vector<int64_t> chain() const {
    const auto stats = core_->stats();
    std::vector<int64_t> order;
    int64_t parent = -1;
    for (size_t n = 0; n < stats.size(); ++n) {
      auto next = std::find_if(stats.begin(), stats.end(),
                               [&](const auto& s) { return s.relayed_from == parent; });
      if (next == stats.end()) break;
      order.push_back(next->rank);
      parent = next->rank;
    }
    return order;
  }

  void TearDown() override {
    if (core_) core_->close();
    for (auto& t : threads_) t.join();
    threads_.clear();
    for (auto& s : subscribers_) {
      if (auto left = s->release()) leftovers().push_back(std::move(left));
    }
    subscribers_.clear();
    core_.reset();
    for (auto& row : links_) {
      for (auto& l : row) l.reset();
    }
    mesh_ = {};
  }

  Transport transport_;
  Watchdog watchdog_{std::chrono::seconds(30)};

 private:
  Mesh mesh_;
  std::shared_ptr<Faults> faults_[kEnds][kEnds];
  std::mutex links_mutex_;
  std::shared_ptr<pub::Link> links_[kEnds][kEnds];
  std::unique_ptr<PublisherCore> core_;
  std::vector<std::thread> threads_;
  std::vector<std::unique_ptr<SubscriberCore>> subscribers_;
};

TYPED_TEST_SUITE_P(RelayContract);

inline std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += (out.empty() ? "" : " | ") + l;
  return out;
}

TYPED_TEST_P(RelayContract, ThreeSubscribersTakeEachVersionWholeThroughAChain) {
  this->start();
  for (int64_t v = 1; v <= 4; ++v) {
    const auto r = this->round(v);
    // One copy left the publisher: every subscriber's pieces came along one chain of them.
    // The three are of one host (this process): once the publisher knows it (version 2), the
    // first writes each version into its slots for the others, and once it knows where they
    // are (version 3), the others read the version there.
    const auto order = this->chain();
    if (v <= 2) {
      EXPECT_EQ(order.size(), 3u) << "version " << v << ": the ranks' relayed_from form no chain";
    } else {
      ASSERT_FALSE(order.empty()) << "version " << v << ": no subscriber takes it first";
      for (const auto& s : this->core().stats()) {
        if (s.rank != order[0]) {
          EXPECT_EQ(s.relayed_from, order[0]) << s.peer;
        }
      }
    }
    // The publisher counts a version once it sees its answer's last message taken: for a reader
    // of slots, a moment after its pull may have returned.
    EXPECT_TRUE(eventually([&] {
      const auto stats = this->core().stats();
      return std::all_of(stats.begin(), stats.end(), [&](const auto& s) { return s.version == v; });
    })) << "version "
        << v << " is not counted for every subscriber";
    for (const auto& s : this->core().stats()) {
      EXPECT_TRUE(s.routed_around.empty()) << s.peer << ": " << s.routed_around;
    }
    for (int64_t rank = 1; rank <= 3; ++rank) {
      EXPECT_TRUE(this->subscriber(rank).routed_around().empty())
          << "rank " << rank << ": " << joined(this->subscriber(rank).routed_around());
    }
    std::printf("[ relay    ] %s: version %lld through %zu ranks in %.1f ms\n", TypeParam::kName,
                static_cast<long long>(v), order.size(), ms(r.took));
  }
}

TYPED_TEST_P(RelayContract, AStalledRelayIsRoutedAroundWithinTheVersion) {
  this->start();
  this->round(1);
  const auto order = this->chain();
  ASSERT_EQ(order.size(), 3u);
  const int64_t relay = order[0], child = order[1];
  // The first relay's link to its child takes no piece any more: the child holds, then resumes
  // at the publisher from the piece it reached, within the version.
  this->faults(relay, child).stall(Kind::kPiece);
  const auto r2 = this->round(2, 5s);
  EXPECT_LT(r2.took, 3s) << "version 2 took " << ms(r2.took) << " ms around the stalled relay";
  const auto& around = this->subscriber(child).routed_around();
  ASSERT_EQ(around.size(), 1u) << joined(around);
  EXPECT_NE(around[0].find(c10::str("rank ", relay, " ")), std::string::npos) << around[0];
  EXPECT_NE(around[0].find("of version 2"), std::string::npos) << around[0];
  const auto stats = this->core().stats();
  EXPECT_FALSE(stats[relay - 1].routed_around.empty())
      << "the publisher does not name rank " << relay;
  EXPECT_NE(stats[relay - 1].routed_around.find(c10::str("subscriber ", child, " left it")),
            std::string::npos)
      << stats[relay - 1].routed_around;
  for (const auto& s : stats) {
    if (s.rank != relay) {
      EXPECT_TRUE(s.routed_around.empty()) << s.peer << ": " << s.routed_around;
    }
  }
  // Version 3 (the stall still on): the relay routed around is a leaf, nobody's parent.
  const auto r3 = this->round(3);
  for (const auto& s : this->core().stats()) {
    EXPECT_NE(s.relayed_from, std::optional<int64_t>(relay))
        << s.peer << " takes from rank " << relay;
  }
  EXPECT_EQ(this->subscriber(child).routed_around().size(), 1u)
      << joined(this->subscriber(child).routed_around());
  std::printf("[ relay    ] %s: version 2 around rank %lld in %.1f ms, version 3 in %.1f ms\n",
              TypeParam::kName, static_cast<long long>(relay), ms(r2.took), ms(r3.took));
}

TYPED_TEST_P(RelayContract, AForgingRelayIsCaughtAndTheChildCompletesFromThePublisher) {
  this->start();
  this->round(1);
  const auto order = this->chain();
  ASSERT_EQ(order.size(), 3u);
  const int64_t relay = order[0], child = order[1];
  // Between the first relay and its child, the first piece of version 2 arrives with one byte
  // changed: a relay that forwards what it did not get (or a link that breaks bytes).
  std::atomic<int> forged{0};
  this->faults(relay, child).tamper(Kind::kPiece, [&](at::Tensor& m) {
    uint8_t* p = m.data_ptr<uint8_t>();
    const bool piece = p[12] == 0 && p[13] == 0 && p[14] == 0 && p[15] == 0;  // not a hold
    if (piece && publication_test::get_u64(p + 24) == 2 && forged.fetch_add(1) == 0) {
      p[pub::kPieceHeaderBytes + 5] ^= 0x5A;
    }
  });
  const auto r2 = this->round(2);
  EXPECT_EQ(forged.load() > 0, true)
      << "no piece of version 2 went from rank " << relay << " to rank " << child;
  const auto& around = this->subscriber(child).routed_around();
  ASSERT_EQ(around.size(), 1u) << joined(around);
  EXPECT_NE(around[0].find(c10::str("rank ", relay, " ")), std::string::npos) << around[0];
  EXPECT_NE(around[0].find("checksum"), std::string::npos) << around[0];
  EXPECT_NE(this->core().stats()[relay - 1].routed_around.find(
                c10::str("subscriber ", child,
                         " left it at piece 0 of version 2: it sent a piece "
                         "that is not the version's")),
            std::string::npos)
      << this->core().stats()[relay - 1].routed_around;
  // The child forwarded only what it checked: its own child saw nothing forged.
  EXPECT_TRUE(this->subscriber(order[2]).routed_around().empty())
      << joined(this->subscriber(order[2]).routed_around());
  this->faults(relay, child).tamper(Kind::kPiece, nullptr);
  this->round(3);
  std::printf("[ relay    ] %s: version 2 with a forged piece in %.1f ms\n", TypeParam::kName,
              ms(r2.took));
}

TYPED_TEST_P(RelayContract, AResumeThatNamesAnotherRankThanItsParentBlamesNobody) {
  this->start();
  this->round(1);
  const auto order = this->chain();
  ASSERT_EQ(order.size(), 3u);
  const int64_t relay = order[0], child = order[1], last = order[2];
  // The child resumes around its stalled parent, but its resume, rewritten on the way, names
  // the chain's last rank (what a hostile subscriber would say): the publisher answers it and
  // blames nobody on its word.
  this->faults(relay, child).stall(Kind::kPiece);
  std::atomic<int> rewritten{0};
  this->faults(0, child).tamper(Kind::kRequest, [&](at::Tensor& m) {
    uint8_t* p = m.data_ptr<uint8_t>();
    const bool resume = p[12] == 0 && p[13] == 0x08 && p[14] == 0 && p[15] == 0;  // 0x800
    if (resume) {
      publication_test::put_u64(p + 56, static_cast<uint64_t>(last));
      rewritten.fetch_add(1);
    }
  });
  const auto r2 = this->round(2, 5s);
  EXPECT_GT(rewritten.load(), 0) << "rank " << child << " sent no resume";
  for (const auto& s : this->core().stats()) {
    EXPECT_TRUE(s.routed_around.empty()) << s.peer << ": " << s.routed_around;
  }
  this->faults(relay, child).release();
  this->faults(0, child).tamper(Kind::kRequest, nullptr);
  const auto r3 = this->round(3);
  std::printf(
      "[ relay    ] %s: version 2 with a resume naming rank %lld in %.1f ms, version 3 "
      "in %.1f ms\n",
      TypeParam::kName, static_cast<long long>(last), ms(r2.took), ms(r3.took));
}

TYPED_TEST_P(RelayContract, TwoTreesCarryHalfEachAndAStalledLaneResumesAlone) {
  // Route "tree": version 1, before the publisher knows that the three share a host, goes down
  // two trees over them, half of its pieces each (Kind::kPiece, Kind::kPiece2), each
  // subscriber taking both halves at once. Every relay's second-lane pieces stall: the second
  // tree's children leave its root for the publisher in that lane alone, and the version is
  // whole within it; the first lane's parents are blamed by nobody.
  this->start(pub::Routing::kTree);
  for (int64_t i = 1; i < this->kEnds; ++i) {
    for (int64_t j = i + 1; j < this->kEnds; ++j) this->faults(i, j).stall(Kind::kPiece2);
  }
  const auto r1 = this->round(1, 5s);
  EXPECT_LT(r1.took, 3s) << "version 1 took " << ms(r1.took) << " ms around the stalled lane";
  const auto stats = this->core().stats();
  std::map<int64_t, int64_t> first, second;
  for (const auto& s : stats) {
    ASSERT_TRUE(s.relayed_from && s.relayed_second) << s.peer << " was not in two trees";
    first[s.rank] = *s.relayed_from;
    second[s.rank] = *s.relayed_second;
  }
  const auto roots = [](const std::map<int64_t, int64_t>& lane) {
    return std::count_if(lane.begin(), lane.end(), [](const auto& kv) { return kv.second == -1; });
  };
  EXPECT_EQ(roots(first), 1);
  EXPECT_EQ(roots(second), 1);
  for (const auto& [rank, parent] : second) {
    const auto& around = this->subscriber(rank).routed_around();
    if (parent == -1) {
      EXPECT_TRUE(around.empty()) << "rank " << rank << ": " << joined(around);
      continue;
    }
    // Its second lane's parent, once (its first lane flowed: nobody else is blamed).
    ASSERT_EQ(around.size(), 1u) << "rank " << rank << ": " << joined(around);
    EXPECT_EQ(around[0].rfind(c10::str("rank ", parent, " "), 0), 0u) << around[0];
    EXPECT_NE(around[0].find("no piece"), std::string::npos) << around[0];
  }
  for (int64_t i = 1; i < this->kEnds; ++i) {
    for (int64_t j = i + 1; j < this->kEnds; ++j) this->faults(i, j).release();
  }
  // The next versions, the host known: one host's subscribers, a chain and then its slots.
  for (int64_t v = 2; v <= 3; ++v) this->round(v);
  std::printf("[ relay    ] %s: two trees, version 1 around a stalled lane in %.1f ms\n",
              TypeParam::kName, ms(r1.took));
}

REGISTER_TYPED_TEST_SUITE_P(RelayContract, ThreeSubscribersTakeEachVersionWholeThroughAChain,
                            TwoTreesCarryHalfEachAndAStalledLaneResumesAlone,
                            AStalledRelayIsRoutedAroundWithinTheVersion,
                            AForgingRelayIsCaughtAndTheChildCompletesFromThePublisher,
                            AResumeThatNamesAnotherRankThanItsParentBlamesNobody);

}  // namespace publication_contract

/// Holds `Transport` to both contracts (in namespace publication_contract).
#define INSTANTIATE_PUBLICATION_CONTRACT(Name, Transport)        \
  INSTANTIATE_TYPED_TEST_SUITE_P(Name, LinkContract, Transport); \
  INSTANTIATE_TYPED_TEST_SUITE_P(Name, PublicationContract, Transport)

/// Holds `Transport`, which makes a Mesh, to the relay scenarios too.
#define INSTANTIATE_RELAY_CONTRACT(Name, Transport)                                       \
  static_assert(::publication_contract::HasMesh<Transport>, #Transport " makes no Mesh"); \
  INSTANTIATE_TYPED_TEST_SUITE_P(Name, RelayContract, Transport)

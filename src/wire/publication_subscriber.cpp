#include "wire/publication_subscriber.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <variant>

#include "core/byte_tensor.h"
#include "core/excerpt.h"
#include "tensordict/errors.h"
#include "tensordict/nested_key.h"
#include "wire/leaf_order.h"

namespace tensordict::wire::publication {
namespace {

// Waits are cut in slices, so that an interrupt ends a pull within one.
constexpr auto kSlice = std::chrono::milliseconds(100);
// A poll's request that the publisher has not taken after this long names a missing publisher.
constexpr auto kPollPatience = std::chrono::milliseconds(1000);

using Leaves = std::vector<std::pair<std::vector<std::string>, at::Tensor>>;

std::optional<std::string> tensorclass_of(const core::ValidatedMetadata& m) {
  const JsonScalar* v = transport_field(m, "_tensorclass_type");
  if (v == nullptr || !std::holds_alternative<std::string>(*v)) return std::nullopt;
  return std::get<std::string>(*v);
}

// Non-tensor entries of `from` written into `to`'s levels (the same structure).
void copy_non_tensors(const TensorDict& from, TensorDict to) {
  for (const auto& [key, value] : from.entries()) {
    if (value.is_non_tensor()) {
      to.set(NestedKey(key), value);
    } else if (value.is_tensordict()) {
      for (const auto& [k, v] : to.entries()) {
        if (k == key && v.is_tensordict()) {
          copy_non_tensors(value.tensordict(), v.tensordict());
          break;
        }
      }
    }
  }
}

bool has_non_tensors(const Metadata& m) {
  if (!m.non_tensors.empty()) return true;
  return std::any_of(m.children.begin(), m.children.end(),
                     [](const auto& c) { return has_non_tensors(c.second); });
}

// The first difference between `have` (the target's leaves) and `want` (the version's).
void check_same_leaves(const std::string& who, const Leaves& have, const Leaves& want) {
  for (size_t i = 0; i < std::max(have.size(), want.size()); ++i) {
    if (i >= have.size()) {
      TD_THROW(SchemaMismatchError, who, ": the version has key ",
               core::key_path_excerpt(want[i].first), ", which this TensorDict lacks");
    }
    if (i >= want.size() || have[i].first != want[i].first) {
      TD_THROW(SchemaMismatchError, who, ": this TensorDict has key ",
               core::key_path_excerpt(have[i].first), ", which the version ",
               i >= want.size()
                   ? "lacks"
                   : c10::str("has not here (it has ", core::key_path_excerpt(want[i].first), ")"));
    }
    const at::Tensor& a = have[i].second;
    const at::Tensor& b = want[i].second;
    if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
      TD_THROW(SchemaMismatchError, who, ": key ", core::key_path_excerpt(have[i].first), " is ",
               a.scalar_type(), " of shape ", a.sizes(), " here and ", b.scalar_type(),
               " of shape ", b.sizes(), " in the version");
    }
  }
}

void check_pull(const PullOptions& options) {
  TORCH_CHECK_VALUE(!options.timeout || options.timeout->count() >= 0,
                    "Subscriber.pull: timeout must not be negative");
  TORCH_CHECK_VALUE(options.min_version.value_or(0) >= 0,
                    "Subscriber.pull: min_version must not be negative, got ",
                    options.min_version.value_or(0));
}

}  // namespace

// What the subscriber holds: the last version it applied.
struct SubscriberCore::Held {
  uint64_t epoch = 0;
  int64_t version = 0;
  uint64_t schema = 0;
  int64_t data_bytes = 0;
  std::shared_ptr<const core::ValidatedMetadata> metadata;
};

struct Pull {
  uint64_t seq = 0;
  int64_t wait_ms = 0;  // the request's
  Clock::time_point sent;
  at::Tensor request, offer_buffer;
  PendingPtr request_sent, offer_received;
  bool request_taken = false;
  std::optional<Offer> offer;
  std::shared_ptr<const core::ValidatedMetadata> metadata;  // the offer's, once read
  at::Tensor schema, data;
  PendingPtr schema_received, data_received;
  bool schema_done = false, data_done = false;
  // What a refusal of the publisher's bytes read at this step would say (kNone: the publisher
  // refused this subscriber, and is told nothing back).
  Refusal step = Refusal::kOffer;

  // Whatever of the pull is posted: kept (buffers alive) when it ends early.
  std::vector<PendingPtr> posted() const {
    std::vector<PendingPtr> out;
    for (const auto& p : {request_sent, offer_received, schema_received, data_received}) {
      if (p) out.push_back(p);
    }
    return out;
  }
};

struct Leftover {
  SubscriberCore::Held held;
  std::shared_ptr<Pull> pull;
  std::string ended;
};

SubscriberCore::SubscriberCore(std::shared_ptr<Link> link, std::string who, int64_t max_total_bytes)
    : link_(std::move(link)),
      who_(std::move(who)),
      max_total_bytes_(max_total_bytes),
      held_(std::make_unique<Held>()) {}

SubscriberCore::~SubscriberCore() = default;

int64_t SubscriberCore::version() const { return held_->version; }
uint64_t SubscriberCore::epoch() const { return held_->epoch; }

std::shared_ptr<Leftover> SubscriberCore::release() {
  if (!pull_ && ended_.empty()) return nullptr;
  auto left = std::make_shared<Leftover>();
  left->held = *held_;
  left->pull = std::move(pull_);
  left->ended = std::move(ended_);
  return left;
}

void SubscriberCore::adopt(std::shared_ptr<Leftover> leftover) {
  if (!leftover) return;
  if (leftover->pull) {
    // The pull in flight is finished by the first pull here, against what was held then.
    *held_ = leftover->held;
    pull_ = std::move(leftover->pull);
    seq_ = pull_->seq;
  }
  ended_ = std::move(leftover->ended);
}

bool SubscriberCore::wait(const PendingPtr& p, Clock::time_point deadline) {
  for (;;) {
    if (interrupted_.load()) return false;
    const auto end = std::min(deadline, Clock::now() + kSlice);
    if (link_->wait(p, end)) return true;
    if (end >= deadline) return false;
  }
}

void SubscriberCore::end_pull(std::exception_ptr error) {
  const std::shared_ptr<Pull> o = std::move(pull_);
  try {
    std::rethrow_exception(error);
  } catch (const NoPublisherError&) {
    pull_ = o;  // nobody took the request: it stays queued for a publisher that starts
    throw;
  } catch (const MalformedPeerDataError& e) {
    // The publisher's bytes are refused: what it sent next cannot be trusted to fit what this
    // side would post, so the link ends here. The publisher is told (it stops serving this
    // subscriber and frees the slot it pinned); what was posted stays posted, its buffers
    // kept, so that nothing the publisher sent lands in memory used for anything else.
    if (ended_.empty()) {
      ended_ = c10::str(e.what_without_backtrace(),
                        ". This subscriber refused it and pulls no more from ", link_->peer());
    }
    if (o) {
      std::vector<PendingPtr> keep = o->posted();
      // Refused back, unless the publisher ended the link itself (Refusal::kNone).
      if (o->step != Refusal::kNone) {
        try {
          Request r;
          r.refusal = o->step;
          r.seq = o->seq;
          r.epoch = held_->epoch;
          r.version = held_->version;
          keep.push_back(link_->post_send(core::bytes_tensor(encode(r)), Kind::kRequest));
        } catch (...) {
          // the link is broken already: its peer learns it from the transport
        }
      }
      link_->keep(keep);
    }
    TD_THROW(MalformedPeerDataError, ended_);
  } catch (const PeerClosedError& e) {
    publisher_closed_ = true;
    TD_THROW(NoPublisherError, who_, ": the Publisher on ", link_->peer(), " closed (",
             e.what_without_backtrace(), ")");
  } catch (const PeerLostError& e) {
    // What was posted stays posted, its buffers kept: a transport may not fail at once the
    // receive whose bytes it was reading when the connection went (Gloo's).
    if (o) link_->keep(o->posted());
    // A lost request send may hide the publisher's clean close, already in the offer's
    // receive (a pipe's close marker).
    if (o && o->offer_received) {
      try {
        link_->wait(o->offer_received, Clock::now());
      } catch (const PeerClosedError& closed) {
        publisher_closed_ = true;
        TD_THROW(NoPublisherError, who_, ": the Publisher on ", link_->peer(), " closed (",
                 closed.what_without_backtrace(), ")");
      } catch (...) {
      }
    }
    TD_THROW(PeerLostError, who_,
             ": lost the connection to the publisher: ", e.what_without_backtrace());
  } catch (...) {
    pull_ = o;  // anything else leaves the pull as it was, for the next pull to go on with
    throw;
  }
}

void SubscriberCore::send_request(const PullOptions& options) {
  auto o = std::make_shared<Pull>();
  o->seq = ++seq_;
  Request r;
  r.seq = o->seq;
  r.epoch = held_->epoch;
  r.version = held_->version;
  r.min_version = options.min_version.value_or(0);
  r.wait_ms = options.timeout ? options.timeout->count() : -1;
  r.schema = held_->schema;
  o->wait_ms = r.wait_ms;
  // The offer's receive first: the publisher never waits on this subscriber to answer.
  o->offer_buffer = message_buffer();
  o->offer_received = link_->post_recv(o->offer_buffer, Kind::kOffer);
  o->request = core::bytes_tensor(encode(r));
  o->sent = Clock::now();
  pull_ = o;
  o->request_sent = link_->post_send(o->request, Kind::kRequest);
}

bool SubscriberCore::request_taken(Pull& o, Clock::time_point deadline,
                                   const PullOptions& options) {
  if (o.request_taken) return true;
  if (!wait(o.request_sent, deadline)) {
    // A publisher that took requests before is slow or stopped, not missing.
    if (interrupted_.load() || answered_) return false;
    const auto now = Clock::now();
    const auto waited = now - o.sent;
    const auto asked = options.timeout.value_or(std::chrono::milliseconds(0));
    const auto least = asked.count() > 0 ? asked : kPollPatience;
    // A request this pull sent has waited all of the pull once its deadline passed (the pull
    // began a moment before the request went).
    const bool whole_pull = asked.count() > 0 && now >= deadline && o.sent >= deadline - asked;
    TD_CHECK_AS(NoPublisherError, waited < least && !whole_pull, who_, ": ", link_->peer(),
                " has taken no request in ",
                std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
                " ms: ", link_->no_publisher(), ". The request stays queued for when one starts");
    return false;
  }
  o.request_taken = true;
  answered_ = true;
  return true;
}

SubscriberCore::OfferRead SubscriberCore::read_offer(Pull& o, Clock::time_point deadline) {
  if (o.offer) return OfferRead::kNew;
  if (!wait(o.offer_received, deadline)) return OfferRead::kWaiting;
  const Offer offer = decode_offer(who_.c_str(), o.offer_buffer.data_ptr<uint8_t>());
  TD_CHECK_PEER(offer.seq == o.seq, who_, ": the publisher's offer answers request ", offer.seq,
                ", not request ", o.seq, " (a message out of order)");
  switch (offer.status) {
    case Status::kNone: {
      // An honest publisher answers "none" once the request's wait has passed: sooner, a loop
      // of requests would spin.
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - o.sent);
      o.step = Refusal::kAnswer;
      TD_CHECK_PEER(
          o.wait_ms >= 0 && waited.count() >= o.wait_ms, who_, ": the publisher on ", link_->peer(),
          " answered \"none\" after ", waited.count(), " ms to a request that waits ",
          o.wait_ms < 0 ? std::string("until a version is published") : c10::str(o.wait_ms, " ms"));
      pull_.reset();
      return OfferRead::kNone;
    }
    case Status::kClosed: TD_THROW(PeerClosedError, "it answered \"closed\"");
    case Status::kRefused:
      // The publisher ended the link itself: nothing to refuse back.
      o.step = Refusal::kNone;
      ended_ = c10::str(who_, ": the Publisher on ", link_->peer(),
                        " refused this subscriber's request as malformed and serves it no more");
      TD_THROW(MalformedPeerDataError, ended_);
    case Status::kNew: break;
  }
  o.step = offer.data_bytes > max_total_bytes_ ? Refusal::kStorage : Refusal::kOffer;
  const publication::Held check{o.seq,         held_->epoch,      held_->version,
                                held_->schema, held_->data_bytes, max_total_bytes_};
  check_offer(who_.c_str(), offer, check);
  o.offer = offer;
  // Nothing is allocated for a size before check_offer bounded it.
  if (offer.schema_bytes > 0) {
    o.schema = recv_buffer(offer.schema_bytes);
    o.schema_received = link_->post_recv(o.schema, Kind::kSchema);
  } else {
    o.metadata = held_->metadata;
  }
  const int64_t n = offer.data_bytes;
  // The stage, unless a pull into a new TensorDict took it (or it is too small).
  if (!stage_.defined() || stage_.numel() < n) stage_ = recv_buffer(std::max<int64_t>(n, 1));
  o.data = stage_.narrow(0, 0, n);
  o.data_received = link_->post_recv(o.data, Kind::kData);
  return OfferRead::kNew;
}

bool SubscriberCore::read_version(Pull& o, Clock::time_point deadline) {
  if (o.schema_received && !o.schema_done) {
    if (!wait(o.schema_received, deadline)) return false;
    o.schema_done = true;
    o.step = Refusal::kSchema;
    const std::string_view text(reinterpret_cast<const char*>(o.schema.data_ptr<uint8_t>()),
                                static_cast<size_t>(o.schema.numel()));
    try {
      o.metadata =
          std::make_shared<core::ValidatedMetadata>(read_schema(who_.c_str(), *o.offer, text));
    } catch (const MalformedPeerDataError&) {
      throw;
    } catch (const c10::Error& e) {
      // The reader's ValueError names what it refused; a peer's schema it is all the same.
      TD_THROW(MalformedPeerDataError, who_,
               ": the version's schema is refused: ", e.what_without_backtrace());
    }
  }
  if (!o.data_done) {
    if (!wait(o.data_received, deadline)) return false;
    o.data_done = true;
    o.step = Refusal::kData;
    TD_CHECK_PEER(!link_->short_message(o.data_received), who_,
                  ": the version's data stopped short of the ", o.offer->data_bytes,
                  " bytes its offer announced");
  }
  return true;
}

bool SubscriberCore::advance(Clock::time_point deadline, const PullOptions& options) {
  for (;;) {
    if (!pull_) send_request(options);
    Pull& o = *pull_;
    if (!request_taken(o, deadline, options)) return false;
    switch (read_offer(o, deadline)) {
      case OfferRead::kWaiting: return false;
      case OfferRead::kNone:  // nothing newer within the request's wait: ask again
        if (Clock::now() >= deadline || interrupted_.load()) return false;
        continue;
      case OfferRead::kNew: return read_version(o, deadline);
    }
  }
}

// Pulls until a version of at least min_version is in, or the deadline passes: apply(o) puts
// each version where it goes (it may throw, the version then not held) and makes the result.
template <typename Apply>
auto SubscriberCore::pull_with(const PullOptions& options, Apply&& apply)
    -> std::optional<std::invoke_result_t<Apply&, Pull&>> {
  check_pull(options);
  TD_CHECK_AS(MalformedPeerDataError, ended_.empty(), ended_);
  const auto start = Clock::now();
  const auto deadline = options.timeout ? start + *options.timeout : Clock::time_point::max();
  for (;;) {
    bool in = false;
    try {
      in = advance(deadline, options);
    } catch (...) {
      end_pull(std::current_exception());
    }
    if (!in) return std::nullopt;
    const std::shared_ptr<Pull> o = std::move(pull_);
    auto result = apply(*o);
    const Offer& offer = *o->offer;
    *held_ = Held{offer.epoch, offer.version, offer.schema, offer.data_bytes, o->metadata};
    if (offer.version >= options.min_version.value_or(0)) return result;
    if (Clock::now() >= deadline || interrupted_.load()) return std::nullopt;
  }
}

std::optional<int64_t> SubscriberCore::pull(TensorDict& td, const PullOptions& options) {
  return pull_with(options, [&](Pull& o) {
    const auto& metadata = *o.metadata;
    // The version's leaves as views of the data, made once per schema and stage.
    if (stage_views_for_ != o.data.data_ptr() || stage_views_schema_ != o.offer->schema) {
      stage_views_ = leaves_in_order(core::rebuild_validated(metadata, o.data));
      stage_views_for_ = o.data.data_ptr();
      stage_views_schema_ = o.offer->schema;
    }
    const Leaves target = leaves_in_order(td);
    check_same_leaves(who_, target, stage_views_);
    {
      at::NoGradGuard no_grad;  // a module's Parameters are written in place
      for (size_t i = 0; i < target.size(); ++i) target[i].second.copy_(stage_views_[i].second);
    }
    if (has_non_tensors(metadata.metadata())) {
      copy_non_tensors(core::rebuild_validated(metadata, o.data), td);
    }
    return o.offer->version;
  });
}

std::optional<Pulled> SubscriberCore::pull(const PullOptions& options) {
  return pull_with(options, [&](Pull& o) {
    // The new TensorDict keeps the stage as its storage; the next pull makes another.
    Pulled pulled{core::rebuild_validated(*o.metadata, o.data), o.offer->version,
                  tensorclass_of(*o.metadata)};
    stage_ = at::Tensor();
    stage_views_for_ = nullptr;
    return pulled;
  });
}

}  // namespace tensordict::wire::publication

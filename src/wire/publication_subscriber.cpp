#include "wire/publication_subscriber.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
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

// Zeroed: a peer's short message leaves zeros, which decode_offer refuses.
at::Tensor message_buffer() { return at::zeros({static_cast<int64_t>(kMessageBytes)}, at::kByte); }

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

struct InFlight {
  uint64_t seq = 0;
  SubscriberCore::Held held;  // when the request was sent (what a reused schema refers to)
  at::Tensor request, offer_buffer;
  PendingPtr request_sent, offer_received;
  Clock::time_point sent;
  bool request_taken = false;
  std::optional<Offer> offer;
  std::shared_ptr<const core::ValidatedMetadata> metadata;  // the offer's, once read
  at::Tensor schema, data;
  PendingPtr schema_received, data_received;
  bool schema_done = false, data_done = false;
};

SubscriberCore::SubscriberCore(std::shared_ptr<Link> link, std::string who, int64_t max_total_bytes)
    : link_(std::move(link)),
      who_(std::move(who)),
      max_total_bytes_(max_total_bytes),
      held_(std::make_unique<Held>()) {}

SubscriberCore::~SubscriberCore() = default;

int64_t SubscriberCore::version() const { return held_->version; }
uint64_t SubscriberCore::epoch() const { return held_->epoch; }

std::shared_ptr<InFlight> SubscriberCore::release() { return std::move(out_); }

void SubscriberCore::adopt(std::shared_ptr<InFlight> in_flight) {
  if (!in_flight) return;
  out_ = std::move(in_flight);  // finished by the first pull, then dropped
  seq_ = out_->seq;
}

bool SubscriberCore::wait(const PendingPtr& p, Clock::time_point deadline, const char* what) {
  try {
    for (;;) {
      if (interrupted_.load()) return false;
      const auto end = std::min(deadline, Clock::now() + kSlice);
      if (link_->wait(p, end)) return true;
      if (end >= deadline) return false;
    }
  } catch (const NoPublisherError&) {
    out_.reset();  // a link tells the publisher's clean close so
    publisher_closed_ = true;
    throw;
  } catch (const PeerLostError& e) {
    said_goodbye(p);
    out_.reset();
    TD_THROW(PeerLostError, who_, ": lost the connection while waiting for ", what, ": ",
             e.what_without_backtrace());
  } catch (...) {
    out_.reset();  // what follows on this link cannot be trusted to fit
    throw;
  }
}

void SubscriberCore::send_request(const PullOptions& options, Clock::time_point start) {
  auto o = std::make_shared<InFlight>();
  o->seq = ++seq_;
  o->held = *held_;
  Request r;
  r.seq = o->seq;
  r.epoch = held_->epoch;
  r.version = held_->version;
  r.min_version = options.min_version.value_or(0);
  r.wait_ms = options.timeout ? options.timeout->count() : -1;
  r.schema = held_->schema;
  // The offer's receive first: the publisher never waits on this subscriber to answer.
  o->offer_buffer = message_buffer();
  o->offer_received = link_->post_recv(o->offer_buffer, Kind::kOffer);
  o->request = core::bytes_tensor(encode(r));
  o->sent = start;
  out_ = std::move(o);
  try {
    out_->request_sent = link_->post_send(out_->request, Kind::kRequest);
  } catch (const PeerLostError&) {
    said_goodbye(nullptr);
    out_.reset();
    throw;
  }
}

void SubscriberCore::said_goodbye(const PendingPtr& lost) {
  // A publisher that closed has left: its last message, the close marker where an offer was
  // due, tells its close from a loss (the link raises NoPublisherError for it).
  if (!out_ || !out_->offer_received || lost == out_->offer_received) return;
  try {
    link_->wait(out_->offer_received, Clock::now());
  } catch (const NoPublisherError&) {
    out_.reset();
    publisher_closed_ = true;
    throw;
  } catch (...) {
  }
}

bool SubscriberCore::request_taken(InFlight& o, Clock::time_point deadline,
                                   const PullOptions& options) {
  if (o.request_taken) return true;
  if (!wait(o.request_sent, deadline, "the publisher to take the request")) {
    // A publisher that took requests before is slow or stopped, not missing.
    if (interrupted_.load() || answered_) return false;
    const auto waited = Clock::now() - o.sent;
    const auto asked = options.timeout.value_or(std::chrono::milliseconds(0));
    const auto least = asked.count() > 0 ? asked : kPollPatience;
    TD_CHECK_AS(NoPublisherError, waited < least, who_, ": ", link_->peer(),
                " has taken no request in ",
                std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
                " ms: ", link_->no_publisher(), ". The request stays queued for when one starts");
    return false;
  }
  o.request_taken = true;
  answered_ = true;
  return true;
}

SubscriberCore::OfferRead SubscriberCore::read_offer(InFlight& o, Clock::time_point deadline) {
  if (o.offer) return OfferRead::kNew;
  if (!wait(o.offer_received, deadline, "the publisher's offer")) return OfferRead::kWaiting;
  try {
    o.offer = decode_offer(who_.c_str(), o.offer_buffer.data_ptr<uint8_t>());
  } catch (...) {
    out_.reset();  // what follows on this link cannot be trusted to fit
    throw;
  }
  switch (o.offer->status) {
    case Status::kNone: out_.reset(); return OfferRead::kNone;
    case Status::kClosed:
      out_.reset();
      publisher_closed_ = true;
      TD_THROW(NoPublisherError, who_, ": the Publisher on ", link_->peer(), " closed");
    case Status::kRefused:
      out_.reset();
      TD_THROW(MalformedPeerDataError, who_, ": the Publisher on ", link_->peer(),
               " refused this subscriber's request as malformed and serves it no more");
    case Status::kNew: break;
  }
  const publication::Held check{o.seq,         o.held.epoch,      o.held.version,
                                o.held.schema, o.held.data_bytes, max_total_bytes_};
  try {
    check_offer(who_.c_str(), *o.offer, check);
  } catch (...) {
    out_.reset();  // what follows on this link cannot be trusted to fit
    throw;
  }
  // Nothing is allocated for a size before check_offer bounded it.
  if (o.offer->schema_bytes > 0) {
    o.schema = at::empty({o.offer->schema_bytes}, at::kByte);
    o.schema_received = link_->post_recv(o.schema, Kind::kSchema);
  } else {
    o.metadata = o.held.metadata;
  }
  const int64_t n = o.offer->data_bytes;
  // The stage, unless a pull into a new TensorDict took it (or it is too small).
  if (!stage_.defined() || stage_.numel() < n) {
    stage_ = core::fresh_bytes(std::max<int64_t>(n, 1));
  }
  o.data = stage_.narrow(0, 0, n);
  o.data_received = link_->post_recv(o.data, Kind::kData);
  return OfferRead::kNew;
}

bool SubscriberCore::read_version(InFlight& o, Clock::time_point deadline) {
  if (o.schema_received && !o.schema_done) {
    if (!wait(o.schema_received, deadline, "the version's schema")) return false;
    o.schema_done = true;
    const std::string_view text(reinterpret_cast<const char*>(o.schema.data_ptr<uint8_t>()),
                                static_cast<size_t>(o.schema.numel()));
    try {
      o.metadata =
          std::make_shared<core::ValidatedMetadata>(read_schema(who_.c_str(), *o.offer, text));
    } catch (...) {
      // The data still comes: drain it before giving up, so the messages stay in step.
      try {
        while (!link_->wait(o.data_received, Clock::now() + kSlice)) {
        }
      } catch (...) {
      }
      out_.reset();
      throw;
    }
  }
  if (!o.data_done) {
    if (!wait(o.data_received, deadline, "the version's data")) return false;
    o.data_done = true;
    if (link_->short_message(o.data_received)) {
      const int64_t announced = o.offer->data_bytes;
      out_.reset();  // `o` with it
      TD_THROW(MalformedPeerDataError, who_, ": the version's data stopped short of the ",
               announced, " bytes its offer announced");
    }
  }
  return true;
}

bool SubscriberCore::advance(Clock::time_point start, Clock::time_point deadline,
                             const PullOptions& options) {
  for (;;) {
    if (!out_) send_request(options, start);
    InFlight& o = *out_;
    if (!request_taken(o, deadline, options)) return false;
    switch (read_offer(o, deadline)) {
      case OfferRead::kWaiting: return false;
      case OfferRead::kNone:  // nothing newer within the request's wait: ask again
        if (Clock::now() >= deadline) return false;
        continue;
      case OfferRead::kNew: return read_version(o, deadline);
    }
  }
}

// Pulls until a version of at least min_version is in, or the deadline passes: apply(o) puts
// each version where it goes (it may throw, the version then not held) and makes the result.
template <typename Apply>
auto SubscriberCore::pull_with(const PullOptions& options, Apply&& apply)
    -> std::optional<std::invoke_result_t<Apply&, InFlight&>> {
  check_pull(options);
  const auto start = Clock::now();
  const auto deadline = options.timeout ? start + *options.timeout : Clock::time_point::max();
  for (;;) {
    if (!advance(start, deadline, options)) return std::nullopt;
    const std::shared_ptr<InFlight> o = std::move(out_);
    auto result = apply(*o);
    const Offer& offer = *o->offer;
    *held_ = Held{offer.epoch, offer.version, offer.schema, offer.data_bytes, o->metadata};
    if (offer.version >= options.min_version.value_or(0)) return result;
    if (Clock::now() >= deadline || interrupted_.load()) return std::nullopt;
  }
}

std::optional<int64_t> SubscriberCore::pull(TensorDict& td, const PullOptions& options) {
  return pull_with(options, [&](InFlight& o) {
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
  return pull_with(options, [&](InFlight& o) {
    // The new TensorDict keeps the stage as its storage; the next pull makes another.
    Pulled pulled{core::rebuild_validated(*o.metadata, o.data), o.offer->version,
                  tensorclass_of(*o.metadata)};
    stage_ = at::Tensor();
    stage_views_for_ = nullptr;
    return pulled;
  });
}

}  // namespace tensordict::wire::publication

#include "group_link.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "gloo_errors.h"
#include "tensordict/errors.h"

namespace tensordict::dist::detail {
namespace pub = wire::publication;

namespace {

// A message posted on the group, as a timed-out call's are (late.h), so that a closing
// publisher can park it.
struct GroupPending final : pub::Pending {
  MessagePtr message;
  at::Tensor copy_to;              // a parked receive taken over: its bytes go here once complete
  std::optional<TailStamp> stamp;  // a data receive's, telling a short message
  pub::Kind kind = pub::Kind::kRequest;
};

const char* what_of(pub::Kind kind) {
  switch (kind) {
    case pub::Kind::kRequest: return "request";
    case pub::Kind::kOffer: return "offer";
    case pub::Kind::kSchema: return "schema";
    case pub::Kind::kData: return "data";
    case pub::Kind::kWatch: return "watch";
    case pub::Kind::kRoute: return "route";
    case pub::Kind::kPiece:
    case pub::Kind::kPiece2: return "piece";
  }
  return "message";
}

// How long a wait runs before it looks at the link's watch.
constexpr auto kWatchSlice = std::chrono::milliseconds(100);

}  // namespace

GroupLink::GroupLink(Group group, int rank, int64_t channel)
    : group_(std::move(group)), key_(group_), rank_(rank), channel_(channel) {
  const int tag = pub::tag_of(channel_, pub::Kind::kWatch);
  // Posted once per channel and peer (a Gloo receive cannot be withdrawn): an earlier link's is
  // taken over.
  watch_ = LateMessages::get().take(key_, rank_, tag);
  if (!watch_) watch_ = post(pub::message_buffer(), tag, /*is_recv=*/true);
}

GroupLink::~GroupLink() { LateMessages::get().park(key_, rank_, {watch_}); }

pub::PendingPtr GroupLink::post_recv(const at::Tensor& buffer, pub::Kind kind) {
  auto p = std::make_shared<GroupPending>();
  p->kind = kind;
  const int tag = pub::tag_of(channel_, kind);
  // A receive that an earlier publisher of this channel left posted gets the next request; one
  // an earlier relayed version left gets the next piece (a stale one, which the subscriber
  // drops by its header).
  if (kind == pub::Kind::kRequest || pub::is_piece(kind)) {
    if (auto parked = LateMessages::get().take(key_, rank_, tag)) {
      p->message = std::move(parked);
      p->copy_to = buffer;
      return p;
    }
  }
  if (kind == pub::Kind::kData || kind == pub::Kind::kRoute) p->stamp.emplace(buffer);
  p->message = post(buffer, tag, /*is_recv=*/true);
  return p;
}

pub::PendingPtr GroupLink::post_send(const at::Tensor& buffer, pub::Kind kind) {
  auto p = std::make_shared<GroupPending>();
  p->kind = kind;
  p->message = post(buffer, pub::tag_of(channel_, kind), /*is_recv=*/false);
  return p;
}

bool GroupLink::wait(const pub::PendingPtr& pending, Clock::time_point deadline) {
  auto& p = static_cast<GroupPending&>(*pending);
  while (!p.message->done) {
    const auto end = std::min(deadline, Clock::now() + kWatchSlice);
    try {
      if (wait_until(p.message->work, end)) {
        p.message->done = true;
        break;
      }
    } catch (const std::exception& e) {
      rethrow_lost(e, c10::str("the connection to ", peer()));
    }
    // Once a slice of waiting (a poll's waits of nothing cost no look).
    look_at_watch();
    if (end >= deadline) return false;
  }
  TD_CHECK_PEER(!p.message->long_message(), peer(), " sent a publication ", what_of(p.kind),
                " longer than the ", p.message->buffer.nbytes(),
                " bytes announced (it ran into the room kept after them)");
  if (p.copy_to.defined()) {
    // A piece's bytes only (its header says how many; the buffer has room for the largest).
    int64_t n = p.message->buffer.numel();
    if (pub::is_piece(p.kind) && n >= pub::kPieceHeaderBytes) {
      const auto h = pub::decode_piece_header(p.message->buffer.data_ptr<uint8_t>());
      if (h && h->bytes >= 0 && h->bytes <= n - pub::kPieceHeaderBytes) {
        n = pub::kPieceHeaderBytes + h->bytes;
      }
    }
    p.copy_to.narrow(0, 0, n).copy_(p.message->buffer.narrow(0, 0, n));
    p.copy_to = at::Tensor();
  }
  return true;
}

bool GroupLink::short_message(const pub::PendingPtr& pending) const {
  const auto& p = static_cast<const GroupPending&>(*pending);
  return p.stamp && p.stamp->short_message();
}

void GroupLink::keep(const std::vector<pub::PendingPtr>& posted) {
  std::vector<MessagePtr> messages;
  for (const auto& p : posted) messages.push_back(static_cast<GroupPending&>(*p).message);
  LateMessages::get().park(key_, rank_, messages);
}

std::string GroupLink::peer() const { return c10::str("rank ", rank_); }

std::string GroupLink::no_publisher() const {
  return c10::str("no Publisher of channel ", channel_,
                  " runs there (none yet, or it runs the reference tensordict, which has none)");
}

MessagePtr GroupLink::post(const at::Tensor& buffer, int tag, bool is_recv) {
  auto m = std::make_shared<PostedMessage>();
  m->buffer = buffer;
  m->tag = tag;
  m->is_recv = is_recv;
  // A receive buffer from recv_buffer() is posted with its room, a stamp at the room's start.
  std::vector<at::Tensor> tensors{is_recv ? with_room(buffer, std::numeric_limits<int64_t>::max())
                                          : buffer};
  if (tensors[0].nbytes() > buffer.nbytes()) {
    m->beyond.emplace(wire::stamp_beyond(tensors[0], static_cast<int64_t>(buffer.nbytes())));
  }
  m->work = is_recv ? group_.recv(tensors, rank_, tag) : group_.send(tensors, rank_, tag);
  return m;
}

void GroupLink::look_at_watch() {
  std::lock_guard<std::mutex> lock(watch_mutex_);
  if (Clock::now() - looked_ < kWatchSlice) return;
  looked_ = Clock::now();
  if (watch_->done) return;
  bool came = false;
  try {
    came = wait_until(watch_->work, Clock::now());
  } catch (const std::exception& e) {
    rethrow_lost(e, c10::str("the connection to ", peer()));
  }
  watch_->done = came;
  TD_CHECK_PEER(!came, peer(), " sent a message on channel ", channel_,
                "'s watch tag, on which nothing is ever sent");
}

}  // namespace tensordict::dist::detail

#include "pipe_link.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "pipe_impl.h"
#include "tensordict/errors.h"
#include "ucx_endpoint.h"
#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {
namespace pub = wire::publication;

namespace {

const char* what_of(pub::Kind kind) {
  switch (kind) {
    case pub::Kind::kRequest: return "a publication request";
    case pub::Kind::kOffer: return "a publication offer";
    case pub::Kind::kSchema: return "a version's schema";
    case pub::Kind::kData: return "a version's data";
    case pub::Kind::kWatch:  // a c10d group's only
    case pub::Kind::kRoute:  // relays: a c10d group's only
    case pub::Kind::kPiece:
    case pub::Kind::kPiece2: break;
  }
  return "a publication message";
}

struct PipePending final : pub::Pending {
  std::shared_ptr<Op> op;
  at::Tensor buffer;   // the Op lets go of its buffer once complete
  at::Tensor copy_to;  // a kept receive taken over: its bytes go here once it completes
  pub::Kind kind = pub::Kind::kRequest;
  bool recv = false;
};

}  // namespace

PipeLink::PipeLink(std::shared_ptr<Endpoint> ep) : ep_(std::move(ep)) {}

PipeLink::~PipeLink() = default;

pub::PendingPtr PipeLink::post_recv(const at::Tensor& buffer, pub::Kind kind) {
  if (kind == pub::Kind::kRequest && !kept_requests_.empty()) {
    // The receive an earlier end of this link left posted gets the next request.
    auto p = std::static_pointer_cast<PipePending>(kept_requests_.front());
    kept_requests_.pop_front();
    p->copy_to = buffer;
    return p;
  }
  return post(buffer, kind, /*recv=*/true);
}

pub::PendingPtr PipeLink::post_send(const at::Tensor& buffer, pub::Kind kind) {
  return post(buffer, kind, /*recv=*/false);
}

bool PipeLink::wait(const pub::PendingPtr& pending, pub::Clock::time_point deadline) {
  auto& p = static_cast<PipePending&>(*pending);
  if (!ep_->wait_message(p.op, deadline, p.recv, what_of(p.kind))) return false;
  const bool message = p.kind == pub::Kind::kRequest || p.kind == pub::Kind::kOffer;
  if (p.recv && message && p.op->length != pub::kMessageBytes) {
    TD_CHECK_AS(PeerClosedError,
                !wire::frames::is_close_marker(p.buffer.const_data_ptr<uint8_t>(), p.op->length),
                ep_->peer(), " closed its pipe");
    const std::string why =
        c10::str("recv ", what_of(p.kind), ": peer ", ep_->peer(), " sent a message of ",
                 p.op->length, " bytes where ", pub::kMessageBytes, " were expected");
    ep_->fail(why);
    TD_THROW(MalformedPeerDataError, why);
  }
  if (p.copy_to.defined()) {
    p.copy_to.narrow(0, 0, static_cast<int64_t>(p.op->length))
        .copy_(p.buffer.narrow(0, 0, static_cast<int64_t>(p.op->length)));
    p.copy_to = at::Tensor();
  }
  return true;
}

bool PipeLink::short_message(const pub::PendingPtr& pending) const {
  const auto& p = static_cast<const PipePending&>(*pending);
  return p.op->length < static_cast<size_t>(p.buffer.numel());
}

void PipeLink::keep(const std::vector<pub::PendingPtr>& posted) {
  for (const auto& pending : posted) {
    const auto& p = static_cast<const PipePending&>(*pending);
    if (p.recv && p.kind == pub::Kind::kRequest) kept_requests_.push_back(pending);
  }
}

std::string PipeLink::peer() const { return ep_->peer(); }

std::string PipeLink::no_publisher() const {
  return "its server runs no Publisher (not yet, or it serves its pipes otherwise)";
}

bool PipeLink::peer_is_ours() const { return ep_->peer_info().ours; }

pub::PendingPtr PipeLink::post(const at::Tensor& buffer, pub::Kind kind, bool recv) {
  auto p = std::make_shared<PipePending>();
  p->kind = kind;
  p->recv = recv;
  p->buffer = buffer;
  p->op = ep_->post_message(recv, kind == pub::Kind::kRequest, buffer.data_ptr(),
                            static_cast<size_t>(buffer.numel()), buffer, what_of(kind));
  return p;
}

std::shared_ptr<PipeLink> pipe_link(const Pipe& pipe, const char* call) {
  auto ep =
      std::dynamic_pointer_cast<Endpoint>(PipeAccess::impl(pipe).publication_connection(call));
  TORCH_CHECK_VALUE(ep != nullptr, call,
                    ": the pipe runs over a caller's link, whose messages cannot be waited on "
                    "apart; use a pipe of tensordict_cpp's own (connect, listen, a "
                    "TensorDictServer's)");
  return std::make_shared<PipeLink>(std::move(ep));
}

void carry_publication(const Pipe& pipe) { PipeAccess::impl(pipe).carry_publication(); }

}  // namespace tensordict::pipe::detail

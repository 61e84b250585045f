#pragma once
// Publication's link over a pipe (src/wire/include/wire/publication_link.h): the four messages
// of docs/wire-format.md §9 as UCX tag messages of one pipe of ours (§9.7). pipe::Publisher
// serves each client of its server over one, pipe::Subscriber pulls over one;
// tests/cpp/publication_contract.h holds it to the contract every transport's link keeps.

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "tensordict/pipe/pipe.h"
#include "wire/publication_link.h"

namespace tensordict::pipe::detail {

class Endpoint;

/// One pipe's messages, in order, on its tags (§6.6). A request goes as a synchronous send,
/// which completes once the peer has posted its receive. The peer's close marker where a
/// request or an offer is due is its clean close (PeerClosedError); UCX fails every operation
/// of a lost peer (PeerLostError). A request receive kept (Connection::keep) is the next
/// post_recv's of a request on this link; the rest of what is kept is UCX's until it completes
/// or the pipe closes.
class PipeLink final : public wire::publication::Link {
 public:
  explicit PipeLink(std::shared_ptr<Endpoint> ep);
  ~PipeLink() override;
  PipeLink(const PipeLink&) = delete;
  PipeLink& operator=(const PipeLink&) = delete;

  wire::publication::PendingPtr post_recv(const at::Tensor& buffer,
                                          wire::publication::Kind kind) override;
  wire::publication::PendingPtr post_send(const at::Tensor& buffer,
                                          wire::publication::Kind kind) override;
  bool wait(const wire::publication::PendingPtr& pending,
            wire::publication::Clock::time_point deadline) override;
  bool short_message(const wire::publication::PendingPtr& pending) const override;
  void keep(const std::vector<wire::publication::PendingPtr>& posted) override;
  std::string peer() const override;
  std::string no_publisher() const override;

  /// Whether the peer is a tensordict_cpp peer (its peer info, §6.6): the reference's pipe has
  /// no publication.
  bool peer_is_ours() const;

 private:
  wire::publication::PendingPtr post(const at::Tensor& buffer, wire::publication::Kind kind,
                                     bool recv);

  std::shared_ptr<Endpoint> ep_;
  std::deque<wire::publication::PendingPtr> kept_requests_;
};

/// The link of a publication over `pipe`, a pipe of tensordict_cpp's own whose client is then
/// accepted (a listening pipe's, bounded by its timeout). ValueError for a pipe over a caller's
/// link (Pipe::over), whose messages cannot be waited on apart; the pipe's errors when it is
/// closed, broken or carries a publication already. `call` names the caller in errors.
std::shared_ptr<PipeLink> pipe_link(const Pipe& pipe, const char* call);

/// From now on `pipe`'s own send() and recv() refuse: it carries a publication only.
void carry_publication(const Pipe& pipe);

}  // namespace tensordict::pipe::detail

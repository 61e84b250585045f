#pragma once
// Publication's link over a c10d group (src/wire/include/wire/publication_link.h): one peer's
// messages on one channel's tags (docs/wire-format.md §9.1). dist::Publisher serves each
// subscriber over one, dist::Subscriber pulls over one; tests/cpp/publication_contract.h holds
// it to the contract every transport's link keeps. Private to the c10d layer.

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "late.h"
#include "tensordict/distributed/options.h"
#include "wire/publication_link.h"

namespace tensordict::dist::detail {

/// The messages with rank `rank` of `group` on channel `channel`'s tags. Gloo matches a peer's
/// messages on one tag in order, and a send moves only once its receive is posted (so a
/// request's send completes once the publisher has taken it). Gloo fails a lost connection's
/// posted receives, but not the one whose bytes it is reading, nor always a send: a receive
/// kept posted on the channel's watch tag, on which nothing is sent, tells a lost peer to every
/// wait within a slice. What is kept (Link::keep) is parked with the group's late messages
/// (late.h), for as long as the group lives; a kept request receive is the next link's on that
/// channel. Gloo has no clean close: a peer that goes is lost (PeerLostError), never closed.
class GroupLink final : public wire::publication::Link {
 public:
  GroupLink(Group group, int rank, int64_t channel);
  ~GroupLink() override;
  GroupLink(const GroupLink&) = delete;
  GroupLink& operator=(const GroupLink&) = delete;

  wire::publication::PendingPtr post_recv(const at::Tensor& buffer,
                                          wire::publication::Kind kind) override;
  wire::publication::PendingPtr post_send(const at::Tensor& buffer,
                                          wire::publication::Kind kind) override;
  bool wait(const wire::publication::PendingPtr& pending, Clock::time_point deadline) override;
  bool short_message(const wire::publication::PendingPtr& pending) const override;
  void keep(const std::vector<wire::publication::PendingPtr>& posted) override;
  std::string peer() const override;
  std::string no_publisher() const override;

 private:
  MessagePtr post(const at::Tensor& buffer, int tag, bool is_recv);
  // At most once a kWatchSlice: PeerLostError when Gloo failed the watch (the connection is
  // lost); a message on it is a peer that breaks the protocol.
  void look_at_watch();

  Group group_;
  GroupKey key_;
  int rank_;
  int64_t channel_;
  MessagePtr watch_;
  std::mutex watch_mutex_;  // a relay's two lanes wait on one link from two threads
  Clock::time_point looked_ = Clock::now();
};

}  // namespace tensordict::dist::detail

#include "tensordict/distributed/p2p.h"

#include <c10/util/Exception.h>

#include <limits>

#include "checked.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/tags.h"
#include "tensordict/leaf.h"
#include "tensordict/log.h"
#include "tensordict/nested_key.h"
#include "waiter.h"
#include "wire/leaf_order.h"

namespace tensordict::dist {
namespace {

using detail::Peer;
using detail::post_all;
using detail::resolve_peer;
using detail::sendable;

std::vector<at::Tensor> leaves_of(const TensorDict& td) {
  std::vector<at::Tensor> leaves;
  auto add = [&](std::vector<std::string>*, const at::Tensor& t) { leaves.push_back(t); };
  wire::for_each_leaf(td, nullptr, add);
  return leaves;
}

// Tags of `count` leaves, validated before anything is posted.
std::vector<int> leaf_tags(const char* call, int64_t init_tag, bool pseudo_rand, size_t count) {
  constexpr int64_t kMaxTag = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(init_tag >= 0, call, ": init_tag must be non-negative, got ", init_tag);
  if (!pseudo_rand && count > 0) {
    const auto last_offset = static_cast<int64_t>(count) - 1;
    TORCH_CHECK_VALUE(init_tag <= kMaxTag - last_offset, call, ": init_tag ", init_tag, " and ",
                      count, " leaves give a last tag of ", init_tag, " + ", last_offset,
                      ", above the largest c10d tag (", kMaxTag, ")");
  }
  std::vector<int> tags(count);
  int64_t tag = init_tag - 1;
  for (auto& t : tags) {
    tag = next_tag(tag, pseudo_rand);
    t = static_cast<int>(tag);
  }
  return tags;
}

// The one tag of a checked per-leaf transfer: the first leaf's (init_tag with no leaves).
int checked_tag(const char* call, int64_t init_tag, const std::vector<int>& tags) {
  TORCH_CHECK_VALUE(!tags.empty() || init_tag <= std::numeric_limits<int32_t>::max(), call,
                    ": init_tag ", init_tag, " is above the largest c10d tag");
  return tags.empty() ? static_cast<int>(init_tag) : tags.front();
}

struct Posted {
  std::vector<WorkPtr> works;
  std::optional<int64_t> last_tag;  // nullopt: consolidated
  std::vector<int> tags;            // per leaf, unchecked per-leaf transfers only
  int tag = 0;                      // the one tag of a consolidated or checked transfer
};

// What work i of `posted` carries, for a timeout's message; keys are looked up only then. Owns
// what it reads, so that works handed to the caller (typed_works) may keep it.
detail::InFlight in_flight(const Posted& posted, const TensorDict& td) {
  return [tags = posted.tags, last_tag = posted.last_tag, tag = posted.tag,
          count = posted.works.size(), td](size_t i) -> std::string {
    if (tags.empty()) {
      return c10::str(last_tag ? "the checked transfer" : "the consolidated storage", " (tag ", tag,
                      ", message ", i + 1, " of ", count, ")");
    }
    const auto leaves = wire::leaves_in_order(td);
    return c10::str("tag ", tags[i], " (key ",
                    i < leaves.size() ? NestedKey(leaves[i].first).str() : "?", ")");
  };
}

std::string rank_of(const Peer& peer) { return c10::str("rank ", peer.rank); }

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += static_cast<int64_t>(t.nbytes());
  return n;
}

// The info log line's detail of a transfer (docs/observability.md).
std::string describe(const char* kind, const std::vector<int>& tags, int64_t messages,
                     int64_t bytes, bool pseudo_rand) {
  std::string tag_text;
  if (tags.size() == 1) tag_text = c10::str(", tag ", tags.front());
  if (tags.size() > 1) {
    tag_text =
        c10::str(", tags ", tags.front(), pseudo_rand ? " (pseudo_rand) ... " : "-", tags.back());
  }
  return c10::str(kind, ", ", messages, messages == 1 ? " message" : " messages", tag_text, ", ",
                  bytes, " bytes");
}

// The per-leaf transfer of `td` both sides plan alike (docs/wire-format.md §1.2, §1.3): its
// leaves in wire order, their tags, the last tag, and with `checked` the one tag it takes.
struct PerLeaf {
  std::vector<at::Tensor> leaves;
  std::vector<int> tags;
  int64_t last_tag = 0;
  std::optional<int> checked_tag;
};

template <typename Options>
PerLeaf per_leaf(const char* call, const TensorDict& td, const Options& options) {
  PerLeaf p;
  p.leaves = leaves_of(td);
  detail::check_leaves(call, td, p.leaves);
  p.tags = leaf_tags(call, options.init_tag, options.pseudo_rand, p.leaves.size());
  p.last_tag = p.tags.empty() ? options.init_tag - 1 : p.tags.back();
  if (options.checked) p.checked_tag = checked_tag(call, options.init_tag, p.tags);
  return p;
}

Posted post_send(detail::Waiter& waiter, const TensorDict& td, const std::optional<int64_t>& dst,
                 const SendOptions& options, bool refuse_self) {
  const char* call = waiter.call();
  Peer peer =
      resolve_peer(call, dst, options.group_dst, options.group, "dst", "group_dst", refuse_self);
  waiter.set_peer(rank_of(peer));
  const bool logging = log_enabled(LogLevel::kInfo);
  if (options.checked && options.consolidated) {
    if (logging) waiter.set_detail("checked, consolidated, tag 0");
    return {detail::post_checked_send(waiter, td, peer, 0, true), std::nullopt, {}};
  }
  if (options.consolidated) {
    std::vector<at::Tensor> storage{is_consolidated(td) ? consolidated_storage(td)
                                                        : consolidated_storage(consolidate(td))};
    if (logging) waiter.set_detail(describe("consolidated", {0}, 1, bytes_of(storage), false));
    return {{waiter.send(peer, storage[0], 0)}, std::nullopt, {}};
  }
  auto [leaves, tags, last_tag, tag] = per_leaf(call, td, options);
  if (tag) {
    if (logging) waiter.set_detail(c10::str("checked, per leaf, tag ", *tag));
    return {detail::post_checked_send(waiter, td, peer, *tag, false), last_tag, {}, *tag};
  }
  if (logging) {
    waiter.set_detail(describe("per leaf", tags, static_cast<int64_t>(leaves.size()),
                               bytes_of(leaves), options.pseudo_rand));
  }
  auto works = post_all(leaves.size(),
                        [&](size_t i) { return waiter.send(peer, sendable(leaves[i]), tags[i]); });
  return {std::move(works), last_tag, std::move(tags)};
}

Posted post_receives(detail::Waiter& waiter, const TensorDict& td,
                     const std::optional<int64_t>& src, const RecvOptions& options,
                     bool refuse_self) {
  const char* call = waiter.call();
  Peer peer =
      resolve_peer(call, src, options.group_src, options.group, "src", "group_src", refuse_self);
  waiter.set_peer(rank_of(peer));
  const bool logging = log_enabled(LogLevel::kInfo);
  if (options.consolidated) {
    TORCH_CHECK_VALUE(is_consolidated(td), call,
                      "(consolidated=True): the TensorDict is not consolidated. Receive into a "
                      "consolidated TensorDict with the sender's layout (consolidate() it first)");
    if (options.checked) {
      if (logging) waiter.set_detail("checked, consolidated, tag 0");
      return {detail::post_checked_recv(waiter, td, peer, 0, true, options.late), std::nullopt, {}};
    }
    const at::Tensor storage = consolidated_storage(td);
    if (logging) {
      waiter.set_detail(
          describe("consolidated", {0}, 1, static_cast<int64_t>(storage.nbytes()), false));
    }
    if (options.late == Late::kDrop) waiter.drop_late(peer, {0});
    return {{waiter.recv_into(peer, storage, 0)}, std::nullopt, {}};
  }
  auto [leaves, tags, last_tag, tag] = per_leaf(call, td, options);
  if (tag) {
    if (logging) waiter.set_detail(c10::str("checked, per leaf, tag ", *tag));
    return {
        detail::post_checked_recv(waiter, td, peer, *tag, false, options.late), last_tag, {}, *tag};
  }
  if (logging) {
    waiter.set_detail(describe("per leaf", tags, static_cast<int64_t>(leaves.size()),
                               bytes_of(leaves), options.pseudo_rand));
  }
  for (const auto& leaf : leaves) {
    detail::check_writable(call, leaf, "receive into", "receiver");
  }
  if (options.late == Late::kDrop) waiter.drop_late(peer, tags);
  auto works =
      post_all(leaves.size(), [&](size_t i) { return waiter.recv_into(peer, leaves[i], tags[i]); });
  return {std::move(works), last_tag, std::move(tags)};
}

// Every receive into a TensorDict (per leaf, checked, consolidated; recv, irecv and their
// SubTensorDict forms) posts here: Gloo writes the leaves' memory (or the storage they view)
// behind autograd's back, so each leaf's version is bumped once the receives are posted (a
// refused checked receive, which keeps the values, bumps nothing). A staged receive (one with
// a timeout) writes them only in land_recv(), which bumps them then.
Posted post_recv(detail::Waiter& waiter, const TensorDict& td, const std::optional<int64_t>& src,
                 const RecvOptions& options, bool refuse_self) {
  Posted posted = post_receives(waiter, td, src, options, refuse_self);
  if (!waiter.staged()) {
    for (const auto& leaf : leaves_of(td)) mark_written(leaf);
  }
  return posted;
}

// After the last wait of a blocking receive: a staged one is copied into td now.
void land_recv(const detail::Waiter& waiter, const TensorDict& td) {
  if (!waiter.staged()) return;
  waiter.land();
  for (const auto& leaf : leaves_of(td)) mark_written(leaf);
}

}  // namespace

void send(const TensorDict& td, std::optional<int64_t> dst, const SendOptions& options) {
  detail::Waiter waiter("send", options.timeout, "the receiver");
  const Posted posted = post_send(waiter, td, dst, options, /*refuse_self=*/true);
  waiter.wait(posted.works, in_flight(posted, td));
}

std::optional<int64_t> recv(const TensorDict& td, std::optional<int64_t> src,
                            const RecvOptions& options) {
  detail::Waiter waiter("recv", options.timeout, "the sender");
  const Posted posted = post_recv(waiter, td, src, options, /*refuse_self=*/true);
  waiter.wait(posted.works, in_flight(posted, td));
  land_recv(waiter, td);
  return posted.last_tag;
}

std::optional<int64_t> isend(const TensorDict& td, std::optional<int64_t> dst,
                             const SendOptions& options) {
  detail::Waiter waiter("isend", options.timeout, "the receiver");
  const Posted posted = post_send(waiter, td, dst, options, /*refuse_self=*/false);
  waiter.wait(posted.works, in_flight(posted, td));
  return posted.last_tag;
}

std::vector<WorkPtr> isend_early(const TensorDict& td, std::optional<int64_t> dst,
                                 const SendOptions& options) {
  detail::Waiter waiter("isend", options.timeout, "the receiver");
  Posted posted = post_send(waiter, td, dst, options, /*refuse_self=*/false);
  return detail::typed_works(waiter.call(), waiter.peer(), posted.works, in_flight(posted, td),
                             /*keeps_group=*/true);
}

void irecv(const TensorDict& td, std::optional<int64_t> src, const RecvOptions& options) {
  detail::Waiter waiter("irecv", options.timeout, "the sender");
  const Posted posted = post_recv(waiter, td, src, options, /*refuse_self=*/false);
  waiter.wait(posted.works, in_flight(posted, td));
  land_recv(waiter, td);
}

std::vector<WorkPtr> irecv_premature(const TensorDict& td, std::optional<int64_t> src,
                                     const RecvOptions& options) {
  // The timeout bounds the checked header and schema, which are waited for here.
  detail::Waiter waiter("irecv", options.timeout, "the sender");
  waiter.direct_landing();  // the caller waits on the returned works, then reads td
  Posted posted = post_recv(waiter, td, src, options, /*refuse_self=*/false);
  return detail::typed_works(waiter.call(), waiter.peer(), posted.works, in_flight(posted, td),
                             /*keeps_group=*/true);
}

namespace {

// What a receive into a SubTensorDict receives into: the rows themselves (views of the
// parent's leaves, or copies for an advanced index); for a consolidated receive, a consolidated
// copy of them, whose layout is the sender's.
TensorDict receiving_rows(const SubTensorDict& sub, const RecvOptions& options) {
  TensorDict rows = sub.view();
  return options.consolidated ? consolidate(rows) : rows;
}

// Writes the received rows into the parent when they are not its own memory already.
void land(const SubTensorDict& sub, const TensorDict& rows, const RecvOptions& options) {
  if (options.consolidated || !sub.is_view()) sub.update_(rows);
}

}  // namespace

std::optional<int64_t> recv(const SubTensorDict& sub, std::optional<int64_t> src,
                            const RecvOptions& options) {
  const TensorDict rows = receiving_rows(sub, options);
  const auto tag = recv(rows, src, options);
  land(sub, rows, options);
  return tag;
}

void irecv(const SubTensorDict& sub, std::optional<int64_t> src, const RecvOptions& options) {
  const TensorDict rows = receiving_rows(sub, options);
  irecv(rows, src, options);
  land(sub, rows, options);
}

}  // namespace tensordict::dist

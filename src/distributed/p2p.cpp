#include "tensordict/distributed/p2p.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "tensordict/consolidate.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/tags.h"

namespace tensordict::dist {
namespace {

// Calls [fn(path, leaf)] in wire order: each level's keys sorted by code point (std::string's
// ordering compares as unsigned char, i.e. UTF-8 byte order), nested levels at their key's
// position.
template <typename Fn>
void walk(const TensorDict& td, std::vector<std::string>* path, Fn& fn) {
  const auto& entries = td.entries();
  std::vector<const TensorDict::Entry*> sorted;
  sorted.reserve(entries.size());
  for (const auto& entry : entries) {
    sorted.push_back(&entry);
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  for (const auto* entry : sorted) {
    if (path) {
      path->push_back(entry->first);
    }
    if (entry->second.is_tensor()) {
      fn(path, entry->second.tensor());
    } else {
      walk(entry->second.tensordict(), path, fn);
    }
    if (path) {
      path->pop_back();
    }
  }
}

std::vector<at::Tensor> leaves_of(const TensorDict& td) {
  std::vector<at::Tensor> leaves;
  auto add = [&](std::vector<std::string>*, const at::Tensor& t) { leaves.push_back(t); };
  walk(td, nullptr, add);
  return leaves;
}

// The reference's _check_p2p_peer, texts included.
void check_p2p_peer(const std::optional<int64_t>& peer, const std::optional<int64_t>& group_peer,
                    const Group& group, const char* peer_name, const char* group_peer_name) {
  if (group_peer) {
    TORCH_CHECK_VALUE(group, "`", group_peer_name, "` requires `group` to be passed.");
    TORCH_CHECK_VALUE(!peer, "`", peer_name, "` and `", group_peer_name,
                      "` are mutually exclusive.");
  } else {
    TORCH_CHECK_VALUE(peer, "Exactly one of `", peer_name, "` and `", group_peer_name,
                      "` must be provided.");
  }
}

struct Peer {
  Group group;
  int rank;  // in group
};

// The group and the peer's rank in it, as torch.distributed's send/recv resolve them.
Peer resolve_peer(const char* call, const std::optional<int64_t>& peer,
                  const std::optional<int64_t>& group_peer, const Group& group,
                  const char* peer_name, const char* group_peer_name, bool refuse_self) {
  check_p2p_peer(peer, group_peer, group, peer_name, group_peer_name);
  Peer out{group, 0};
  int64_t rank = 0;
  if (group_peer) {
    rank = *group_peer;  // straight to the given group's backend, registered or not
  } else {
    if (!out.group) {
      out.group = default_group();
    }
    rank = get_group_rank(out.group, *peer);
  }
  const int size = out.group.size();
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, call, ": ",
                    group_peer ? group_peer_name : peer_name, " = ",
                    group_peer ? *group_peer : *peer, " is not a rank of the group (size ", size,
                    ")");
  if (refuse_self && !group_peer) {
    // torch.distributed.send's _check_not_self_rank.
    TORCH_CHECK_VALUE(rank != out.group.rank(),
                      "Invalid destination rank: destination rank should not be the same as the "
                      "rank of the current process.");
  }
  out.rank = static_cast<int>(rank);
  return out;
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

// Gloo moves contiguous buffers only; other layouts go through a contiguous copy.
at::Tensor sendable(const at::Tensor& leaf) {
  return leaf.is_contiguous() ? leaf : leaf.contiguous();
}

// A receive into a contiguous stand-in; wait() copies it into the real leaf.
class CopyBackWork : public c10d::Work {
 public:
  CopyBackWork(WorkPtr inner, at::Tensor leaf, at::Tensor buffer)
      : c10d::Work(-1, c10d::OpType::RECV),
        inner_(std::move(inner)),
        leaf_(std::move(leaf)),
        buffer_(std::move(buffer)) {}

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    const bool done = inner_->wait(timeout);
    if (done && !copied_) {
      at::NoGradGuard no_grad;
      leaf_.copy_(buffer_);
      copied_ = true;
    }
    return done;
  }
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return {leaf_}; }
  void abort() override { inner_->abort(); }

 private:
  WorkPtr inner_;
  at::Tensor leaf_;
  at::Tensor buffer_;
  bool copied_ = false;
};

// Waits on every work. After the first failure the rest are aborted, so that a dead peer or a
// timeout costs one timeout, not one per leaf; the first error is rethrown.
void wait_all(const std::vector<WorkPtr>& works) {
  std::exception_ptr first;
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      works[i]->wait();
    } catch (...) {
      if (!first) {
        first = std::current_exception();
        for (size_t j = i + 1; j < works.size(); ++j) {
          try {
            works[j]->abort();
          } catch (...) {
          }
        }
      }
    }
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

// Posts through `post`; if posting throws midway, what was posted is aborted and drained.
template <typename Post>
std::vector<WorkPtr> post_all(size_t count, Post&& post) {
  std::vector<WorkPtr> works;
  works.reserve(count);
  try {
    for (size_t i = 0; i < count; ++i) {
      works.push_back(post(i));
    }
  } catch (...) {
    for (auto& w : works) {
      try {
        w->abort();
        w->wait();
      } catch (...) {
      }
    }
    throw;
  }
  return works;
}

struct PostedSend {
  std::vector<WorkPtr> works;
  std::optional<int64_t> last_tag;  // nullopt: consolidated
};

PostedSend post_send(const char* call, const TensorDict& td, const std::optional<int64_t>& dst,
                     const SendOptions& options, bool refuse_self) {
  Peer peer = resolve_peer(call, dst, options.group_dst, options.group, "dst", "group_dst",
                           refuse_self);
  if (options.consolidated) {
    std::vector<at::Tensor> storage{is_consolidated(td) ? consolidated_storage(td)
                                                        : consolidated_storage(consolidate(td))};
    return {{peer.group.send(storage, peer.rank, 0)}, std::nullopt};
  }
  auto leaves = leaves_of(td);
  auto tags = leaf_tags(call, options.init_tag, options.pseudo_rand, leaves.size());
  auto works = post_all(leaves.size(), [&](size_t i) {
    std::vector<at::Tensor> one{sendable(leaves[i])};
    return peer.group.send(one, peer.rank, tags[i]);
  });
  return {std::move(works), tags.empty() ? options.init_tag - 1 : tags.back()};
}

PostedSend post_recv(const char* call, const TensorDict& td, const std::optional<int64_t>& src,
                     const RecvOptions& options) {
  Peer peer = resolve_peer(call, src, options.group_src, options.group, "src", "group_src",
                           /*refuse_self=*/false);
  if (options.consolidated) {
    TORCH_CHECK_VALUE(is_consolidated(td), call,
                      "(consolidated=True): the TensorDict is not consolidated. Receive into a "
                      "consolidated TensorDict with the sender's layout (consolidate() it first)");
    std::vector<at::Tensor> storage{consolidated_storage(td)};
    return {{peer.group.recv(storage, peer.rank, 0)}, std::nullopt};
  }
  auto leaves = leaves_of(td);
  auto tags = leaf_tags(call, options.init_tag, options.pseudo_rand, leaves.size());
  for (const auto& leaf : leaves) {
    TORCH_CHECK_VALUE(at::has_internal_overlap(leaf) != at::MemOverlap::Yes, call,
                      ": cannot receive into a leaf whose elements share memory (an expanded "
                      "tensor); give the receiver a leaf of its own");
  }
  auto works = post_all(leaves.size(), [&](size_t i) -> WorkPtr {
    const at::Tensor& leaf = leaves[i];
    if (leaf.is_contiguous()) {
      std::vector<at::Tensor> one{leaf};
      return peer.group.recv(one, peer.rank, tags[i]);
    }
    std::vector<at::Tensor> one{at::empty_like(leaf, at::MemoryFormat::Contiguous)};
    auto inner = peer.group.recv(one, peer.rank, tags[i]);
    return c10::make_intrusive<CopyBackWork>(std::move(inner), leaf, one[0]);
  });
  return {std::move(works), tags.empty() ? options.init_tag - 1 : tags.back()};
}

}  // namespace

void send(const TensorDict& td, std::optional<int64_t> dst, const SendOptions& options) {
  wait_all(post_send("send", td, dst, options, /*refuse_self=*/true).works);
}

std::optional<int64_t> recv(const TensorDict& td, std::optional<int64_t> src,
                            const RecvOptions& options) {
  auto posted = post_recv("recv", td, src, options);
  wait_all(posted.works);
  return posted.last_tag;
}

std::optional<int64_t> isend(const TensorDict& td, std::optional<int64_t> dst,
                             const SendOptions& options) {
  auto posted = post_send("isend", td, dst, options, /*refuse_self=*/false);
  wait_all(posted.works);
  return posted.last_tag;
}

std::vector<WorkPtr> isend_early(const TensorDict& td, std::optional<int64_t> dst,
                                 const SendOptions& options) {
  return post_send("isend", td, dst, options, /*refuse_self=*/false).works;
}

void irecv(const TensorDict& td, std::optional<int64_t> src, const RecvOptions& options) {
  wait_all(post_recv("irecv", td, src, options).works);
}

std::vector<WorkPtr> irecv_premature(const TensorDict& td, std::optional<int64_t> src,
                                     const RecvOptions& options) {
  return post_recv("irecv", td, src, options).works;
}

std::vector<std::pair<std::vector<std::string>, at::Tensor>> wire_order(const TensorDict& td) {
  std::vector<std::pair<std::vector<std::string>, at::Tensor>> out;
  std::vector<std::string> path;
  auto add = [&](std::vector<std::string>* p, const at::Tensor& t) { out.emplace_back(*p, t); };
  walk(td, &path, add);
  return out;
}

}  // namespace tensordict::dist

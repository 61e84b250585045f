#pragma once
// Options of the point-to-point calls, named like the reference's keyword arguments, and the
// Group handle they take.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <concepts>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace tensordict::dist {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// A process group as the transfer calls take it: a c10d::ProcessGroup (the default group, one
/// from new_group(), or one the caller built and never registered), or a bare c10d::Backend
/// such as a ProcessGroupGloo built on a store (what Python's `ProcessGroupGloo(...)` returns).
/// An empty Group means "the default process group", like Python's `group=None`. A Group is a
/// reference-counted handle; copying it is cheap and shares the group.
class Group {
 public:
  Group() = default;
  Group(std::nullptr_t) {}  // NOLINT: `.group = nullptr` reads like Python's group=None
  template <typename T>
    requires std::derived_from<T, c10d::ProcessGroup> || std::derived_from<T, c10d::Backend>
  Group(c10::intrusive_ptr<T> group) {  // NOLINT: implicit, so any c10d pointer converts
    if constexpr (std::derived_from<T, c10d::ProcessGroup>) {
      process_group_ = std::move(group);
    } else {
      backend_ = std::move(group);
    }
  }

  explicit operator bool() const { return process_group_ || backend_; }
  bool operator==(const Group& other) const {
    return process_group_ == other.process_group_ && backend_ == other.backend_;
  }
  /// Null unless this holds a ProcessGroup.
  const ProcessGroupPtr& process_group() const { return process_group_; }
  /// Null unless this holds a bare Backend.
  const BackendPtr& backend() const { return backend_; }

  /// This process's rank in the group, and the group's size (the group must be non-empty).
  int rank() const;
  int size() const;
  /// The c10d calls, on the ProcessGroup (through the dispatcher, as Python's
  /// `group.send([t], peer, tag)` does) or straight on the Backend. Non-blocking.
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) const;
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) const;

 private:
  ProcessGroupPtr process_group_;
  BackendPtr backend_;
};

/// Keyword arguments of send() and isend().
struct SendOptions {
  Group group{};                         // empty: the default process group
  std::optional<int64_t> group_dst{};    // receiver's rank in `group` (exclusive with dst)
  int64_t init_tag = 0;                  // tag of the first leaf; leaf i uses init_tag + i
  bool pseudo_rand = false;              // tags from the reference's generator, seeded by init_tag
  bool consolidated = false;             // one message carrying the consolidated storage
};

/// Keyword arguments of recv() and irecv(); the sender's values must be passed.
struct RecvOptions {
  Group group{};                         // empty: the default process group
  std::optional<int64_t> group_src{};    // sender's rank in `group` (exclusive with src)
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  bool consolidated = false;
};

}  // namespace tensordict::dist

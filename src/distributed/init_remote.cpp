#include "tensordict/distributed/init_remote.h"

#include <algorithm>

#include "remote.h"
#include "tensordict/distributed/collectives.h"

namespace tensordict::dist {

TensorDict init_remote(const TensorDict& td, std::optional<int64_t> dst,
                       const InitRemoteOptions& options) {
  if (options.use_broadcast) {
    // This rank is the source: its rank in the group, never a global rank (the reference
    // passes the group rank where torch expects a global one).
    const Group group = detail::resolve_group(options.group);
    return broadcast(td, std::nullopt,
                     {.group = group,
                      .group_src = group.rank(),
                      .device = options.device,
                      .tensorclass_type = options.tensorclass_type,
                      .timeout = options.timeout});
  }
  const auto peer = detail::resolve_peer("init_remote", dst, options.group_dst, options.group,
                                         "dst", "group_dst", /*refuse_self=*/true);
  const detail::Waiter w("init_remote", options.timeout, c10::str("rank ", peer.rank));
  TensorDict c = detail::consolidated(td, std::nullopt);
  const at::Tensor storage = consolidated_storage(c);
  TransportFields fields{{"_total_bytes", storage.numel()}};
  if (options.tensorclass_type) fields.emplace_back("_tensorclass_type", *options.tensorclass_type);
  const std::string pickle = detail::metadata_pickle(c, fields);
  detail::send_object_and_storage(w, peer, pickle, storage, options.device.value_or(at::kCPU));
  return c;
}

TensorDict from_remote_init(std::optional<int64_t> src, const FromRemoteInitOptions& options,
                            std::optional<std::string>* tensorclass_type) {
  if (options.use_broadcast) {
    return broadcast(TensorDict(), src,
                     {.group = options.group,
                      .group_src = options.group_src,
                      .device = options.device,
                      .max_total_bytes = options.max_total_bytes,
                      .timeout = options.timeout},
                     tensorclass_type);
  }
  constexpr const char* kCall = "from_remote_init";
  const int64_t max_total_bytes = detail::resolve_max_total_bytes(kCall, options.max_total_bytes);
  const auto peer = detail::resolve_peer(kCall, src, options.group_src, options.group, "src",
                                         "group_src", /*refuse_self=*/true);
  if (options.late == Late::kDrop) {
    // Each late transfer is received as late="deliver" would (its pickle says what follows)
    // and dropped.
    FromRemoteInitOptions deliver = options;
    deliver.late = Late::kDeliver;
    deliver.group = peer.group;
    deliver.group_src = peer.rank;
    const auto deadline =
        detail::Clock::now() + options.timeout.value_or(std::chrono::milliseconds(0));
    while (detail::LateMessages::get().has(detail::GroupKey(peer.group), peer.rank, {0})) {
      if (options.timeout) {  // the late transfers share the call's timeout
        deliver.timeout = std::max(
            std::chrono::milliseconds(1),
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - detail::Clock::now()));
      }
      from_remote_init(std::nullopt, deliver, nullptr);
    }
  }
  const detail::Waiter w(kCall, options.timeout, c10::str("rank ", peer.rank));
  const at::Device device = options.device.value_or(at::kCPU);
  const std::string pickle = detail::recv_object(w, peer, device);
  auto in = detail::parse_incoming(kCall, pickle, max_total_bytes, /*padded=*/false);
  // Refused metadata with a sane size: the storage message is still taken (into a buffer that
  // costs next to no memory, then dropped), so that the sender completes and the pair stays
  // in step.
  auto buffer = detail::storage_buffer(in, detail::transfer_bytes(in, /*padded=*/false), device);
  w.wait(w.recv(peer, buffer.bytes, 0, {&buffer.stamp}),
         c10::str("the storage of ", buffer.bytes.numel(), " bytes (tag 0)"));
  TensorDict out = detail::finish(in, buffer);
  if (tensorclass_type != nullptr) *tensorclass_type = in.tensorclass_type;
  return out;
}

}  // namespace tensordict::dist

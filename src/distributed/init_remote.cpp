#include "tensordict/distributed/init_remote.h"

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
                      .tensorclass_type = options.tensorclass_type});
  }
  const auto peer = detail::resolve_peer("init_remote", dst, options.group_dst, options.group,
                                         "dst", "group_dst", /*refuse_self=*/true);
  TensorDict c = detail::consolidated(td, std::nullopt);
  const at::Tensor storage = consolidated_storage(c);
  TransportFields fields{{"_total_bytes", storage.numel()}};
  if (options.tensorclass_type) fields.emplace_back("_tensorclass_type", *options.tensorclass_type);
  const std::string pickle = detail::metadata_pickle(c, fields);
  detail::send_object_and_storage(peer, pickle, storage, options.device.value_or(at::kCPU));
  return c;
}

TensorDict from_remote_init(std::optional<int64_t> src, const FromRemoteInitOptions& options,
                            std::optional<std::string>* tensorclass_type) {
  if (options.use_broadcast) {
    return broadcast(TensorDict(), src,
                     {.group = options.group,
                      .group_src = options.group_src,
                      .device = options.device,
                      .max_total_bytes = options.max_total_bytes},
                     tensorclass_type);
  }
  constexpr const char* kCall = "from_remote_init";
  const auto peer = detail::resolve_peer(kCall, src, options.group_src, options.group, "src",
                                         "group_src", /*refuse_self=*/false);
  const at::Device device = options.device.value_or(at::kCPU);
  const std::string pickle = detail::recv_object(kCall, peer, device);
  auto in = detail::parse_incoming(kCall, pickle, options.max_total_bytes, /*padded=*/false);
  // Refused metadata with a sane size: the storage message is still taken (then dropped), so
  // that the sender completes.
  std::vector<at::Tensor> storage{
      detail::byte_buffer(detail::transfer_bytes(in, /*padded=*/false), device)};
  detail::wait_all({peer.group.recv(storage, peer.rank, 0)});
  TensorDict out = detail::finish(in, storage[0]);
  if (tensorclass_type != nullptr) *tensorclass_type = in.tensorclass_type;
  return out;
}

}  // namespace tensordict::dist

#pragma once
// Tensorclasses over c10d. A tensorclass is a `const TensorDict&` (its td()), so every call of
// p2p.h and collectives.h takes one as it is: send, recv, isend, irecv (and their _early /
// _premature forms), all_reduce, reduce. Non-tensor fields follow the TensorDict rules: the
// per-leaf and consolidated point-to-point messages carry tensors only (the receiver keeps its
// own non-tensor values, as with the reference); init_remote, broadcast, all_gather and scatter
// carry them in the metadata.
//
// The calls below are the ones whose result or wire differs for a tensorclass:
// * init_remote and broadcast send the class's type name as "_tensorclass_type", as the
//   reference's tensorclass does (so a Python receiver rebuilds that class);
// * from_remote_init<T>, broadcast, all_gather, scatter return the tensorclass, validated as
//   T::from_tensordict() validates (ValueError / TypeError naming the field and the class).
//   A received "_tensorclass_type" must be T's type_name() (TypeError naming both otherwise);
//   a payload without one (a plain TensorDict) is accepted when its fields validate.
//
//   auto d = dist::from_remote_init<MyData>(0);           // receiver
//   dist::init_remote(d, 1);                               // sender (any rank, any tensorclass)
//   MyData b = dist::broadcast(rank == 0 ? d : MyData{}, 0);
//
// Every receiver takes the whole transfer before it validates, so a refused payload never
// leaves the sender blocked.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/distributed/collectives.h"
#include "tensordict/distributed/init_remote.h"
#include "tensordict/distributed/options.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/tensorclass.h"

namespace tensordict::dist {

/// init_remote() of the tensorclass's TensorDict, with options.tensorclass_type set to
/// T::type_name() unless the caller set it. Returns the consolidated tensorclass that was sent
/// (`tc` itself when it was consolidated): send later values with
/// send(result, dst, {.consolidated = true}).
template <TensorClassType T>
T init_remote(const T& tc, std::optional<int64_t> dst, InitRemoteOptions options = {}) {
  if (!options.tensorclass_type) options.tensorclass_type = std::string(T::type_name());
  return tensordict::detail::tc_from<T>(init_remote(tc.td(), dst, options), "init_remote");
}

/// Receives what init_remote() sends, as a T: from_remote_init(), then the type check and the
/// validation described above. Receive later values with recv(result, src, {.consolidated =
/// true}).
template <TensorClassType T>
T from_remote_init(std::optional<int64_t> src, const FromRemoteInitOptions& options = {}) {
  std::optional<std::string> type;
  TensorDict td = from_remote_init(src, options, &type);
  tensordict::detail::check_tensorclass_type<T>("from_remote_init", type);
  return tensordict::detail::tc_from<T>(std::move(td), "from_remote_init");
}

/// broadcast() of a tensorclass: the source sends T::type_name() (unless options.tensorclass_type
/// is set), every rank returns a T. On the other ranks `tc` is not used (pass T{}).
template <TensorClassType T>
T broadcast(const T& tc, std::optional<int64_t> src, BroadcastOptions options = {}) {
  if (!options.tensorclass_type) options.tensorclass_type = std::string(T::type_name());
  std::optional<std::string> type;
  TensorDict td = broadcast(tc.td(), src, options, &type);
  tensordict::detail::check_tensorclass_type<T>("broadcast", type);
  return tensordict::detail::tc_from<T>(std::move(td), "broadcast");
}

/// all_gather() of a tensorclass: every rank's, in group-rank order, each validated as a T.
template <TensorClassType T>
std::vector<T> all_gather(const T& tc, const AllGatherOptions& options = {}) {
  std::vector<T> out;
  for (TensorDict& td : all_gather(tc.td(), options)) {
    out.push_back(tensordict::detail::tc_from<T>(std::move(td), "all_gather"));
  }
  return out;
}

/// scatter() of tensorclasses: on the source one per group rank; elsewhere ignored (write
/// scatter<MyData>(src, {})). Returns this rank's, validated as a T.
template <TensorClassType T>
T scatter(std::optional<int64_t> src, const std::vector<T>& tensorclasses,
          const ScatterOptions& options = {}) {
  std::vector<TensorDict> tds(tensorclasses.begin(), tensorclasses.end());
  return tensordict::detail::tc_from<T>(scatter(src, tds, options), "scatter");
}

}  // namespace tensordict::dist

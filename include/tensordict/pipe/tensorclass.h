#pragma once
// Tensorclasses over the UCX pipe. Sending needs nothing new: a tensorclass is a
// `const TensorDict&`, so pipe.send(tc) sends its TensorDict (non-tensor fields travel in the
// consolidated metadata). Receiving as a tensorclass is recv<T>() below. The uncollated mode
// carries tensor leaves only (docs/wire-format.md §6.2), so a tensorclass with a nested or a
// non-tensor field cannot be received through it (recv<T> reports the missing field).

#include <c10/core/Device.h>

#include <optional>

#include "tensordict/pipe/pipe.h"
#include "tensordict/tensorclass.h"

namespace tensordict::pipe {

/// pipe.recv() as a T, validated as T::from_tensordict() validates (ValueError / TypeError
/// naming the field and the class). `into` and `device` as in Pipe::recv(): on the same schema
/// the bytes land in `into`'s storage (or the previous result's), which is returned again.
template <TensorClassType T>
T recv(Pipe& pipe, const std::optional<T>& into = std::nullopt,
       std::optional<at::Device> device = std::nullopt) {
  std::optional<TensorDict> td;
  if (into) td = into->td();
  return tensordict::detail::tc_from<T>(pipe.recv(td, device), "Pipe::recv");
}

}  // namespace tensordict::pipe

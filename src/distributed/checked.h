#pragma once
// Checked point-to-point transfers (SendOptions::checked / RecvOptions::checked), our extension
// of the reference's wire: a header and a schema travel before the payload, so a receiver whose
// TensorDict differs from the sender's raises a named error instead of being aborted by Gloo
// (sent more bytes than it posted) or silently filled in part (sent fewer). Private to the c10d
// layer; the byte format is docs/wire-format.md §1.6, written and read in src/wire/checked.cpp.

#include <vector>

#include "tensordict/tensor_dict.h"
#include "waiter.h"

namespace tensordict::dist::detail {

/// Posts the header, the schema and the payload chunks of `td` to `peer`, all on `tag` (c10d
/// matches the messages of one tag between two ranks in order). Per-leaf payload: each leaf in
/// wire order; consolidated: td's consolidated storage (consolidating a copy if needed).
std::vector<WorkPtr> post_checked_send(const Waiter& waiter, const TensorDict& td, const Peer& peer,
                                       int tag, bool consolidated);

/// Receives the header and the schema (blocking), then, when the sender's schema equals td's,
/// posts the payload receives into td and returns their works. On a mismatch it receives the
/// payload into a scratch buffer of at most one chunk, leaves td unchanged and throws an error
/// naming the first differing key, dtype or shape. A header that is not a checked header (the
/// peer did not pass checked=True) or is malformed is an error too.
/// The header and the schema are waited for through `waiter` (its call names the errors); a
/// staged waiter (a timeout) receives the payload into its own buffers, which its land()
/// copies into td. With Late::kDrop, checked transfers that earlier calls left parked on `tag`
/// are first received whole into a throwaway copy of td and dropped.
std::vector<WorkPtr> post_checked_recv(const Waiter& waiter, const TensorDict& td, const Peer& peer,
                                       int tag, bool consolidated, Late late);

}  // namespace tensordict::dist::detail

#include "checked.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "core/byte_tensor.h"
#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/errors.h"
#include "wire/checked.h"
#include "wire/leaf_order.h"

namespace tensordict::dist::detail {

using namespace wire::checked;  // the bytes of this protocol (src/wire/checked.cpp)
using core::bytes_tensor;

namespace {

// A contiguous tensor's bytes as a 1-D uint8 tensor sharing its memory (and keeping it alive).
at::Tensor bytes_of(const at::Tensor& t) {
  return at::from_blob(
      t.data_ptr(), {t.numel() * static_cast<int64_t>(t.element_size())}, [keep = t](void*) {},
      t.options().dtype(at::kByte));
}

// Appends the chunks of `bytes` (1-D uint8) to `out`.
void chunk(const at::Tensor& bytes, int64_t chunk_bytes, std::vector<at::Tensor>& out) {
  const int64_t n = bytes.numel();
  for (int64_t off = 0; off < n; off += chunk_bytes) {
    out.push_back(bytes.narrow(0, off, std::min(chunk_bytes, n - off)));
  }
}

// Receives the messages a mismatched sender sends, one at a time into one scratch buffer of at
// most one chunk; nothing is kept per message, so a peer announcing many cannot make the
// receiver build a list of them.
void drain(const Waiter& waiter, const Peer& peer, int tag, const Header& h, const uint8_t* blob,
           at::Device device) {
  const auto payload = static_cast<int64_t>(h.payload_bytes);
  if (payload == 0) return;
  at::Tensor scratch = at::empty({std::min(static_cast<int64_t>(h.chunk_bytes), payload)},
                                 at::TensorOptions().dtype(at::kByte).device(device));
  for_each_message(waiter.call(), h, blob, [&](int64_t n) {
    at::Tensor part = scratch.narrow(0, 0, n);
    waiter.wait(waiter.recv(peer, part, tag),
                c10::str("a mismatched sender's payload, drained (tag ", tag, ")"));
  });
}

// A schema with its encoding and hash.
struct EncodedSchema {
  Schema schema;
  std::string blob;
  uint64_t hash = 0;
};

EncodedSchema encoded(Schema schema) {
  EncodedSchema out{std::move(schema), {}, 0};
  out.blob = encode(out.schema);
  out.hash = fnv1a(reinterpret_cast<const uint8_t*>(out.blob.data()), out.blob.size());
  return out;
}

// The schema of a consolidated TensorDict `c`, kept per thread for the last consolidated state
// seen: a state never changes, and a loop moves the same TensorDict again and again. Only a
// TensorDict that still holds its consolidation's views is served from it.
const EncodedSchema& consolidated_schema(const TensorDict& c) {
  thread_local std::weak_ptr<const ConsolidatedState> last;
  thread_local EncodedSchema cached;
  const auto state = c.consolidated_state();
  const bool holds = state && is_consolidated(c);
  if (!holds || last.lock() != state) {
    at::Tensor storage = consolidated_storage(c);
    cached = encoded(schema_of(wire::leaves_in_order(c), &storage));
    last = holds ? state : nullptr;
  }
  return cached;
}

at::Device device_of(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() ? at::Device(at::kCPU) : tensors.front().device();
}

}  // namespace

std::vector<WorkPtr> post_checked_send(const Waiter& waiter, const TensorDict& td, const Peer& peer,
                                       int tag, bool consolidated) {
  EncodedSchema per_leaf;
  const EncodedSchema* mine = &per_leaf;
  std::vector<at::Tensor> payload;  // 1-D uint8 views, in wire order
  if (consolidated) {
    TensorDict c = is_consolidated(td) ? td : consolidate(td);
    mine = &consolidated_schema(c);
    payload.push_back(bytes_of(consolidated_storage(c).contiguous()));
  } else {
    const WireLeaves leaves = wire::leaves_in_order(td);
    per_leaf = encoded(schema_of(leaves, nullptr));
    for (const auto& [path, leaf] : leaves) {
      if (leaf.numel() > 0) payload.push_back(bytes_of(sendable(leaf)));
    }
  }
  const Schema& schema = mine->schema;
  const std::string& blob = mine->blob;
  Header h;
  h.mode = schema.mode;
  h.payload_bytes = static_cast<uint64_t>(schema.payload_bytes);
  h.schema_bytes = blob.size();
  h.schema_hash = mine->hash;
  h.chunk_bytes = kChunkBytes;
  h.leaf_count = schema.leaves.size();
  TORCH_CHECK_VALUE(h.schema_bytes <= kMaxSchemaBytes,
                    "send(checked=True): the schema of this "
                    "TensorDict is ",
                    h.schema_bytes, " bytes, above the limit of ", kMaxSchemaBytes);

  const at::Device device = device_of(payload);
  std::vector<at::Tensor> messages{bytes_tensor(encode_header(h), device),
                                   bytes_tensor(blob, device)};
  for (const auto& bytes : payload) chunk(bytes, kChunkBytes, messages);
  return post_all(messages.size(), [&](size_t i) { return waiter.send(peer, messages[i], tag); });
}

namespace {

// late="drop": each late transfer is received as late="deliver" would receive it, into a copy
// of td (its later messages depend on its header), then dropped; a mismatched one is drained.
void drop_late(const Waiter& waiter, const TensorDict& td, const Peer& peer, int tag,
               bool consolidated) {
  while (LateMessages::get().has(GroupKey(peer.group), peer.rank, {tag})) {
    const TensorDict scratch = consolidated ? consolidate(td.clone()) : td.clone();
    try {
      waiter.wait(post_checked_recv(waiter, scratch, peer, tag, consolidated, Late::kDeliver),
                  [](size_t) { return std::string("a late checked payload, to be dropped"); });
    } catch (const SchemaMismatchError&) {
      // dropped all the same
    }
    waiter.land();  // into the scratch copy; what it received is not parked again
  }
}

// The receiver's side: its schema, and what the payload lands in, in wire order.
struct Receiver {
  EncodedSchema per_leaf;
  const EncodedSchema* shared = nullptr;  // a consolidated TensorDict's own, kept by it
  std::vector<at::Tensor> targets;
  const EncodedSchema& encoded() const { return shared ? *shared : per_leaf; }
};

Receiver receiver_of(const char* call, const TensorDict& td, bool consolidated) {
  Receiver r;
  if (consolidated) {
    r.shared = &consolidated_schema(td);
    r.targets.push_back(consolidated_storage(td));
    return r;
  }
  const WireLeaves leaves = wire::leaves_in_order(td);
  r.per_leaf = encoded(schema_of(leaves, nullptr));
  for (const auto& [path, leaf] : leaves) {
    check_writable(call, leaf, "receive into", "receiver");
    r.targets.push_back(leaf);
  }
  return r;
}

Header recv_header(const Waiter& waiter, const Peer& peer, int tag, at::Device device) {
  const char* call = waiter.call();
  // With room after it (on the CPU): a longer first message is refused by name, not Gloo's abort.
  const auto n = static_cast<int64_t>(kCheckedHeaderBytes);
  at::Tensor header_t =
      at::empty({n + room_for(n)}, at::TensorOptions().dtype(at::kByte).device(device))
          .narrow(0, 0, n);
  TailStamp header_stamp(header_t);
  waiter.wait(waiter.recv(peer, header_t, tag, {&header_stamp}, false, /*room=*/true),
              c10::str("the checked header (tag ", tag, ")"));
  TD_CHECK_PEER(!header_stamp.short_message(), call,
                "(checked=True): the peer's first message "
                "is shorter than a checked-transfer header (",
                kCheckedHeaderBytes, " bytes); the sender must pass checked=True too");
  header_t = header_t.cpu();
  return decode_header(call, header_t.data_ptr<uint8_t>());
}

// Posts the payload's receives into `targets`, in chunks of `chunk_bytes`; on failure, no work
// is left behind.
std::vector<WorkPtr> post_payload(const Waiter& waiter, const Peer& peer, int tag,
                                  const std::vector<at::Tensor>& targets, int64_t chunk_bytes) {
  std::vector<WorkPtr> works;
  try {
    for (const auto& target : targets) {
      if (target.numel() == 0) continue;
      const bool direct = waiter.staged() || target.is_contiguous();
      at::Tensor buffer;
      if (waiter.staged()) {
        buffer = waiter.stage(target);  // copied into target by the caller's land()
      } else {
        buffer = direct ? target : at::empty_like(target, at::MemoryFormat::Contiguous);
      }
      std::vector<at::Tensor> chunks;
      chunk(bytes_of(buffer), chunk_bytes, chunks);
      const size_t first = works.size();
      for (auto& c : chunks) works.push_back(waiter.recv(peer, c, tag, {}, /*copy_late=*/true));
      if (!direct) {
        std::vector<WorkPtr> leaf_works(works.begin() + first, works.end());
        works.resize(first);
        works.push_back(copy_back_work(std::move(leaf_works), target, buffer));
      }
    }
  } catch (...) {
    abandon(works);
    throw;
  }
  return works;
}

}  // namespace

std::vector<WorkPtr> post_checked_recv(const Waiter& waiter, const TensorDict& td, const Peer& peer,
                                       int tag, bool consolidated, Late late) {
  const char* call = waiter.call();
  if (late == Late::kDrop) drop_late(waiter, td, peer, tag, consolidated);
  const Receiver r = receiver_of(call, td, consolidated);
  const Schema& mine = r.encoded().schema;
  const std::string& mine_blob = r.encoded().blob;
  const at::Device device = device_of(r.targets);
  const Header h = recv_header(waiter, peer, tag, device);

  // A header announcing this receiver's own schema size, hash and payload: the schema's and the
  // payload's receives are posted together, saving a message latency. A schema that then
  // differs all the same (a hash collision, or a lying peer) has written the payload.
  const bool announced_same = h.mode == mine.mode && h.schema_bytes == mine_blob.size() &&
                              h.schema_hash == r.encoded().hash &&
                              static_cast<int64_t>(h.payload_bytes) == mine.payload_bytes;

  at::Tensor blob_t = at::empty({static_cast<int64_t>(h.schema_bytes)},
                                at::TensorOptions().dtype(at::kByte).device(device));
  TailStamp blob_stamp(blob_t);
  WorkPtr blob_work = waiter.recv(peer, blob_t, tag, {&blob_stamp});
  std::vector<WorkPtr> works;
  if (announced_same) {
    works = post_payload(waiter, peer, tag, r.targets, static_cast<int64_t>(h.chunk_bytes));
  }
  try {
    waiter.wait(blob_work, c10::str("the checked schema (tag ", tag, ")"));
  } catch (...) {
    abandon(works);
    throw;
  }
  if (blob_stamp.short_message()) {
    abandon(works);
    TD_THROW(MalformedPeerDataError, call,
             "(checked=True): the sender's schema message is "
             "shorter than the ",
             h.schema_bytes, " bytes its header announced");
  }
  blob_t = blob_t.cpu();
  const auto* blob = blob_t.data_ptr<uint8_t>();
  // Equal to our own bytes, the schema has our hash, which the header announced.
  const bool same = announced_same && std::memcmp(blob, mine_blob.data(), mine_blob.size()) == 0;
  if (same) return works;
  // A different schema. Announced as ours, its payload is already on its way into td: let it
  // land. Otherwise it is drained into scratch space and td stays as it was.
  if (announced_same) waiter.wait(works, [](size_t) { return std::string("the payload"); });
  TD_CHECK_PEER(fnv1a(blob, h.schema_bytes) == h.schema_hash, call,
                "(checked=True): the sender's schema does not match the header's hash");
  const std::string difference = describe_mismatch(call, h, blob, mine);
  if (!announced_same) drain(waiter, peer, tag, h, blob, device);
  TD_THROW(SchemaMismatchError, call,
           "(checked=True): the sender's TensorDict does not match this one: ", difference,
           announced_same && !waiter.staged()
               ? ". Its schema's size and hash announced this one's, so its payload was "
                 "received into this TensorDict"
               : ". The sender's payload was received into scratch space and dropped; this "
                 "TensorDict is unchanged");
}

}  // namespace tensordict::dist::detail

#pragma once
// The bytes of a checked transfer (docs/reliability.md, "The messages"): the header, the
// schema, and the receiver's reading of both, with every bound a peer's announcement must
// pass. No transport here, so that fuzz/checked.cpp reads a peer's bytes exactly as a
// receiver does. Used by the c10d layer (src/distributed/checked.cpp).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace tensordict::wire::checked {

inline constexpr size_t kCheckedHeaderBytes = 64;
/// Payload messages are at most this long, which bounds the scratch a mismatched receiver
/// drains into; large enough that per-message costs vanish against the copy.
inline constexpr int64_t kChunkBytes = int64_t{4} << 20;
/// Bounds on what a peer's header may announce before anything is allocated for it. A chunk
/// must be large: each costs the receiver a posted receive (about 1 kB of bookkeeping), and a
/// peer announcing 1-byte chunks would make it post one per byte.
inline constexpr uint64_t kMaxSchemaBytes = uint64_t{64} << 20;
inline constexpr uint64_t kMinChunkBytes = uint64_t{1} << 20;
inline constexpr uint64_t kMaxChunkBytes = uint64_t{64} << 20;

enum class Mode : uint32_t { kPerLeaf = 0, kConsolidated = 1 };

/// What must agree between the two sides, per leaf in wire order.
struct LeafSchema {
  std::vector<std::string> path;
  std::string dtype;
  std::vector<int64_t> sizes;
  int64_t nbytes = 0;
  // Consolidated only: where the leaf lies in the storage.
  int64_t offset = 0;
  std::vector<int64_t> strides;
};

struct Schema {
  Mode mode = Mode::kPerLeaf;
  std::vector<LeafSchema> leaves;
  int64_t payload_bytes = 0;  // the sum of the leaves, or the consolidated storage's size
};

struct Header {
  Mode mode = Mode::kPerLeaf;
  uint64_t payload_bytes = 0;
  uint64_t schema_bytes = 0;
  uint64_t schema_hash = 0;
  uint64_t chunk_bytes = 0;
  uint64_t leaf_count = 0;
};

using WireLeaves = std::vector<std::pair<std::vector<std::string>, at::Tensor>>;

/// 64-bit FNV-1a, the hash of the header and of the schema.
uint64_t fnv1a(const uint8_t* p, size_t n);

/// The schema of `leaves` (a wire_order()), and with `storage`, of their consolidated layout.
/// The leaves must be transferable: post_send / post_recv check them (check_leaves), and a
/// consolidated TensorDict's leaves are views of its storage.
Schema schema_of(const WireLeaves& leaves, const at::Tensor* storage);
std::string encode(const Schema& s);
std::string encode_header(const Header& h);

/// A peer's kCheckedHeaderBytes of header, validated: magic, version, mode, its hash, and the
/// bounds on the schema size and the chunk size. `call` names the errors.
Header decode_header(const char* call, const uint8_t* p);

/// The first difference between the sender's schema (`blob`, h.schema_bytes long, its hash
/// already checked) and ours, in words. The blob is validated as it is read, one leaf at a
/// time; a fault, or a blob that disagrees with the header, is an error.
std::string describe_mismatch(const char* call, const Header& h, const uint8_t* blob,
                              const Schema& mine);

/// Calls fn(n) for the size of each payload message the sender of `h` and `blob` sends
/// (its leaves, or its storage, cut in chunks), without keeping a list of them.
void for_each_message(const char* call, const Header& h, const uint8_t* blob,
                      const std::function<void(int64_t)>& fn);

}  // namespace tensordict::wire::checked

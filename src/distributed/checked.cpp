#include "checked.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <string_view>

#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/dtypes.h"
#include "tensordict/nested_key.h"

namespace tensordict::dist::detail {
namespace {

constexpr std::array<char, 8> kMagic = {'T', 'D', 'C', 'H', 'E', 'C', 'K', 'D'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;
// Payload messages are at most this long, which bounds the scratch a mismatched receiver
// drains into; large enough that per-message costs vanish against the copy.
constexpr int64_t kChunkBytes = int64_t{4} << 20;
// Bounds on what a peer's header may announce before anything is allocated for it.
constexpr uint64_t kMaxSchemaBytes = uint64_t{64} << 20;
constexpr uint64_t kMaxChunkBytes = uint64_t{64} << 20;
constexpr uint64_t kMaxLeaves = uint64_t{1} << 24;
constexpr uint32_t kMaxDepth = 1024;
constexpr uint32_t kMaxDims = 64;
constexpr uint32_t kMaxDtypeName = 64;

enum class Mode : uint32_t { kPerLeaf = 0, kConsolidated = 1 };

const char* mode_name(Mode m) {
  return m == Mode::kConsolidated ? "consolidated=True" : "consolidated=False";
}

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) {
    h = (h ^ p[i]) * 0x100000001b3ULL;
  }
  return h;
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void put_str(std::string& out, std::string_view s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

// Reads little-endian fields from a peer's bytes; every read is bounds-checked.
class Reader {
 public:
  Reader(const char* call, const uint8_t* data, size_t size)
      : call_(call), data_(data), size_(size) {}
  uint64_t u64(const char* what) { return get(8, what); }
  uint32_t u32(const char* what) { return static_cast<uint32_t>(get(4, what)); }
  std::string str(uint32_t max, const char* what) {
    const uint32_t n = u32(what);
    TORCH_CHECK(n <= max, call_, "(checked=True): the sender's schema has a ", what, " of ", n,
                " bytes (at most ", max, ")");
    need(n, what);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }
  size_t left() const { return size_ - pos_; }

 private:
  void need(size_t n, const char* what) const {
    TORCH_CHECK(size_ - pos_ >= n, call_, "(checked=True): the sender's schema ends inside a ",
                what);
  }
  uint64_t get(int n, const char* what) {
    need(n, what);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{data_[pos_ + i]} << (8 * i);
    pos_ += n;
    return v;
  }
  const char* call_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// What must agree between the two sides, per leaf in wire order.
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

using WireLeaves = std::vector<std::pair<std::vector<std::string>, at::Tensor>>;

// The schema of `leaves` (a wire_order()), and with `storage`, of their consolidated layout.
Schema schema_of(const WireLeaves& leaves, const at::Tensor* storage) {
  Schema s;
  s.mode = storage ? Mode::kConsolidated : Mode::kPerLeaf;
  for (const auto& [path, leaf] : leaves) {
    // Quantized storage is not numel * element size bytes (quint4x2 packs two per byte).
    TORCH_CHECK_VALUE(!c10::isQIntType(leaf.scalar_type()), "checked=True: leaf ",
                      NestedKey(path).str(), " has the quantized dtype ",
                      dtype_name(leaf.scalar_type()), ", which checked transfers cannot carry");
    LeafSchema l;
    l.path = path;
    l.dtype = dtype_name(leaf.scalar_type());
    l.sizes = leaf.sizes().vec();
    l.nbytes = leaf.numel() * static_cast<int64_t>(leaf.element_size());
    if (storage) {
      l.offset = leaf.storage_offset() * static_cast<int64_t>(leaf.element_size()) -
                 storage->storage_offset() * static_cast<int64_t>(storage->element_size());
      l.strides = leaf.strides().vec();
    } else {
      s.payload_bytes += l.nbytes;
    }
    s.leaves.push_back(std::move(l));
  }
  if (storage) {
    s.payload_bytes = storage->numel() * static_cast<int64_t>(storage->element_size());
  }
  return s;
}

std::string encode(const Schema& s) {
  std::string out;
  put_u64(out, s.leaves.size());
  for (const auto& l : s.leaves) {
    put_u32(out, static_cast<uint32_t>(l.path.size()));
    for (const auto& part : l.path) put_str(out, part);
    put_str(out, l.dtype);
    put_u32(out, static_cast<uint32_t>(l.sizes.size()));
    for (int64_t d : l.sizes) put_u64(out, static_cast<uint64_t>(d));
    if (s.mode == Mode::kConsolidated) {
      put_u64(out, static_cast<uint64_t>(l.offset));
      for (int64_t st : l.strides) put_u64(out, static_cast<uint64_t>(st));
    }
  }
  return out;
}

int64_t checked_int(const char* call, uint64_t v, const char* what) {
  TORCH_CHECK(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), call,
              "(checked=True): the sender's ", what, " is out of range (", v, ")");
  return static_cast<int64_t>(v);
}

// The sender's schema, validated: every count against the bytes left, every size non-negative
// and every byte count free of overflow, so that draining by it is safe.
Schema decode(const char* call, Mode mode, const uint8_t* data, size_t size) {
  Reader r(call, data, size);
  Schema s;
  s.mode = mode;
  const uint64_t count = r.u64("leaf count");
  TORCH_CHECK(count <= kMaxLeaves && count <= r.left() / 12, call,
              "(checked=True): the sender's schema announces ", count, " leaves in ", size,
              " bytes");
  s.leaves.resize(count);
  for (auto& l : s.leaves) {
    const uint32_t depth = r.u32("key depth");
    TORCH_CHECK(depth >= 1 && depth <= kMaxDepth, call,
                "(checked=True): the sender's schema has a key of depth ", depth);
    l.path.resize(depth);
    for (auto& part : l.path) part = r.str(std::numeric_limits<uint32_t>::max(), "key");
    l.dtype = r.str(kMaxDtypeName, "dtype name");
    const auto dtype = dtype_from_name(l.dtype);
    TORCH_CHECK(dtype, call, "(checked=True): the sender's leaf ", NestedKey(l.path).str(),
                " has an unknown dtype '", l.dtype, "'");
    const uint32_t ndim = r.u32("shape length");
    TORCH_CHECK(ndim <= kMaxDims, call, "(checked=True): the sender's leaf ",
                NestedKey(l.path).str(), " has ", ndim, " dimensions");
    int64_t numel = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      const int64_t dim = checked_int(call, r.u64("shape"), "shape");
      l.sizes.push_back(dim);
      TORCH_CHECK(!__builtin_mul_overflow(numel, dim, &numel), call,
                  "(checked=True): the sender's leaf ", NestedKey(l.path).str(),
                  " has a shape whose size overflows");
    }
    TORCH_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(*dtype)),
                                        &l.nbytes),
                call, "(checked=True): the sender's leaf ", NestedKey(l.path).str(),
                " has a byte size that overflows");
    if (mode == Mode::kConsolidated) {
      l.offset = checked_int(call, r.u64("offset"), "offset");
      for (uint32_t d = 0; d < ndim; ++d) {
        l.strides.push_back(checked_int(call, r.u64("stride"), "stride"));
      }
    } else {
      TORCH_CHECK(!__builtin_add_overflow(s.payload_bytes, l.nbytes, &s.payload_bytes), call,
                  "(checked=True): the sender's leaves add up to more bytes than fit in 64 bits");
    }
  }
  TORCH_CHECK(r.left() == 0, call, "(checked=True): ", r.left(),
              " bytes follow the sender's schema");
  return s;
}

struct Header {
  Mode mode = Mode::kPerLeaf;
  uint64_t payload_bytes = 0;
  uint64_t schema_bytes = 0;
  uint64_t schema_hash = 0;
  uint64_t chunk_bytes = 0;
  uint64_t leaf_count = 0;
};

std::string encode_header(const Header& h) {
  std::string out(kMagic.begin(), kMagic.end());
  put_u32(out, kVersion);
  put_u32(out, static_cast<uint32_t>(h.mode));
  put_u64(out, h.payload_bytes);
  put_u64(out, h.schema_bytes);
  put_u64(out, h.schema_hash);
  put_u64(out, h.chunk_bytes);
  put_u64(out, h.leaf_count);
  put_u64(out, fnv1a(reinterpret_cast<const uint8_t*>(out.data()), out.size()));
  return out;
}

Header decode_header(const char* call, const uint8_t* p) {
  TORCH_CHECK(std::memcmp(p, kMagic.data(), kMagic.size()) == 0, call,
              "(checked=True): the peer's first message is not a checked-transfer header; the "
              "sender must pass checked=True too");
  Reader r(call, p + kMagic.size(), kHeaderBytes - kMagic.size());
  const uint32_t version = r.u32("version");
  TORCH_CHECK(version == kVersion, call, "(checked=True): the sender speaks checked-transfer "
              "version ", version, ", this process version ", kVersion);
  const uint32_t mode = r.u32("mode");
  Header h;
  h.payload_bytes = r.u64("payload size");
  h.schema_bytes = r.u64("schema size");
  h.schema_hash = r.u64("schema hash");
  h.chunk_bytes = r.u64("chunk size");
  h.leaf_count = r.u64("leaf count");
  const uint64_t hash = r.u64("header hash");
  TORCH_CHECK(hash == fnv1a(p, kHeaderBytes - 8), call,
              "(checked=True): the checked-transfer header is corrupt (hash mismatch)");
  TORCH_CHECK(mode <= 1, call, "(checked=True): the header has an unknown mode ", mode);
  h.mode = static_cast<Mode>(mode);
  TORCH_CHECK(h.schema_bytes <= kMaxSchemaBytes, call, "(checked=True): the sender's schema is ",
              h.schema_bytes, " bytes, above the limit of ", kMaxSchemaBytes);
  TORCH_CHECK(h.chunk_bytes >= 1 && h.chunk_bytes <= kMaxChunkBytes, call,
              "(checked=True): the header's chunk size ", h.chunk_bytes, " is not in [1, ",
              kMaxChunkBytes, "]");
  checked_int(call, h.payload_bytes, "payload size");
  return h;
}

// A contiguous tensor's bytes as a 1-D uint8 tensor sharing its memory (and keeping it alive).
at::Tensor bytes_of(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {t.numel() * static_cast<int64_t>(t.element_size())},
                       [keep = t](void*) {}, t.options().dtype(at::kByte));
}

// Appends the chunks of `bytes` (1-D uint8) to `out`.
void chunk(const at::Tensor& bytes, int64_t chunk_bytes, std::vector<at::Tensor>& out) {
  const int64_t n = bytes.numel();
  for (int64_t off = 0; off < n; off += chunk_bytes) {
    out.push_back(bytes.narrow(0, off, std::min(chunk_bytes, n - off)));
  }
}

at::Tensor bytes_tensor(const std::string& s, at::Device device) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());  // null data when empty
  return t.to(device);
}

// The message sizes of a payload laid out as `schema` says, cut in chunks.
std::vector<int64_t> message_sizes(const Schema& s, int64_t chunk_bytes) {
  std::vector<int64_t> sizes;
  auto add = [&](int64_t n) {
    for (int64_t off = 0; off < n; off += chunk_bytes) {
      sizes.push_back(std::min(chunk_bytes, n - off));
    }
  };
  if (s.mode == Mode::kConsolidated) {
    add(s.payload_bytes);
  } else {
    for (const auto& l : s.leaves) add(l.nbytes);
  }
  return sizes;
}

std::string ints(const std::vector<int64_t>& v) { return c10::str("[", c10::Join(", ", v), "]"); }

// The first difference between the sender's schema and ours, in words.
std::string describe_mismatch(const Schema& theirs, const Schema& mine) {
  if (theirs.mode != mine.mode) {
    return c10::str("the sender passed ", mode_name(theirs.mode), " and this receiver ",
                    mode_name(mine.mode));
  }
  const auto& a = theirs.leaves;
  const auto& b = mine.leaves;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const LeafSchema& x = a[i];
    const LeafSchema& y = b[i];
    if (x.path != y.path) {
      // Both lists are in wire order (sorted paths), so the smaller path is the missing one.
      const bool theirs_first = x.path < y.path;
      const auto& first = theirs_first ? x.path : y.path;
      const auto& other = theirs_first ? y.path : x.path;
      if (std::equal(first.begin(), first.end(), other.begin(), other.end() - 1) &&
          other.size() > first.size()) {
        return c10::str("key ", NestedKey(first).str(), " is a tensor ",
                        theirs_first ? "on the sender" : "here", " and a nested TensorDict ",
                        theirs_first ? "here" : "on the sender");
      }
      return c10::str("key ", NestedKey(first).str(), " is in ",
                      theirs_first ? "the sender's TensorDict but not in this one"
                                   : "this TensorDict but not in the sender's");
    }
    const std::string key = NestedKey(x.path).str();
    if (x.dtype != y.dtype) {
      return c10::str("key ", key, " has dtype ", x.dtype, " on the sender and ", y.dtype, " here");
    }
    if (x.sizes != y.sizes) {
      return c10::str("key ", key, " has shape ", ints(x.sizes), " on the sender and ",
                      ints(y.sizes), " here");
    }
    if (x.offset != y.offset || x.strides != y.strides) {
      return c10::str("key ", key, " lies at byte ", x.offset, " with strides ", ints(x.strides),
                      " in the sender's consolidated storage and at byte ", y.offset,
                      " with strides ", ints(y.strides), " here");
    }
  }
  if (a.size() != b.size()) {
    const bool more_theirs = a.size() > b.size();
    const auto& extra = more_theirs ? a[b.size()].path : b[a.size()].path;
    return c10::str("key ", NestedKey(extra).str(), " is in ",
                    more_theirs ? "the sender's TensorDict but not in this one"
                                : "this TensorDict but not in the sender's");
  }
  return c10::str("the consolidated storage is ", theirs.payload_bytes, " bytes on the sender and ",
                  mine.payload_bytes, " here");
}

WorkPtr recv_one(const Peer& peer, const at::Tensor& t, int tag) {
  std::vector<at::Tensor> one{t};
  return peer.group.recv(one, peer.rank, tag);
}

// Receives the messages a mismatched sender sends, one at a time into one scratch buffer.
void drain(const Peer& peer, int tag, const std::vector<int64_t>& sizes, at::Device device) {
  if (sizes.empty()) {
    return;
  }
  at::Tensor scratch = at::empty({*std::max_element(sizes.begin(), sizes.end())},
                                 at::TensorOptions().dtype(at::kByte).device(device));
  for (int64_t n : sizes) {
    wait_all({recv_one(peer, scratch.narrow(0, 0, n), tag)});
  }
}

at::Device device_of(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() ? at::Device(at::kCPU) : tensors.front().device();
}


}  // namespace

std::vector<WorkPtr> post_checked_send(const TensorDict& td, const Peer& peer, int tag,
                                       bool consolidated) {
  Schema schema;
  std::vector<at::Tensor> payload;  // 1-D uint8 views, in wire order
  if (consolidated) {
    TensorDict c = is_consolidated(td) ? td : consolidate(td);
    at::Tensor storage = consolidated_storage(c);
    schema = schema_of(wire_order(c), &storage);
    payload.push_back(bytes_of(storage.contiguous()));
  } else {
    const WireLeaves leaves = wire_order(td);
    schema = schema_of(leaves, nullptr);
    for (const auto& [path, leaf] : leaves) {
      if (leaf.numel() > 0) payload.push_back(bytes_of(sendable(leaf)));
    }
  }
  const std::string blob = encode(schema);
  Header h;
  h.mode = schema.mode;
  h.payload_bytes = static_cast<uint64_t>(schema.payload_bytes);
  h.schema_bytes = blob.size();
  h.schema_hash = fnv1a(reinterpret_cast<const uint8_t*>(blob.data()), blob.size());
  h.chunk_bytes = kChunkBytes;
  h.leaf_count = schema.leaves.size();
  TORCH_CHECK_VALUE(h.schema_bytes <= kMaxSchemaBytes, "send(checked=True): the schema of this "
                    "TensorDict is ", h.schema_bytes, " bytes, above the limit of ",
                    kMaxSchemaBytes);

  const at::Device device = device_of(payload);
  std::vector<at::Tensor> messages{bytes_tensor(encode_header(h), device),
                                   bytes_tensor(blob, device)};
  for (const auto& bytes : payload) chunk(bytes, kChunkBytes, messages);
  return post_all(messages.size(), [&](size_t i) {
    std::vector<at::Tensor> one{messages[i]};
    return peer.group.send(one, peer.rank, tag);
  });
}

std::vector<WorkPtr> post_checked_recv(const char* call, const TensorDict& td, const Peer& peer,
                                       int tag, bool consolidated) {
  Schema mine;
  std::vector<at::Tensor> targets;  // what the payload lands in, in wire order
  if (consolidated) {
    at::Tensor storage = consolidated_storage(td);
    mine = schema_of(wire_order(td), &storage);
    targets.push_back(storage);
  } else {
    const WireLeaves leaves = wire_order(td);
    mine = schema_of(leaves, nullptr);
    for (const auto& [path, leaf] : leaves) {
      check_writable(call, leaf, "receive into", "receiver");
      targets.push_back(leaf);
    }
  }
  const std::string mine_blob = encode(mine);
  const at::Device device = device_of(targets);

  at::Tensor header_t = at::empty({static_cast<int64_t>(kHeaderBytes)},
                                  at::TensorOptions().dtype(at::kByte).device(device));
  wait_all({recv_one(peer, header_t, tag)});
  header_t = header_t.cpu();
  const Header h = decode_header(call, header_t.data_ptr<uint8_t>());

  at::Tensor blob_t = at::empty({static_cast<int64_t>(h.schema_bytes)},
                                at::TensorOptions().dtype(at::kByte).device(device));
  wait_all({recv_one(peer, blob_t, tag)});
  blob_t = blob_t.cpu();
  const auto* blob = blob_t.data_ptr<uint8_t>();
  TORCH_CHECK(fnv1a(blob, h.schema_bytes) == h.schema_hash, call,
              "(checked=True): the sender's schema does not match the header's hash");
  const auto chunk_bytes = static_cast<int64_t>(h.chunk_bytes);

  const bool same = h.mode == mine.mode && h.schema_bytes == mine_blob.size() &&
                    std::memcmp(blob, mine_blob.data(), mine_blob.size()) == 0 &&
                    static_cast<int64_t>(h.payload_bytes) == mine.payload_bytes;
  if (!same) {
    Schema theirs = decode(call, h.mode, blob, h.schema_bytes);
    TORCH_CHECK(theirs.leaves.size() == h.leaf_count &&
                    (h.mode == Mode::kConsolidated ||
                     static_cast<uint64_t>(theirs.payload_bytes) == h.payload_bytes),
                call, "(checked=True): the sender's header and schema disagree");
    theirs.payload_bytes = static_cast<int64_t>(h.payload_bytes);
    drain(peer, tag, message_sizes(theirs, chunk_bytes), device);
    TORCH_CHECK(false, call, "(checked=True): the sender's TensorDict does not match this one: ",
                describe_mismatch(theirs, mine),
                ". The sender's payload was received into scratch space and dropped; this "
                "TensorDict is unchanged");
  }

  std::vector<WorkPtr> works;
  try {
    for (const auto& target : targets) {
      if (target.numel() == 0) continue;
      const bool direct = target.is_contiguous();
      at::Tensor buffer = direct ? target : at::empty_like(target, at::MemoryFormat::Contiguous);
      std::vector<at::Tensor> chunks;
      chunk(bytes_of(buffer), chunk_bytes, chunks);
      const size_t first = works.size();
      for (const auto& c : chunks) works.push_back(recv_one(peer, c, tag));
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

}  // namespace tensordict::dist::detail

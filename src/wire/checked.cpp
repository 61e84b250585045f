#include "wire/checked.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "core/bytes.h"
#include "core/excerpt.h"
#include "tensordict/dtypes.h"
#include "tensordict/errors.h"

namespace tensordict::wire::checked {
namespace {

constexpr std::array<char, 8> kMagic = {'T', 'D', 'C', 'H', 'E', 'C', 'K', 'D'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = kCheckedHeaderBytes;
constexpr uint64_t kMaxLeaves = uint64_t{1} << 24;
constexpr uint32_t kMaxDepth = 1024;
constexpr uint32_t kMaxDims = 64;
constexpr uint32_t kMaxDtypeName = 64;

const char* mode_name(Mode m) {
  return m == Mode::kConsolidated ? "consolidated=True" : "consolidated=False";
}

void put_u32(std::string& out, uint32_t v) { core::append_le(out, v, 4); }
void put_u64(std::string& out, uint64_t v) { core::append_le(out, v, 8); }

void put_str(std::string& out, std::string_view s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

// Little-endian fields of a peer's bytes; a read past the end is an error naming the field.
class Reader {
 public:
  Reader(const char* call, const uint8_t* data, size_t size)
      : call_(call), bytes_(std::string_view(reinterpret_cast<const char*>(data), size)) {}
  uint64_t u64(const char* what) { return get(8, what); }
  uint32_t u32(const char* what) { return static_cast<uint32_t>(get(4, what)); }
  std::string str(uint32_t max, const char* what) {
    const uint32_t n = u32(what);
    TD_CHECK_PEER(n <= max, call_, "(checked=True): the sender's schema has a ", what, " of ", n,
                  " bytes (at most ", max, ")");
    need(n, what);
    return std::string(bytes_.take(n));
  }
  size_t left() const { return bytes_.left(); }

 private:
  void need(size_t n, const char* what) const {
    TD_CHECK_PEER(bytes_.has(n), call_, "(checked=True): the sender's schema ends inside a ", what);
  }
  uint64_t get(size_t n, const char* what) {
    need(n, what);
    return bytes_.le(n);
  }
  const char* call_;
  core::ByteReader bytes_;
};

int64_t checked_int(const char* call, uint64_t v, const char* what) {
  TD_CHECK_PEER(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), call,
                "(checked=True): the sender's ", what, " is out of range (", v, ")");
  return static_cast<int64_t>(v);
}

// Reads the sender's schema one leaf at a time, validated as it goes (every count against the
// bytes left, every size non-negative, every byte count free of overflow), and calls
// fn(const LeafSchema&) for each, so that memory stays one leaf however many a peer announces.
// Returns the number of leaves and, per leaf, adds their bytes to `payload_bytes`.
template <typename Fn>
uint64_t for_each_leaf(const char* call, Mode mode, const uint8_t* data, size_t size,
                       int64_t& payload_bytes, Fn&& fn) {
  Reader r(call, data, size);
  const uint64_t count = r.u64("leaf count");
  TD_CHECK_PEER(count <= kMaxLeaves && count <= r.left() / 12, call,
                "(checked=True): the sender's schema announces ", count, " leaves in ", size,
                " bytes");
  payload_bytes = 0;
  LeafSchema l;
  for (uint64_t i = 0; i < count; ++i) {
    const uint32_t depth = r.u32("key depth");
    TD_CHECK_PEER(depth >= 1 && depth <= kMaxDepth, call,
                  "(checked=True): the sender's schema has a key of depth ", depth);
    l.path.resize(depth);
    for (auto& part : l.path) part = r.str(std::numeric_limits<uint32_t>::max(), "key");
    l.dtype = r.str(kMaxDtypeName, "dtype name");
    const auto dtype = dtype_from_name(l.dtype);
    TD_CHECK_PEER(dtype, call, "(checked=True): the sender's leaf ", core::key_path_excerpt(l.path),
                  " has an unknown dtype ", core::quoted_excerpt(l.dtype));
    const uint32_t ndim = r.u32("shape length");
    TD_CHECK_PEER(ndim <= kMaxDims, call, "(checked=True): the sender's leaf ",
                  core::key_path_excerpt(l.path), " has ", ndim, " dimensions");
    int64_t numel = 1;
    l.sizes.clear();
    for (uint32_t d = 0; d < ndim; ++d) {
      const int64_t dim = checked_int(call, r.u64("shape"), "shape");
      l.sizes.push_back(dim);
      TD_CHECK_PEER(!__builtin_mul_overflow(numel, dim, &numel), call,
                    "(checked=True): the sender's leaf ", core::key_path_excerpt(l.path),
                    " has a shape whose size overflows");
    }
    TD_CHECK_PEER(
        !__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(*dtype)), &l.nbytes),
        call, "(checked=True): the sender's leaf ", core::key_path_excerpt(l.path),
        " has a byte size that overflows");
    l.strides.clear();
    if (mode == Mode::kConsolidated) {
      l.offset = checked_int(call, r.u64("offset"), "offset");
      for (uint32_t d = 0; d < ndim; ++d) {
        l.strides.push_back(checked_int(call, r.u64("stride"), "stride"));
      }
    } else {
      TD_CHECK_PEER(!__builtin_add_overflow(payload_bytes, l.nbytes, &payload_bytes), call,
                    "(checked=True): the sender's leaves add up to more bytes than fit in 64 bits");
    }
    fn(static_cast<const LeafSchema&>(l));
  }
  TD_CHECK_PEER(r.left() == 0, call, "(checked=True): ", r.left(),
                " bytes follow the sender's schema");
  return count;
}

std::string ints(const std::vector<int64_t>& v) { return c10::str("[", c10::Join(", ", v), "]"); }

std::string missing_key(const std::vector<std::string>& path, bool on_sender) {
  return c10::str("key ", core::key_path_excerpt(path), " is in ",
                  on_sender ? "the sender's TensorDict but not in this one"
                            : "this TensorDict but not in the sender's");
}

// How the sender's leaf and ours at the same wire position differ, in words; nullopt if not.
std::optional<std::string> leaf_difference(const LeafSchema& x, const LeafSchema& y) {
  if (x.path != y.path) {
    // Both lists are in wire order (sorted paths), so the smaller path is the missing one.
    const bool theirs_first = x.path < y.path;
    const auto& first = theirs_first ? x.path : y.path;
    const auto& other = theirs_first ? y.path : x.path;
    if (std::equal(first.begin(), first.end(), other.begin(), other.end() - 1) &&
        other.size() > first.size()) {
      return c10::str("key ", core::key_path_excerpt(first), " is a tensor ",
                      theirs_first ? "on the sender" : "here", " and a nested TensorDict ",
                      theirs_first ? "here" : "on the sender");
    }
    return missing_key(first, theirs_first);
  }
  const std::string key = core::key_path_excerpt(x.path);
  if (x.dtype != y.dtype) {
    return c10::str("key ", key, " has dtype ", x.dtype, " on the sender and ", y.dtype, " here");
  }
  if (x.sizes != y.sizes) {
    return c10::str("key ", key, " has shape ", ints(x.sizes), " on the sender and ", ints(y.sizes),
                    " here");
  }
  if (x.offset != y.offset || x.strides != y.strides) {
    return c10::str("key ", key, " lies at byte ", x.offset, " with strides ", ints(x.strides),
                    " in the sender's consolidated storage and at byte ", y.offset,
                    " with strides ", ints(y.strides), " here");
  }
  return std::nullopt;
}

}  // namespace

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) {
    h = (h ^ p[i]) * 0x100000001b3ULL;
  }
  return h;
}

// The schema of `leaves` (a wire_order()), and with `storage`, of their consolidated layout.
Schema schema_of(const WireLeaves& leaves, const at::Tensor* storage) {
  Schema s;
  s.mode = storage ? Mode::kConsolidated : Mode::kPerLeaf;
  for (const auto& [path, leaf] : leaves) {
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
  TD_CHECK_PEER(std::memcmp(p, kMagic.data(), kMagic.size()) == 0, call,
                "(checked=True): the peer's first message is not a checked-transfer header; the "
                "sender must pass checked=True too");
  Reader r(call, p + kMagic.size(), kHeaderBytes - kMagic.size());
  const uint32_t version = r.u32("version");
  TD_CHECK_PEER(version == kVersion, call,
                "(checked=True): the sender speaks checked-transfer "
                "version ",
                version, ", this process version ", kVersion);
  const uint32_t mode = r.u32("mode");
  Header h;
  h.payload_bytes = r.u64("payload size");
  h.schema_bytes = r.u64("schema size");
  h.schema_hash = r.u64("schema hash");
  h.chunk_bytes = r.u64("chunk size");
  h.leaf_count = r.u64("leaf count");
  const uint64_t hash = r.u64("header hash");
  TD_CHECK_PEER(hash == fnv1a(p, kHeaderBytes - 8), call,
                "(checked=True): the checked-transfer header is corrupt (hash mismatch)");
  TD_CHECK_PEER(mode <= 1, call, "(checked=True): the header has an unknown mode ", mode);
  h.mode = static_cast<Mode>(mode);
  TD_CHECK_PEER(h.schema_bytes <= kMaxSchemaBytes, call, "(checked=True): the sender's schema is ",
                h.schema_bytes, " bytes, above the limit of ", kMaxSchemaBytes);
  TD_CHECK_PEER(h.chunk_bytes >= kMinChunkBytes && h.chunk_bytes <= kMaxChunkBytes, call,
                "(checked=True): the header's chunk size ", h.chunk_bytes, " is not in [",
                kMinChunkBytes, ", ", kMaxChunkBytes, "]");
  checked_int(call, h.payload_bytes, "payload size");
  return h;
}

// The first difference between the sender's schema (validated while compared, one leaf at a
// time) and ours, in words.
std::string describe_mismatch(const char* call, const Header& h, const uint8_t* blob,
                              const Schema& mine) {
  std::optional<std::string> difference;
  if (h.mode != mine.mode) {
    difference = c10::str("the sender passed ", mode_name(h.mode), " and this receiver ",
                          mode_name(mine.mode));
  }
  size_t i = 0;
  int64_t leaf_bytes = 0;
  const uint64_t count =
      for_each_leaf(call, h.mode, blob, h.schema_bytes, leaf_bytes, [&](const LeafSchema& x) {
        if (!difference) {
          difference = i < mine.leaves.size() ? leaf_difference(x, mine.leaves[i])
                                              : missing_key(x.path, /*on_sender=*/true);
        }
        ++i;
      });
  TD_CHECK_PEER(count == h.leaf_count && (h.mode == Mode::kConsolidated ||
                                          static_cast<uint64_t>(leaf_bytes) == h.payload_bytes),
                call, "(checked=True): the sender's header and schema disagree");
  if (!difference && count < mine.leaves.size()) {
    difference = missing_key(mine.leaves[count].path, /*on_sender=*/false);
  }
  return difference.value_or(c10::str("the consolidated storage is ", h.payload_bytes,
                                      " bytes on the sender and ", mine.payload_bytes, " here"));
}

void for_each_message(const char* call, const Header& h, const uint8_t* blob,
                      const std::function<void(int64_t)>& fn) {
  const auto chunk_bytes = static_cast<int64_t>(h.chunk_bytes);
  const auto cut = [&](int64_t n) {
    for (int64_t off = 0; off < n; off += chunk_bytes) fn(std::min(chunk_bytes, n - off));
  };
  if (h.mode == Mode::kConsolidated) {
    cut(static_cast<int64_t>(h.payload_bytes));
    return;
  }
  int64_t total = 0;
  for_each_leaf(call, h.mode, blob, h.schema_bytes, total,
                [&](const LeafSchema& l) { cut(l.nbytes); });
}

}  // namespace tensordict::wire::checked

// The pipe's frames (wire/pipe_frames.h): the peer info, the frame reader, the uncollated
// header. Bytes only; messages name the peer, so the pipe's errors read as the reference's.
#include "wire/pipe_frames.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <c10/util/hash.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <set>
#include <utility>
#include <vector>

#include "core/bytes.h"
#include "core/excerpt.h"
#include "core/json_text.h"
#include "core/metadata.h"
#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"
#include "tensordict/errors.h"
#include "tensordict/leaf.h"
#include "tensordict/nested_key.h"
#include "wire/leaf_order.h"

namespace tensordict::wire::frames {

// ---- peer info ----------------------------------------------------------------------------------

namespace {
// "tdcp": what a tag of ours carries in its top 32 bits; the revision follows (0x70, 'p', the
// first: the tags of that revision read "tdcpp").
constexpr uint64_t kOurTagMark = 0x74646370;
}  // namespace

uint64_t hash64bits(uint64_t value) {
  const std::string digest = c10::sha1(c10::str("(", value, ",)")).str();
  return std::stoull(digest.substr(0, 16), nullptr, 16);
}

uint64_t make_our_tag() {
  static std::atomic<uint64_t> next{static_cast<uint64_t>(::getpid()) << 12};
  return (kOurTagMark << 32) | (uint64_t{kOurRevision} << 24) | (next.fetch_add(1) & 0xffffff);
}

void write_peer_info(uint64_t tag, uint8_t* out) {
  core::put_le(out, tag);
  core::put_le(out + 8, hash64bits(tag));
}

PeerInfo read_peer_info(const uint8_t* in) {
  PeerInfo info;
  info.tag = core::get_le(in);
  const uint64_t checksum = core::get_le(in + 8);
  const uint64_t expected = hash64bits(info.tag);
  TD_CHECK_PEER(checksum == expected, "Checksum invalid! 0x", std::hex, expected, " != 0x",
                checksum, " (the peer is not a ucxx endpoint)");
  const auto revision = static_cast<uint8_t>(info.tag >> 24);
  info.ours = (info.tag >> 32) == kOurTagMark && revision >= kCloseMarkerRevision;
  if (info.ours) info.revision = revision;
  return info;
}

bool is_close_marker(const uint8_t* message, size_t length) {
  if (length == 1) return message[0] == kCloseFlag;
  return length == 8 && core::get_le(message) == kCloseLength;
}

// ---- frames -------------------------------------------------------------------------------------

size_t ByteSource::read_first_joined(uint8_t*, const at::Tensor&, void*, size_t, const at::Tensor&,
                                     const char*) {
  TORCH_INTERNAL_ASSERT(false, "read_first_joined on a source that does not join frames");
}

namespace {

// The peer broke the framing: the stream is out of step (the rest of a message is left unread),
// so it is broken before the error goes up.
[[noreturn]] void refuse(ByteSource& src, const std::string& why) {
  src.fail(why);
  TD_THROW(MalformedPeerDataError, why);
}

}  // namespace

FrameReader::FrameReader(FrameLimits limits) : limits_(limits), scratch_(bytes_tensor(16)) {}

uint64_t FrameReader::read_length(ByteSource& src, const char* what, bool first) {
  auto* buf = scratch_.data_ptr<uint8_t>();
  if (first) {
    src.read_first(buf, 8, scratch_, what);
  } else {
    src.read(buf, 8, scratch_, what);
  }
  const uint64_t n = core::get_le(buf);
  if (first && n == kCloseLength) src.peer_left();
  if (n > static_cast<uint64_t>(limits_.max_metadata_bytes)) {
    refuse(src, c10::str("recv: peer ", src.peer(), " announced ", what, " of ", n,
                         " bytes, over the limit of ", limits_.max_metadata_bytes,
                         " (PipeOptions::max_metadata_bytes)"));
  }
  return n;
}

void FrameReader::check_storage_cap(ByteSource& src, int64_t n, const char* what) {
  if (n > limits_.max_storage_bytes) {
    refuse(src, c10::str("recv: peer ", src.peer(), " announced ", what, " of ", n,
                         " bytes, over the limit of ", limits_.max_storage_bytes,
                         " (PipeOptions::max_storage_bytes)"));
  }
}

bool FrameReader::can_recv_into(const TensorDict& td) const {
  if (!is_consolidated(td)) return false;
  const at::Tensor storage = consolidated_storage(td);
  if (storage.numel() != total_bytes_ || storage.device() != device_) return false;
  if (td_ && td.is_same(*td_)) return true;
  return td.consolidated_state()->sorted_json() == schema_;
}

// ---- consolidated mode (§6.1) -----------------------------------------------------------------

TensorDict FrameReader::recv_consolidated(ByteSource& src, const std::optional<TensorDict>& td,
                                          std::optional<at::Device> device, bool* new_schema) {
  if (new_schema) *new_schema = false;
  auto* scratch = scratch_.data_ptr<uint8_t>();
  // Where a same-schema storage lands: `td` when it matches the last schema, else the previous
  // result.
  std::optional<TensorDict> target = td_;
  if (td && have_schema_ && can_recv_into(*td)) target = td;
  if (target && !is_consolidated(*target)) target.reset();
  // A peer that joins frames sends a small same-schema storage in the flag byte's message
  // (§6.8): receive it straight into the target, or a lone flag byte.
  size_t first_length = 0;
  if (have_schema_ && target && total_bytes_ <= kMaxJoinedStorage && src.joins_frames()) {
    at::Tensor storage = consolidated_storage(*target);
    first_length = src.read_first_joined(scratch, scratch_, storage.data_ptr(),
                                         static_cast<size_t>(total_bytes_), storage,
                                         "the flag byte and the storage");
  } else {
    src.read_first(scratch, 1, scratch_, "the flag byte");
  }
  const uint8_t flag = scratch[0];
  if (first_length > 1 && flag != kSameSchemaFlag) {
    refuse(src, c10::str("recv: peer ", src.peer(), " joined a storage to the flag ",
                         static_cast<int>(flag), " (only the same-schema flag 1 carries one)"));
  }
  if (flag == kCloseFlag) src.peer_left();
  if (flag == kSameSchemaFlag) return recv_same_schema(src, target, first_length > 1);
  if (flag != kNewSchemaFlag) {
    refuse(src, c10::str("Unknown TensorDictPipe protocol flag: 0x", "0123456789abcdef"[flag >> 4],
                         "0123456789abcdef"[flag & 15], " from peer ", src.peer(),
                         " (expected 0x00 or 0x01)."));
  }
  TensorDict out = recv_new_schema(src, td, device);
  if (new_schema) *new_schema = true;
  return out;
}

TensorDict FrameReader::recv_same_schema(ByteSource& src, const std::optional<TensorDict>& target,
                                         bool joined) {
  if (!target) {
    refuse(src,
           "Received same-schema flag but no consolidated TensorDict is available for in-place "
           "receive. The sender and receiver may be out of sync.");
  }
  if (!joined) {  // the storage is the next message
    at::Tensor storage = consolidated_storage(*target);
    TORCH_INTERNAL_ASSERT(storage.numel() == total_bytes_);
    src.read(storage.data_ptr(), static_cast<size_t>(storage.numel()), storage, "the storage");
  }
  // Written in place behind autograd's back: a graph that saved a leaf must see it changed.
  auto written = [](std::vector<std::string>*, const at::Tensor& leaf) { mark_written(leaf); };
  for_each_leaf(*target, nullptr, written);
  td_ = target;
  return *target;
}

FrameReader::NewSchema FrameReader::read_new_schema(ByteSource& src) {
  const uint64_t meta_len = read_length(src, "metadata", /*first=*/false);
  const at::Tensor meta_buf = bytes_tensor(meta_len);
  src.read(meta_buf.data_ptr(), meta_len, meta_buf, "the metadata");
  try {
    NewSchema out{core::read_metadata_json(std::string_view(
                      static_cast<const char*>(meta_buf.const_data_ptr()), meta_len)),
                  -1, "cpu"};
    for (const auto& [key, value] : out.metadata.transport()) {
      if (key == "_total_bytes") {
        TORCH_CHECK_VALUE(std::holds_alternative<int64_t>(value) && std::get<int64_t>(value) >= 0,
                          "_total_bytes must be a nonnegative integer");
        out.total = std::get<int64_t>(value);
      } else if (key == "_device") {
        TORCH_CHECK_VALUE(std::holds_alternative<std::string>(value), "_device must be a string");
        out.sender_device = std::get<std::string>(value);
      }  // other transport keys (the reference's metadata pollution, §7.11) are dropped
    }
    TORCH_CHECK_VALUE(out.total >= 0, "the metadata has no _total_bytes");
    TORCH_CHECK_VALUE(out.metadata.storage_bytes() <= out.total,
                      "the leaves end past "
                      "_total_bytes (",
                      out.total, ")");
    return out;
  } catch (const c10::Error& err) {
    refuse(src, c10::str("recv: invalid metadata from peer ", src.peer(), ": ",
                         err.what_without_backtrace()));
  }
}

at::Device FrameReader::storage_device(ByteSource& src, const std::string& sender_device,
                                       std::optional<at::Device> device) {
  at::Device target_device = at::kCPU;
  if (device) {
    target_device = *device;
  } else {
    const auto parsed = core::parse_device_name(sender_device);
    if (!parsed) {
      src.fail("bad _device");
      TORCH_CHECK_VALUE(false, "recv: peer ", src.peer(), " sent an invalid _device ",
                        core::quoted_excerpt(sender_device));
    }
    target_device = *parsed;
  }
  if (!target_device.is_cpu()) {
    src.fail("unsupported device");
    TORCH_CHECK_VALUE(false, "recv: the storage would go to ", target_device,
                      "; this build of the pipe moves CPU memory only (pass device=cpu)");
  }
  return target_device;
}

TensorDict FrameReader::recv_new_schema(ByteSource& src, const std::optional<TensorDict>& td,
                                        std::optional<at::Device> device) {
  NewSchema schema = read_new_schema(src);
  const int64_t total = schema.total;
  check_storage_cap(src, total, "a storage");
  const at::Device target_device = storage_device(src, schema.sender_device, device);
  // The schema: the sorted JSON of the metadata read, transport fields left out, made once per
  // new schema; a TensorDict's own is kept by its state (can_recv_into).
  total_bytes_ = total;
  device_ = target_device;
  have_schema_ = true;
  schema_ = metadata_to_json(schema.metadata.metadata(), /*sort_keys=*/true);
  td_.reset();
  if (td && can_recv_into(*td)) {
    at::Tensor storage = consolidated_storage(*td);
    src.read(storage.data_ptr(), static_cast<size_t>(total), storage, "the storage");
    td_ = td;
  } else {
    at::Tensor storage = core::fresh_bytes(total, target_device);
    src.read(storage.data_ptr(), static_cast<size_t>(total), storage, "the storage");
    td_ = core::rebuild_validated(std::move(schema.metadata), storage);
  }
  return *td_;
}

// ---- uncollated mode (§6.2, in the form tensordict 0.15.3 sends) -----------------------------
// Header {"keys", "dtypes", "shapes", "batch_size", "unbatched", "non_tensors"}, then each
// tensor leaf (nested ones included) sorted by its "."-joined key. A receiver that knows only
// keys/dtypes/shapes reads the top-level case; ours reads both forms.

namespace {

// A NonTensorStack entry of the header, [key, values, batch_size, stack_dim], as the reference's
// _decode_non_tensor_stack reads it: the values nested as the batch dims, restacked along
// stack_dim.
NonTensorData decode_stack(const JsonValue& values, const JsonValue& stack_batch,
                           const JsonValue& stack_dim, const std::vector<int64_t>& batch_size) {
  bool ok = values.is_list() && stack_batch.is_list() && stack_dim.is_int();
  std::vector<int64_t> sbs;
  for (size_t i = 0; ok && i < stack_batch.as_list().size(); ++i) {
    const JsonValue& d = stack_batch.as_list()[i];
    ok = d.is_int() && d.as_int() >= 0;
    if (ok) sbs.push_back(d.as_int());
  }
  ok = ok && sbs.size() >= batch_size.size() &&
       std::equal(batch_size.begin(), batch_size.end(), sbs.begin()) && stack_dim.as_int() >= 0 &&
       stack_dim.as_int() < static_cast<int64_t>(sbs.size());
  TORCH_CHECK_VALUE(ok, "invalid non-tensor stack");
  NonTensorData stack =
      NonTensorData::from_list(values, std::nullopt, static_cast<int64_t>(sbs.size()));
  if (const int64_t d = stack_dim.as_int();
      d > 0 && stack.batch_size().size() > static_cast<size_t>(d)) {
    stack = NonTensorData::stack(stack.unbind(d), d);
  }
  TORCH_CHECK_VALUE(stack.batch_size() == at::IntArrayRef(sbs),
                    "the values of a non-tensor stack do not match its batch size");
  return stack;
}

// The uncollated header's leaves and non-tensor entries, validated against the caps (a
// ValueError otherwise). Parsed by the receive, and by a look-ahead for the leaves' sizes.
struct UncollatedLeaf {
  std::vector<std::string> key;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes;
  bool unbatched = false;
};
struct UncollatedHeader {
  std::vector<UncollatedLeaf> leaves;
  std::vector<std::pair<std::vector<std::string>, NonTensorData>> non_tensors;
  std::vector<int64_t> batch_size;
};

std::vector<int64_t> nonneg_ints(const JsonValue& j, const char* what) {
  TORCH_CHECK_VALUE(j.is_list(), what, " must be a list");
  std::vector<int64_t> out;
  for (const auto& d : j.as_list()) {
    TORCH_CHECK_VALUE(d.is_int() && d.as_int() >= 0, what, " must be nonnegative integers");
    out.push_back(d.as_int());
  }
  return out;
}

// The reference's _decode_uncollated_key: a string, or a nonempty list of them (nested lists
// flattened).
std::vector<std::string> decode_key(const JsonValue& k) {
  std::vector<std::string> key;
  std::function<void(const JsonValue&)> flatten = [&](const JsonValue& part) {
    if (part.is_string()) {
      key.push_back(part.as_string());
      return;
    }
    TORCH_CHECK_VALUE(part.is_list() && !part.as_list().empty() && key.size() < 64,
                      "a key must be a string or a nonempty nested path");
    for (const auto& p : part.as_list()) flatten(p);
  };
  flatten(k);
  return key;
}

// One leaf of the header: its dtype and shape checked, its size added to `total` under the
// storage cap.
UncollatedLeaf read_leaf(std::vector<std::string> key, const JsonValue& dtype,
                         const JsonValue& shape, bool unbatched,
                         const std::vector<int64_t>& batch_size, const FrameLimits& limits,
                         int64_t& total) {
  UncollatedLeaf leaf;
  leaf.key = std::move(key);
  TORCH_CHECK_VALUE(dtype.is_string(), "unknown torch dtype");
  const auto dt = dtype_from_name(dtype.as_string());
  TORCH_CHECK_VALUE(dt.has_value(), "unknown torch dtype ", core::json_excerpt(dtype));
  leaf.dtype = *dt;
  // Quantized storage is not numel * element size bytes (quint4x2 packs two per byte).
  TORCH_CHECK_VALUE(!c10::isQIntType(leaf.dtype), "the quantized dtype ", core::json_excerpt(dtype),
                    " cannot be sent through the pipe");
  leaf.shape = nonneg_ints(shape, "dimensions");
  leaf.unbatched = unbatched;
  TORCH_CHECK_VALUE(
      unbatched || (leaf.shape.size() >= batch_size.size() &&
                    std::equal(batch_size.begin(), batch_size.end(), leaf.shape.begin())),
      "a shape does not start with the batch size");
  int64_t n = static_cast<int64_t>(c10::elementSize(leaf.dtype));
  for (int64_t d : leaf.shape) {
    TORCH_CHECK_VALUE(d == 0 || n <= limits.max_storage_bytes / d,
                      "the leaves exceed the storage limit of ", limits.max_storage_bytes,
                      " (PipeOptions::max_storage_bytes)");
    n *= d;
  }
  total += n;
  TORCH_CHECK_VALUE(total <= limits.max_storage_bytes, "the leaves exceed the storage ",
                    "limit of ", limits.max_storage_bytes, " (PipeOptions::max_storage_bytes)");
  leaf.nbytes = n;
  return leaf;
}

UncollatedHeader parse_uncollated_header(std::string_view text, const FrameLimits& limits) {
  UncollatedHeader h;
  const JsonValue header =
      core::parse_json(text,
                       core::JsonLimits{.max_depth = core::kMaxMetadataJsonDepth,
                                        .max_values = core::kMaxMetadataJsonValues},
                       "the header");
  auto field = [&](const char* name) -> const JsonValue* {
    if (!header.is_map()) return nullptr;
    for (const auto& [k, v] : header.as_map()) {
      if (k == name) return &v;
    }
    return nullptr;
  };
  TORCH_CHECK_VALUE(header.is_map() && field("keys") && field("keys")->is_list() &&
                        field("dtypes") && field("dtypes")->is_list() && field("shapes") &&
                        field("shapes")->is_list(),
                    "expected keys, dtypes, and shapes lists");
  const auto& keys = field("keys")->as_list();
  const auto& dtypes = field("dtypes")->as_list();
  const auto& shapes = field("shapes")->as_list();
  TORCH_CHECK_VALUE(keys.size() == dtypes.size() && keys.size() == shapes.size(),
                    "list lengths must match");
  if (const auto* b = field("batch_size")) h.batch_size = nonneg_ints(*b, "the batch size");
  // The keys of UnbatchedTensor leaves, whose shapes need not start with the batch size.
  std::set<std::vector<std::string>> unbatched;
  if (const auto* f = field("unbatched")) {
    TORCH_CHECK_VALUE(f->is_list(), "expected unbatched and non_tensors lists");
    for (const auto& k : f->as_list()) unbatched.insert(decode_key(k));
  }
  std::set<std::vector<std::string>> seen;
  if (const auto* f = field("non_tensors")) {
    TORCH_CHECK_VALUE(f->is_list(), "expected unbatched and non_tensors lists");
    for (const auto& entry : f->as_list()) {
      const size_t n = entry.is_list() ? entry.as_list().size() : 0;
      TORCH_CHECK_VALUE(n == 2 || n == 4,
                        "a non_tensors entry must be [key, data] or "
                        "[key, values, batch_size, stack_dim]");
      const auto& e = entry.as_list();
      auto key = decode_key(e[0]);
      TORCH_CHECK_VALUE(seen.insert(key).second, "keys must be unique");
      h.non_tensors.emplace_back(
          std::move(key),
          n == 2 ? NonTensorData(e[1]) : decode_stack(e[1], e[2], e[3], h.batch_size));
    }
  }
  int64_t total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto key = decode_key(keys[i]);
    TORCH_CHECK_VALUE(seen.insert(key).second, "keys must be unique");
    const bool is_unbatched = unbatched.count(key) > 0;
    h.leaves.push_back(
        read_leaf(std::move(key), dtypes[i], shapes[i], is_unbatched, h.batch_size, limits, total));
  }
  // Every unbatched key names a leaf (both sets are sorted: linear, whatever a peer lists).
  TORCH_CHECK_VALUE(std::includes(seen.begin(), seen.end(), unbatched.begin(), unbatched.end()),
                    "unknown unbatched key");
  for (const auto& key : seen) {  // a leaf cannot also be a level above another leaf
    for (size_t n = 1; n < key.size(); ++n) {
      TORCH_CHECK_VALUE(!seen.count({key.begin(), key.begin() + n}),
                        "a leaf key cannot also have descendants");
    }
  }
  return h;
}

}  // namespace

TensorDict FrameReader::recv_uncollated(ByteSource& src, std::optional<at::Device> device) {
  const at::Device target_device = device.value_or(at::kCPU);
  TORCH_CHECK_VALUE(target_device.is_cpu(), "recv: this build of the pipe moves CPU memory only");
  const uint64_t len = read_length(src, "an uncollated header", /*first=*/true);
  const at::Tensor buf = bytes_tensor(len);
  src.read(buf.data_ptr(), len, buf, "the header");

  UncollatedHeader h;
  try {
    h = parse_uncollated_header(
        std::string_view(static_cast<const char*>(buf.const_data_ptr()), len), limits_);
  } catch (const c10::Error& err) {
    refuse(src, c10::str("recv: invalid uncollated header from peer ", src.peer(), ": ",
                         err.what_without_backtrace()));
  }
  TensorDict result({}, h.batch_size);
  for (const UncollatedLeaf& leaf : h.leaves) {
    at::Tensor t =
        at::empty(leaf.shape, at::TensorOptions().dtype(leaf.dtype).device(target_device));
    src.read(t.data_ptr(), static_cast<size_t>(leaf.nbytes), t, "a leaf");
    result.set(NestedKey(leaf.key), leaf.unbatched ? Value::unbatched(t) : Value(t));
  }
  // As the reference: set after the leaves, a NonTensorData with its level's batch size.
  for (auto& [key, entry] : h.non_tensors) result.set_non_tensor(NestedKey(key), std::move(entry));
  return result;
}

// ---- look-ahead (Pipe::try_recv) ----------------------------------------------------------------
// The receive's walk over the framing, on messages that have landed, reading nothing: a receive
// started on kWhole reads only landed messages (or fails at once), so it never waits.

Arrival FrameReader::arrival(MessagePeek& src, bool consolidated) const {
  size_t next = 0;
  // The next message, landed: its bytes; otherwise what to answer.
  std::optional<Arrival> early;
  auto landed = [&](Peeked& m) {
    m = src.peek(next++);
    switch (m.state) {
      case Peeked::kNotYet: early = Arrival::kIncomplete; return false;
      case Peeked::kTooLarge: early = Arrival::kNeedsReceiver; return false;
      case Peeked::kUnusable: early = Arrival::kWhole; return false;  // the receive fails
      case Peeked::kLanded: return true;
    }
    return false;
  };
  // A length message: its value, or nullopt when the receive refuses it at once.
  auto length_of = [&](const Peeked& m) -> std::optional<uint64_t> {
    if (m.length != 8) return std::nullopt;
    const uint64_t n = core::get_le(m.data);
    if (n > static_cast<uint64_t>(limits_.max_metadata_bytes)) return std::nullopt;
    return n;
  };
  Peeked m;
  if (!consolidated) {
    if (!landed(m)) return *early;
    const auto len = length_of(m);  // the close marker too: the receive throws at once
    if (!len) return Arrival::kWhole;
    if (!landed(m)) return *early;
    if (m.length != *len) return Arrival::kWhole;
    UncollatedHeader h;
    try {
      h = parse_uncollated_header(std::string_view(reinterpret_cast<const char*>(m.data), m.length),
                                  limits_);
    } catch (const c10::Error&) {
      return Arrival::kWhole;
    }
    for (size_t i = 0; i < h.leaves.size(); ++i) {
      if (!landed(m)) return *early;
    }
    return Arrival::kWhole;
  }
  if (!landed(m)) return *early;
  // A joined message (or one of a wrong length): the whole TensorDict, or an error at once.
  if (m.length != 1) return Arrival::kWhole;
  const uint8_t flag = m.data[0];
  if (flag == kSameSchemaFlag) {
    if (!have_schema_) return Arrival::kWhole;
    return landed(m) ? Arrival::kWhole : *early;
  }
  if (flag != kNewSchemaFlag) return Arrival::kWhole;  // the close marker, an unknown flag
  if (!landed(m)) return *early;
  const auto len = length_of(m);
  if (!len) return Arrival::kWhole;
  if (!landed(m)) return *early;  // the metadata
  if (!landed(m)) return *early;  // the storage
  return Arrival::kWhole;
}

// ---- the uncollated sender's frame (§6.2) -------------------------------------------------------

UncollatedFrame uncollated_frame(
    const TensorDict& td, const std::function<void(const NestedKey&, const at::Tensor&)>& check) {
  // Tensors and non-tensor entries, as the reference's items(is_leaf=_is_leaf_nontensor).
  std::vector<std::pair<NestedKey, Value>> items;
  for (auto& item : td.items({.include_nested = true})) {
    if (!item.second.is_tensordict()) items.push_back(std::move(item));
  }
  auto joined = [](const NestedKey& k) {
    std::string s;
    for (size_t i = 0; i < k.size(); ++i) s += (i ? "." : "") + k[i];
    return s;
  };
  std::vector<std::pair<std::string, size_t>> order;
  order.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) order.emplace_back(joined(items[i].first), i);
  std::stable_sort(order.begin(), order.end());  // byte order = code-point order in UTF-8

  // A key as the reference writes it: its string, or the list of a nested key's parts.
  const auto wire_key = [](const NestedKey& key) -> JsonValue {
    if (!key.is_nested()) return JsonValue(key[0]);
    JsonValue::List parts(key.parts().begin(), key.parts().end());
    return JsonValue(std::move(parts));
  };
  const auto ints = [](at::IntArrayRef v) {
    return JsonValue(JsonValue::List(v.begin(), v.end()));
  };
  JsonValue::List keys, dtypes, shapes, unbatched, non_tensors;
  UncollatedFrame frame;
  for (const auto& [joined_key, index] : order) {
    const auto& [key, value] = items[index];
    if (value.is_non_tensor()) {
      // [key, data] for a NonTensorData, [key, values, batch_size, stack_dim] for a
      // NonTensorStack, as the reference sends them; a MetaData it refuses.
      const NonTensorData& nt = value.non_tensor();
      TORCH_CHECK_VALUE(!nt.is_metadata(), "consolidated=False cannot send the MetaData entry ",
                        key.str(),
                        ": it sends only NonTensorData and NonTensorStack entries "
                        "whose values are str, int, float, bool, None, or lists or dicts (with "
                        "str keys) of them. Send it with consolidated=True.");
      JsonValue::List entry{wire_key(key)};
      if (nt.is_stack()) {
        entry.push_back(nt.tolist());
        entry.push_back(ints(nt.batch_size()));
        entry.push_back(JsonValue(nt.stack_dim()));
      } else {
        entry.push_back(nt.data());
      }
      non_tensors.emplace_back(std::move(entry));
      continue;
    }
    const at::Tensor& t = value.tensor();
    check(key, t);
    TORCH_CHECK_VALUE(!c10::isQIntType(t.scalar_type()), "send: leaf ", key.str(),
                      " has the quantized dtype ", dtype_name(t.scalar_type()),
                      ", which the pipe cannot carry");
    keys.push_back(wire_key(key));
    if (value.is_unbatched()) unbatched.push_back(wire_key(key));
    dtypes.emplace_back(dtype_name(t.scalar_type()));
    shapes.push_back(ints(t.sizes()));
    frame.leaves.push_back(t.contiguous());
  }
  JsonValue::Map header;
  header.emplace_back("keys", std::move(keys));
  header.emplace_back("dtypes", std::move(dtypes));
  header.emplace_back("shapes", std::move(shapes));
  header.emplace_back("batch_size", ints(td.batch_size()));
  header.emplace_back("unbatched", std::move(unbatched));
  header.emplace_back("non_tensors", std::move(non_tensors));
  core::append_json(frame.header, JsonValue(std::move(header)), /*sort_keys=*/false, "send");
  return frame;
}

}  // namespace tensordict::wire::frames

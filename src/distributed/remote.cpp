#include "remote.h"

#include <ATen/DeviceAccelerator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include <sys/mman.h>
#include <unistd.h>

#include "core/byte_tensor.h"
#include "core/bytes.h"
#include "core/excerpt.h"
#include "core/metadata.h"
#include "tensordict/errors.h"
#include "tensordict/memory.h"
#include "wire/metadata_pickle.h"
#include "wire/pickle.h"

namespace tensordict::dist::detail {
namespace {

constexpr int64_t kMaxPickleBytes = static_cast<int64_t>(kMaxMetadataJsonBytes);
// A dotted Python name; anything longer is not one.
constexpr size_t kMaxTensorclassTypeBytes = 4096;

at::Tensor int64_tensor(int64_t value, at::Device device) {
  return at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(device));
}

int64_t int64_value(const at::Tensor& t) { return t.cpu().item<int64_t>(); }

at::Tensor pickle_tensor(const std::string& pickle, int64_t padded_size, at::Device device) {
  at::Tensor t =
      byte_buffer(padded_size, at::kCPU, /*zeroed=*/padded_size > int64_t(pickle.size()));
  if (!pickle.empty()) std::memcpy(t.data_ptr<uint8_t>(), pickle.data(), pickle.size());
  return t.to(device);
}

// `out` resized to n zero bytes, and a uint8 tensor over them to receive into (valid while
// `out` is neither resized nor destroyed).
at::Tensor string_buffer(std::string& out, int64_t n) {
  out.assign(static_cast<size_t>(n), '\0');
  return at::from_blob(out.data(), {n}, at::kByte);
}

std::string pickle_string(const at::Tensor& t, int64_t size) {
  at::Tensor cpu = t.cpu().contiguous();
  return std::string(reinterpret_cast<const char*>(cpu.data_ptr<uint8_t>()),
                     static_cast<size_t>(size));
}

void check_pickle_size(const char* call, int64_t size, const char* what) {
  TD_CHECK_PEER(size > 0 && size <= kMaxPickleBytes, call, ": the peer announced ", what, " of ",
                size, " bytes; a metadata pickle must have 1 to ", kMaxPickleBytes, " bytes");
}

const JsonScalar* field(const TransportFields& fields, std::string_view name) {
  for (const auto& [key, value] : fields) {
    if (key == name) return &value;
  }
  return nullptr;
}

// "_total_bytes" read from the bytes of a pickle the reader refused as a whole (over its
// budget): the reference and we write it as the top-level dict's last entry, a str key (maybe
// memoized) then an int. Only sizes the drain; a wrong guess costs what a lying field costs.
std::optional<int64_t> last_total_bytes(std::string_view b) {
  static constexpr std::string_view kKey = "\x8c\x0c_total_bytes";
  const size_t at = b.rfind(kKey);
  if (at == std::string_view::npos) return std::nullopt;
  core::ByteReader in(b.substr(at + kKey.size()));
  if (in.has(1) && static_cast<uint8_t>(in.rest()[0]) == 0x94) in.skip(1);  // MEMOIZE
  if (!in.has(1)) return std::nullopt;
  switch (in.u8()) {
    case 'K': return in.has(1) ? std::optional<int64_t>(in.le(1)) : std::nullopt;
    case 'M': return in.has(2) ? std::optional<int64_t>(in.le(2)) : std::nullopt;
    case 'J':
      if (!in.has(4)) return std::nullopt;
      return static_cast<int32_t>(static_cast<uint32_t>(in.le(4)));
    case 0x8a: {  // LONG1, non-negative and within int64
      if (!in.has(1)) return std::nullopt;
      const uint8_t n = in.u8();
      if (n == 0 || n > 8 || !in.has(n)) return std::nullopt;
      const uint64_t u = in.le(n);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
      return static_cast<int64_t>(u);
    }
    default: return std::nullopt;
  }
}

// The top-level scalar fields of a pickle whose metadata was refused, so that a sane
// "_total_bytes" still lets the receiver drain the storage (the sender then finishes instead
// of waiting for its timeout).
TransportFields salvage_fields(std::string_view bytes) {
  TransportFields out;
  try {
    wire::pickle::Value top = wire::pickle::loads(bytes, wire::metadata_pickle_limits());
    if (top.kind() != wire::pickle::Value::Kind::Dict) return out;
    for (size_t i = 0; i < top.keys().size(); ++i) {
      const auto& v = top.values()[i];
      if (v.kind() == wire::pickle::Value::Kind::Int) {
        out.emplace_back(top.keys()[i], v.as_int());
      } else if (v.kind() == wire::pickle::Value::Kind::Str) {
        out.emplace_back(top.keys()[i], v.as_str());
      }
    }
  } catch (const c10::Error&) {
    if (auto n = last_total_bytes(bytes)) out.emplace_back("_total_bytes", *n);
  }
  return out;
}

void defer(Incoming& in, std::exception_ptr e) {
  if (!in.error) in.error = std::move(e);
}

// A fault in what the peer sent, kept to be thrown once the transfer is joined.
template <typename... Args>
std::exception_ptr peer_error(const Args&... args) {
  return std::make_exception_ptr(
      MalformedPeerDataError({__func__, __FILE__, uint32_t(__LINE__)}, c10::str(args...)));
}

// An int transport field in [lo, hi]; records the fault otherwise.
std::optional<int64_t> size_field(const std::string& from, const TransportFields& fields,
                                  const char* name, int64_t lo, int64_t hi, Incoming& in) {
  const JsonScalar* v = field(fields, name);
  if (v == nullptr || !std::holds_alternative<int64_t>(*v)) {
    defer(in, peer_error(from, ": the metadata has no integer \"", name, "\""));
    return std::nullopt;
  }
  const int64_t n = std::get<int64_t>(*v);
  if (n < lo || n > hi) {
    defer(in, peer_error(from, ": the sender announces \"", name, "\" = ", n,
                         " bytes; this receiver accepts ", lo, " to ", hi,
                         " (max_total_bytes bounds it)"));
    return std::nullopt;
  }
  return n;
}

// n bytes on the CPU whose pages are one piece of memory mapped again and again (at most
// 4096 mappings): a receive into it overwrites the same piece, so draining a storage costs
// the piece, not n. Falls back to a plain allocation where the mapping fails.
at::Tensor drain_buffer(int64_t n) {
  if (n == 0) return at::empty({0}, at::kByte);
  const int64_t page = sysconf(_SC_PAGESIZE);
  constexpr int64_t kMaxMappings = 4096;
  const int64_t spread = (n + kMaxMappings - 1) / kMaxMappings;
  const int64_t piece = std::max<int64_t>(int64_t{4} << 20, (spread + page - 1) / page * page);
  const int64_t pieces = (n + piece - 1) / piece;
  const auto span = static_cast<size_t>(pieces * piece);
  const int fd = memfd_create("tensordict-drain", MFD_CLOEXEC);
  if (fd < 0) return at::empty({n}, at::kByte);
  void* base = MAP_FAILED;
  if (ftruncate(fd, piece) == 0) {
    base = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  }
  bool mapped = base != MAP_FAILED;
  for (int64_t i = 0; mapped && i < pieces; ++i) {
    void* at = static_cast<char*>(base) + i * piece;
    mapped = mmap(at, static_cast<size_t>(piece), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                  fd, 0) == at;
  }
  close(fd);  // the mappings keep the memory alive
  if (!mapped) {
    if (base != MAP_FAILED) munmap(base, span);
    return at::empty({n}, at::kByte);
  }
  return at::from_blob(base, {n}, [span](void* p) { munmap(p, span); }, at::kByte);
}

}  // namespace

at::Tensor byte_buffer(int64_t n, at::Device device, bool zeroed) {
  auto options = at::TensorOptions().dtype(at::kByte).device(device);
  return zeroed ? at::zeros({n}, options) : core::fresh_bytes(n, device);
}

TensorDict consolidated(const TensorDict& td, std::optional<at::Device> device) {
  return is_consolidated(td) ? td : consolidate(td, {.device = device});
}

std::string metadata_pickle(const TensorDict& c, const TransportFields& fields) {
  return wire::metadata_pickle_bytes(*consolidated_metadata(c), fields);
}

void send_object_and_storage(const Waiter& w, const Peer& peer, const std::string& pickle,
                             const at::Tensor& storage, at::Device framing_device) {
  std::vector<std::vector<at::Tensor>> messages = {
      {int64_tensor(static_cast<int64_t>(pickle.size()), framing_device)},
      {pickle_tensor(pickle, static_cast<int64_t>(pickle.size()), framing_device)},
      {storage}};
  static constexpr const char* kWhat[] = {"the metadata pickle's length (tag 0)",
                                          "the metadata pickle (tag 0)", "the storage (tag 0)"};
  w.wait(post_all(messages.size(), [&](size_t i) { return w.send(peer, messages[i][0], 0); }),
         [](size_t i) { return std::string(kWhat[i]); });
}

std::string recv_object(const Waiter& w, const Peer& peer, at::Device framing_device) {
  at::Tensor size = int64_tensor(0, framing_device);
  w.wait(w.recv(peer, size, 0), "the metadata pickle's length (tag 0)");
  const int64_t n = int64_value(size);
  check_pickle_size(w.call(), n, "a metadata pickle");
  if (!framing_device.is_cpu()) {
    // Zeroed: a shorter message than announced leaves zeros, which the reader refuses.
    at::Tensor bytes = byte_buffer(n, framing_device, /*zeroed=*/true);
    w.wait(w.recv(peer, bytes, 0), c10::str("the metadata pickle of ", n, " bytes"));
    return pickle_string(bytes, n);
  }
  // Gloo aborts the process on a message longer than the posted buffer, but takes a shorter
  // one: the buffer is as long as any pickle may be (pages untouched until bytes land cost
  // nothing), and stamps after the announced end and at its tail tell a longer or a shorter
  // message from the announced one.
  at::Tensor room = byte_buffer(kMaxPickleBytes + 8, at::kCPU);
  TailStamp end(room.narrow(0, 0, n)), beyond(room.narrow(0, 0, n + 8));
  w.wait(w.recv(peer, room, 0, {&end, &beyond}), c10::str("the metadata pickle of ", n, " bytes"));
  TD_CHECK_PEER(beyond.short_message(), w.call(), ": the peer announced a metadata pickle of ", n,
                " bytes and sent more");
  TD_CHECK_PEER(!end.short_message(), w.call(), ": the peer announced a metadata pickle of ", n,
                " bytes and sent fewer");
  return pickle_string(room, n);
}

std::string broadcast_object(const Waiter& w, const Peer& root, const std::string* pickle) {
  const bool is_root = pickle != nullptr;
  std::vector<at::Tensor> size{
      int64_tensor(is_root ? static_cast<int64_t>(pickle->size()) : 0, at::kCPU)};
  w.wait(root.group.broadcast(size, root.rank), "the metadata pickle's length");
  const int64_t n = int64_value(size[0]);
  if (!is_root) check_pickle_size(w.call(), n, "a metadata pickle");
  std::string out;
  std::vector<at::Tensor> bytes{is_root ? pickle_tensor(*pickle, n, at::kCPU)
                                        : string_buffer(out, n)};
  w.wait(root.group.broadcast(bytes, root.rank), c10::str("the metadata pickle of ", n, " bytes"));
  return is_root ? *pickle : out;
}

std::vector<std::string> all_gather_objects(const Waiter& w, const Group& group,
                                            const std::string& pickle) {
  const int size = group.size();
  std::vector<at::Tensor> mine{int64_tensor(static_cast<int64_t>(pickle.size()), at::kCPU)};
  std::vector<std::vector<at::Tensor>> sizes(1);
  for (int r = 0; r < size; ++r) sizes[0].push_back(int64_tensor(0, at::kCPU));
  w.wait(group.allgather(sizes, mine), "the metadata pickles' lengths");
  std::vector<int64_t> lengths;
  for (const auto& t : sizes[0]) {
    lengths.push_back(int64_value(t));
    // Every rank sees the same lengths, so every rank refuses alike and none is left waiting.
    check_pickle_size(w.call(), lengths.back(), "a metadata pickle");
  }
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::vector<at::Tensor> input{pickle_tensor(pickle, longest, at::kCPU)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  // Zeroed: what a rank sends short of `longest` stays zeros, never old memory.
  for (int r = 0; r < size; ++r) outputs[0].push_back(byte_buffer(longest, at::kCPU, true));
  w.wait(group.allgather(outputs, input), "the metadata pickles");
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.push_back(pickle_string(outputs[0][r], lengths[r]));
  return out;
}

std::string scatter_objects(const Waiter& w, const Peer& root,
                            const std::vector<std::string>* pickles) {
  const bool is_root = pickles != nullptr;
  int64_t longest = 0;
  if (is_root) {
    for (const auto& p : *pickles) longest = std::max<int64_t>(longest, p.size());
  }
  std::vector<at::Tensor> max_size{int64_tensor(longest, at::kCPU)};
  w.wait(root.group.broadcast(max_size, root.rank), "the longest metadata pickle's length");
  longest = int64_value(max_size[0]);
  if (!is_root) check_pickle_size(w.call(), longest, "a longest metadata pickle");

  std::vector<at::Tensor> out{byte_buffer(longest, at::kCPU, /*zeroed=*/true)};
  std::vector<std::vector<at::Tensor>> in;
  if (is_root) {
    in.emplace_back();
    for (const auto& p : *pickles) in[0].push_back(pickle_tensor(p, longest, at::kCPU));
  }
  w.wait(root.group.scatter(out, in, root.rank), "the metadata pickles");
  std::vector<at::Tensor> length{int64_tensor(0, at::kCPU)};
  std::vector<std::vector<at::Tensor>> lengths;
  if (is_root) {
    lengths.emplace_back();
    for (const auto& p : *pickles) {
      lengths[0].push_back(int64_tensor(static_cast<int64_t>(p.size()), at::kCPU));
    }
  }
  w.wait(root.group.scatter(length, lengths, root.rank), "the metadata pickles' lengths");
  const int64_t n = int64_value(length[0]);
  TD_CHECK_PEER(n > 0 && n <= longest, w.call(), ": the peer announced a metadata pickle of ", n,
                " bytes in a buffer of ", longest);
  return pickle_string(out[0], n);
}

Incoming parse_incoming(const std::string& from, std::string_view bytes, int64_t max_total_bytes,
                        bool padded) {
  Incoming in;
  in.from = from;
  TransportFields salvaged;
  try {
    in.metadata = wire::read_metadata_pickle(bytes);
  } catch (const c10::Error& e) {
    defer(in, peer_error(from, ": the metadata from the sender is refused: ", e.msg()));
    salvaged = salvage_fields(bytes);
  }
  const TransportFields& fields = in.metadata ? in.metadata->transport() : salvaged;
  in.total_bytes = size_field(from, fields, "_total_bytes", 0, max_total_bytes, in);
  if (padded) {
    in.max_bytes =
        size_field(from, fields, "_max_bytes", in.total_bytes.value_or(0), max_total_bytes, in);
  }
  if (const JsonScalar* device = field(fields, "_storage_device")) {
    if (std::holds_alternative<std::string>(*device)) {
      in.storage_device = std::get<std::string>(*device);
    } else {
      defer(in, peer_error(from, ": \"_storage_device\" is not a string"));
    }
  }
  if (const JsonScalar* tc = field(fields, "_tensorclass_type")) {
    // Only a name for the caller to look up: a Python module path and qualname.
    const auto* name = std::get_if<std::string>(tc);
    if (name != nullptr && !name->empty() && name->size() <= kMaxTensorclassTypeBytes) {
      in.tensorclass_type = *name;
    } else {
      defer(in, peer_error(from, ": \"_tensorclass_type\" is not a string of 1 to ",
                           kMaxTensorclassTypeBytes, " bytes"));
    }
  }
  if (in.metadata && in.total_bytes) {
    const int64_t needed = in.metadata->storage_bytes();
    if (needed > *in.total_bytes) {
      defer(in, peer_error(from, ": the metadata lays its leaves out over ", needed,
                           " bytes, but \"_total_bytes\" is ", *in.total_bytes));
    }
  }
  return in;
}

int64_t transfer_bytes(const Incoming& in, bool padded) {
  const auto& n = padded ? in.max_bytes : in.total_bytes;
  if (!n || (padded && !in.total_bytes)) {
    TORCH_INTERNAL_ASSERT(in.error);
    std::rethrow_exception(in.error);
  }
  return *n;
}

at::Device receive_device(const std::string& from, std::optional<at::Device> device, Incoming& in) {
  if (device) return *device;
  if (!in.storage_device) return at::kCPU;
  const std::string& label = *in.storage_device;
  const std::optional<at::Device> d = core::parse_device_name(label);
  if (!d) {
    defer(in, peer_error(from, ": the sender's \"_storage_device\" ", core::quoted_excerpt(label),
                         " is not a device"));
    return at::kCPU;
  }
  if (d->is_cpu()) return *d;
  // An accelerator label is honoured only if this process has that very device.
  const auto accelerator = at::accelerator::getAccelerator(false);
  const bool have = accelerator && *accelerator == d->type() &&
                    (d->has_index() ? d->index() < at::accelerator::deviceCount()
                                    : at::accelerator::deviceCount() > 0);
  if (!have) {
    defer(in, std::make_exception_ptr(c10::Error(
                  {__func__, __FILE__, uint32_t(__LINE__)},
                  c10::str(from, ": the sender's storage is on ", label,
                           ", a device this process does not have; pass `device` to choose "
                           "where to receive it"))));
    return at::kCPU;
  }
  return *d;
}

int64_t resolve_max_total_bytes(const char* call, std::optional<int64_t> max_total_bytes) {
  TORCH_CHECK_VALUE(!max_total_bytes || *max_total_bytes >= 0, call,
                    ": max_total_bytes must be non-negative, got ", max_total_bytes.value_or(0));
  return max_total_bytes.value_or(default_max_total_bytes());
}

StorageBuffer storage_buffer(const Incoming& in, int64_t n, at::Device device) {
  at::Tensor bytes;
  try {
    bytes = in.error && device.is_cpu() ? drain_buffer(n) : byte_buffer(n, device);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, in.from, ": could not allocate the ", n,
                " bytes of storage the sender "
                "announced on ",
                device.str(), ": ", e.msg());
  } catch (const std::bad_alloc&) {
    TORCH_CHECK(false, in.from, ": could not allocate the ", n,
                " bytes of storage the sender "
                "announced on ",
                device.str());
  }
  return {bytes, TailStamp(bytes)};
}

TensorDict finish(Incoming& in, const StorageBuffer& buffer) {
  if (in.error) std::rethrow_exception(in.error);
  TD_CHECK_PEER(!buffer.stamp.short_message(), in.from,
                ": the sender's storage message is shorter than the ", buffer.bytes.numel(),
                " bytes it announced; the TensorDict is refused");
  return core::rebuild_validated(std::move(*in.metadata),
                                 buffer.bytes.narrow(0, 0, *in.total_bytes));
}

}  // namespace tensordict::dist::detail

namespace tensordict::dist {

int64_t default_max_total_bytes() { return default_storage_limit_bytes(); }

}  // namespace tensordict::dist

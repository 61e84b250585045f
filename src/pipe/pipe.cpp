// TensorDictPipe: the framing of wire-format.md §6.1 / §6.2 on top of a UCP stream endpoint.
// Each logical message of the reference (flag byte, u64 length, JSON, storage, leaves) is sent
// in order on one stream, so the byte sequence equals the reference's message sequence.
#include "tensordict/pipe/pipe.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "pipe_impl.h"
#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"

namespace tensordict::pipe {
namespace detail {
namespace {

constexpr uint8_t kNewSchemaFlag = 0x00;
constexpr uint8_t kSameSchemaFlag = 0x01;
// Our close marker (not in the reference, which has no orderly close): the flag byte 0xff in
// consolidated mode, a header length of 2^64-1 in uncollated mode (over any cap, so never a
// real header). It lets the receiver tell a clean close from a lost peer.
constexpr uint8_t kCloseFlag = 0xff;
constexpr uint64_t kCloseLength = ~uint64_t{0};

void put_u64_le(uint8_t* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_u64_le(const uint8_t* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

at::Tensor bytes_tensor(size_t n) { return at::empty({static_cast<int64_t>(n)}, at::kByte); }
at::Tensor bytes_tensor(const std::string& s) {
  at::Tensor t = bytes_tensor(s.size());
  std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

// The reference's _infer_device: the TensorDict's device, else its first leaf's, else the CPU.
at::Device infer_device(const TensorDict& td) {
  if (td.device()) return *td.device();
  for (const auto& [key, value] : td.items({.include_nested = true, .leaves_only = true})) {
    return value.tensor().device();
  }
  return at::kCPU;
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "send: ", what, " is on ", t.device(),
                    "; this build of the pipe moves CPU memory only");
}

// Python's json.dumps of one string (ensure_ascii): nlohmann escapes the same characters the
// same way (\uXXXX in lowercase hex, surrogate pairs above the BMP).
std::string json_string(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', /*ensure_ascii=*/true);
}

std::string json_ints(at::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

}  // namespace

PipeImpl::PipeImpl(PipeOptions opts, std::shared_ptr<Worker> w)
    : options(std::move(opts)), worker(std::move(w)) {
  TORCH_CHECK_VALUE(options.timeout.count() > 0, "pipe: timeout must be positive");
  TORCH_CHECK_VALUE(options.max_metadata_bytes > 0 && options.max_storage_bytes >= 0,
                    "pipe: the size caps must be positive");
  send_scratch = bytes_tensor(16);
  recv_scratch = bytes_tensor(16);
}

PipeImpl::~PipeImpl() { close(); }

std::shared_ptr<Endpoint> PipeImpl::endpoint(const char* op) {
  std::lock_guard<std::mutex> lk(ep_mu);
  TORCH_CHECK(!closed.load(), "Cannot ", op, " on a closed pipe.");
  TORCH_CHECK(!peer_closed.load(), op, ": the peer closed the pipe");
  if (ep) return ep;
  TORCH_INTERNAL_ASSERT(listener != nullptr);
  ep = listener->accept(options.timeout);
  TORCH_CHECK(!closed.load(), "Cannot ", op, " on a closed pipe.");
  TORCH_CHECK(ep != nullptr, op, ": no client connected to port ", port, " within ",
              options.timeout.count(), " ms");
  return ep;
}

void PipeImpl::count(int64_t PipeStats::*field, int64_t n) {
  std::lock_guard<std::mutex> lk(stats_mu);
  stats.*field += n;
}

void PipeImpl::send_bytes(Endpoint& e, const void* data, size_t n, const at::Tensor& owner,
                          const char* what) {
  e.send(data, n, owner, what, options.timeout);
  count(&PipeStats::bytes_sent, static_cast<int64_t>(n));
}

void PipeImpl::recv_bytes(Endpoint& e, void* data, size_t n, const at::Tensor& owner,
                          const char* what) {
  Millis timeout = options.timeout;
  if (recv_deadline) {
    const auto left = std::chrono::duration_cast<Millis>(*recv_deadline - Clock::now());
    timeout = std::clamp(left, Millis(1), timeout);
  }
  e.recv(data, n, owner, what, timeout);
  count(&PipeStats::bytes_received, static_cast<int64_t>(n));
}

uint64_t PipeImpl::recv_length(Endpoint& e, const char* what, bool allow_close_marker) {
  auto* buf = recv_scratch.data_ptr<uint8_t>();
  recv_bytes(e, buf, 8, recv_scratch, what);
  const uint64_t n = get_u64_le(buf);
  if (allow_close_marker && n == kCloseLength) peer_left(e);
  if (n > static_cast<uint64_t>(options.max_metadata_bytes)) {
    const std::string why = c10::str("recv: peer ", e.peer(), " announced ", what, " of ", n,
                                     " bytes, over the limit of ", options.max_metadata_bytes,
                                     " (PipeOptions::max_metadata_bytes)");
    e.fail(why);  // the rest of the message is left unread: the stream is out of step
    TORCH_CHECK(false, why);
  }
  return n;
}

void PipeImpl::check_storage_cap(Endpoint& e, int64_t n, const char* what) {
  if (n > options.max_storage_bytes) {
    const std::string why = c10::str("recv: peer ", e.peer(), " announced ", what, " of ", n,
                                     " bytes, over the limit of ", options.max_storage_bytes,
                                     " (PipeOptions::max_storage_bytes)");
    e.fail(why);
    TORCH_CHECK(false, why);
  }
}

// ---- consolidated mode (§6.1) -----------------------------------------------------------------

void PipeImpl::send_consolidated(Endpoint& e, const TensorDict& td) {
  const TensorDict tdc =
      is_consolidated(td) ? td : consolidate(td, {.device = infer_device(td)});
  const auto state = tdc.consolidated_state();
  TORCH_INTERNAL_ASSERT(state && state->metadata);
  const at::Tensor& storage = state->storage;
  check_cpu(storage, "the consolidated storage");
  // The schema is the sorted JSON text itself rather than its SHA-256 (the reference's
  // _metadata_hash): comparing the text is exact, and no cheaper to get wrong. It is rebuilt
  // only when the metadata object changes; a consolidated TensorDict keeps the same one.
  bool new_schema = false;
  if (state->metadata != last_sent_metadata) {
    std::string schema = metadata_to_json(*state->metadata, /*sort_keys=*/true);
    new_schema = schema != last_sent_schema;
    last_sent_metadata = state->metadata;
    last_sent_schema = std::move(schema);
  }
  new_schema = new_schema || !sent_once;
  auto* scratch = send_scratch.data_ptr<uint8_t>();
  if (new_schema) {
    const std::string json = metadata_to_json(
        *state->metadata, /*sort_keys=*/true,
        {{"_total_bytes", storage.numel()}, {"_device", storage.device().str()}});
    scratch[0] = kNewSchemaFlag;
    put_u64_le(scratch + 8, json.size());
    send_bytes(e, scratch, 1, send_scratch, "the flag byte");
    send_bytes(e, scratch + 8, 8, send_scratch, "the metadata length");
    const at::Tensor json_bytes = bytes_tensor(json);
    send_bytes(e, json_bytes.data_ptr(), json.size(), json_bytes, "the metadata");
  } else {
    scratch[0] = kSameSchemaFlag;
    send_bytes(e, scratch, 1, send_scratch, "the flag byte");
  }
  sent_once = true;
  send_bytes(e, storage.data_ptr(), static_cast<size_t>(storage.numel()), storage, "the storage");
  count(&PipeStats::schema_sends, new_schema ? 1 : 0);
}

bool PipeImpl::can_recv_into(const TensorDict& td) const {
  if (!is_consolidated(td)) return false;
  const at::Tensor storage = consolidated_storage(td);
  if (storage.numel() != recv_total_bytes || storage.device() != recv_device) return false;
  if (recv_td && td.is_same(*recv_td)) return true;
  return metadata_to_json(*consolidated_metadata(td), /*sort_keys=*/true) == recv_schema;
}

TensorDict PipeImpl::recv_consolidated(Endpoint& e, const std::optional<TensorDict>& td,
                                       std::optional<at::Device> device) {
  auto* scratch = recv_scratch.data_ptr<uint8_t>();
  recv_bytes(e, scratch, 1, recv_scratch, "the flag byte");
  const uint8_t flag = scratch[0];
  if (flag == kCloseFlag) peer_left(e);
  if (flag == kSameSchemaFlag) {
    std::optional<TensorDict> target = recv_td;
    if (td && have_schema && can_recv_into(*td)) target = td;
    if (!target || !is_consolidated(*target)) {
      const std::string why =
          "Received same-schema flag but no consolidated TensorDict is available for in-place "
          "receive. The sender and receiver may be out of sync.";
      e.fail(why);
      TORCH_CHECK(false, why);
    }
    at::Tensor storage = consolidated_storage(*target);
    TORCH_INTERNAL_ASSERT(storage.numel() == recv_total_bytes);
    recv_bytes(e, storage.data_ptr(), static_cast<size_t>(storage.numel()), storage,
               "the storage");
    recv_td = target;
    return *target;
  }
  if (flag != kNewSchemaFlag) {
    const std::string why = c10::str("Unknown TensorDictPipe protocol flag: 0x",
                                     "0123456789abcdef"[flag >> 4], "0123456789abcdef"[flag & 15],
                                     " from peer ", e.peer(), " (expected 0x00 or 0x01).");
    e.fail(why);
    TORCH_CHECK(false, why);
  }
  const uint64_t meta_len = recv_length(e, "metadata");
  const at::Tensor meta_buf = bytes_tensor(meta_len);
  recv_bytes(e, meta_buf.data_ptr(), meta_len, meta_buf, "the metadata");
  TransportFields transport;
  Metadata metadata;
  int64_t total = -1;
  std::string sender_device = "cpu";
  try {
    metadata = metadata_from_json(
        std::string_view(static_cast<const char*>(meta_buf.const_data_ptr()), meta_len),
        &transport);
    for (const auto& [key, value] : transport) {
      if (key == "_total_bytes") {
        TORCH_CHECK_VALUE(std::holds_alternative<int64_t>(value) && std::get<int64_t>(value) >= 0,
                          "_total_bytes must be a nonnegative integer");
        total = std::get<int64_t>(value);
      } else if (key == "_device") {
        TORCH_CHECK_VALUE(std::holds_alternative<std::string>(value),
                          "_device must be a string");
        sender_device = std::get<std::string>(value);
      }  // other transport keys (the reference's metadata pollution, §7.11) are dropped
    }
    TORCH_CHECK_VALUE(total >= 0, "the metadata has no _total_bytes");
    TORCH_CHECK_VALUE(metadata_storage_bytes(metadata) <= total, "the leaves end past "
                      "_total_bytes (", total, ")");
  } catch (const c10::Error& err) {
    const std::string why =
        c10::str("recv: invalid metadata from peer ", e.peer(), ": ", err.what_without_backtrace());
    e.fail(why);
    TORCH_CHECK_VALUE(false, why);
  }
  check_storage_cap(e, total, "a storage");
  at::Device target_device = at::kCPU;
  if (device) {
    target_device = *device;
  } else {
    try {
      target_device = at::Device(sender_device);
    } catch (const c10::Error&) {
      e.fail("bad _device");
      TORCH_CHECK_VALUE(false, "recv: peer ", e.peer(), " sent an invalid _device '",
                        sender_device, "'");
    }
  }
  if (!target_device.is_cpu()) {
    e.fail("unsupported device");
    TORCH_CHECK_VALUE(false, "recv: the storage would go to ", target_device,
                      "; this build of the pipe moves CPU memory only (pass device=cpu)");
  }
  recv_schema = metadata_to_json(metadata, /*sort_keys=*/true);
  recv_total_bytes = total;
  recv_device = target_device;
  have_schema = true;
  recv_td.reset();
  if (td && can_recv_into(*td)) {
    at::Tensor storage = consolidated_storage(*td);
    recv_bytes(e, storage.data_ptr(), static_cast<size_t>(total), storage, "the storage");
    recv_td = td;
  } else {
    at::Tensor storage = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(target_device));
    recv_bytes(e, storage.data_ptr(), static_cast<size_t>(total), storage, "the storage");
    recv_td = rebuild(std::move(metadata), storage);
  }
  count(&PipeStats::schema_recvs, 1);
  return *recv_td;
}

// ---- uncollated mode (§6.2, in the form tensordict 0.15.3 sends) -----------------------------
// Header {"keys", "dtypes", "shapes", "batch_size", "unbatched", "non_tensors"}, then each
// tensor leaf (nested ones included) sorted by its "."-joined key. A receiver that knows only
// keys/dtypes/shapes reads the top-level case; ours reads both forms.

void PipeImpl::send_uncollated(Endpoint& e, const TensorDict& td) {
  auto items = td.items({.include_nested = true, .leaves_only = true});
  auto joined = [](const NestedKey& k) {
    std::string s;
    for (size_t i = 0; i < k.size(); ++i) s += (i ? "." : "") + k[i];
    return s;
  };
  std::vector<std::pair<std::string, size_t>> order;
  order.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) order.emplace_back(joined(items[i].first), i);
  std::stable_sort(order.begin(), order.end());  // byte order = code-point order in UTF-8

  std::string keys = "[", dtypes = "[", shapes = "[";
  std::vector<at::Tensor> leaves;
  for (size_t j = 0; j < order.size(); ++j) {
    const auto& [key, value] = items[order[j].second];
    const at::Tensor& t = value.tensor();
    check_cpu(t, c10::str("leaf ", key.str()).c_str());
    const char* sep = j ? ", " : "";
    if (key.is_nested()) {
      std::string parts = "[";
      for (size_t i = 0; i < key.size(); ++i) parts += (i ? ", " : "") + json_string(key[i]);
      keys += sep + parts + "]";
    } else {
      keys += sep + json_string(key[0]);
    }
    dtypes += sep + json_string(dtype_name(t.scalar_type()));
    shapes += sep + json_ints(t.sizes());
    leaves.push_back(t.contiguous());
  }
  const std::string header = "{\"keys\": " + keys + "], \"dtypes\": " + dtypes +
                             "], \"shapes\": " + shapes + "], \"batch_size\": " +
                             json_ints(td.batch_size()) +
                             ", \"unbatched\": [], \"non_tensors\": []}";
  auto* scratch = send_scratch.data_ptr<uint8_t>();
  put_u64_le(scratch, header.size());
  send_bytes(e, scratch, 8, send_scratch, "the header length");
  const at::Tensor header_bytes = bytes_tensor(header);
  send_bytes(e, header_bytes.data_ptr(), header.size(), header_bytes, "the header");
  for (const at::Tensor& t : leaves) send_bytes(e, t.data_ptr(), t.nbytes(), t, "a leaf");
}

TensorDict PipeImpl::recv_uncollated(Endpoint& e, std::optional<at::Device> device) {
  const at::Device target_device = device.value_or(at::kCPU);
  TORCH_CHECK_VALUE(target_device.is_cpu(), "recv: this build of the pipe moves CPU memory only");
  const uint64_t len = recv_length(e, "an uncollated header", /*allow_close_marker=*/true);
  const at::Tensor buf = bytes_tensor(len);
  recv_bytes(e, buf.data_ptr(), len, buf, "the header");

  struct Leaf {
    std::vector<std::string> key;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t nbytes;
  };
  std::vector<Leaf> leaves;
  std::vector<int64_t> batch_size;
  try {
    const auto header = nlohmann::json::parse(
        static_cast<const char*>(buf.const_data_ptr()),
        static_cast<const char*>(buf.const_data_ptr()) + len, nullptr, /*allow_exceptions=*/true,
        /*ignore_comments=*/false);
    auto field = [&](const char* name) -> const nlohmann::json* {
      auto it = header.find(name);
      return it == header.end() ? nullptr : &*it;
    };
    TORCH_CHECK_VALUE(header.is_object() && field("keys") && field("keys")->is_array() &&
                          field("dtypes") && field("dtypes")->is_array() && field("shapes") &&
                          field("shapes")->is_array(),
                      "expected keys, dtypes, and shapes lists");
    const auto& keys = *field("keys");
    const auto& dtypes = *field("dtypes");
    const auto& shapes = *field("shapes");
    TORCH_CHECK_VALUE(keys.size() == dtypes.size() && keys.size() == shapes.size(),
                      "list lengths must match");
    auto nonneg_ints = [](const nlohmann::json& j, const char* what) {
      TORCH_CHECK_VALUE(j.is_array(), what, " must be a list");
      std::vector<int64_t> out;
      for (const auto& d : j) {
        TORCH_CHECK_VALUE(d.is_number_integer() && d.get<int64_t>() >= 0, what,
                          " must be nonnegative integers");
        out.push_back(d.get<int64_t>());
      }
      return out;
    };
    if (const auto* b = field("batch_size")) batch_size = nonneg_ints(*b, "the batch size");
    for (const char* name : {"unbatched", "non_tensors"}) {
      const auto* f = field(name);
      TORCH_CHECK_VALUE(!f || (f->is_array() && f->empty()), name,
                        " entries are not supported by this implementation");
    }
    std::set<std::vector<std::string>> seen;
    int64_t total = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      Leaf leaf;
      std::function<void(const nlohmann::json&)> flatten = [&](const nlohmann::json& k) {
        if (k.is_string()) {
          leaf.key.push_back(k.get<std::string>());
          return;
        }
        TORCH_CHECK_VALUE(k.is_array() && !k.empty() && leaf.key.size() < 64,
                          "a key must be a string or a nonempty nested path");
        for (const auto& part : k) flatten(part);
      };
      flatten(keys[i]);
      TORCH_CHECK_VALUE(seen.insert(leaf.key).second, "keys must be unique");
      TORCH_CHECK_VALUE(dtypes[i].is_string(), "unknown torch dtype");
      const auto dt = dtype_from_name(dtypes[i].get<std::string>());
      TORCH_CHECK_VALUE(dt.has_value(), "unknown torch dtype ", dtypes[i].dump());
      leaf.dtype = *dt;
      leaf.shape = nonneg_ints(shapes[i], "dimensions");
      TORCH_CHECK_VALUE(leaf.shape.size() >= batch_size.size() &&
                            std::equal(batch_size.begin(), batch_size.end(), leaf.shape.begin()),
                        "a shape does not start with the batch size");
      int64_t n = static_cast<int64_t>(c10::elementSize(leaf.dtype));
      for (int64_t d : leaf.shape) {
        TORCH_CHECK_VALUE(d == 0 || n <= options.max_storage_bytes / d,
                          "the leaves exceed the storage limit of ", options.max_storage_bytes,
                          " (PipeOptions::max_storage_bytes)");
        n *= d;
      }
      total += n;
      TORCH_CHECK_VALUE(total <= options.max_storage_bytes, "the leaves exceed the storage ",
                        "limit of ", options.max_storage_bytes, " (PipeOptions::max_storage_bytes)");
      leaf.nbytes = n;
      leaves.push_back(std::move(leaf));
    }
    for (const auto& key : seen) {  // a leaf cannot also be a level above another leaf
      for (size_t n = 1; n < key.size(); ++n) {
        TORCH_CHECK_VALUE(!seen.count({key.begin(), key.begin() + n}),
                          "a leaf key cannot also have descendants");
      }
    }
  } catch (const nlohmann::json::exception& err) {
    const std::string why = c10::str("recv: malformed uncollated header from peer ", e.peer(),
                                     ": ", err.what());
    e.fail(why);
    TORCH_CHECK_VALUE(false, why);
  } catch (const c10::Error& err) {
    const std::string why = c10::str("recv: invalid uncollated header from peer ", e.peer(), ": ",
                                     err.what_without_backtrace());
    e.fail(why);
    TORCH_CHECK_VALUE(false, why);
  }
  TensorDict result({}, batch_size);
  for (const Leaf& leaf : leaves) {
    at::Tensor t = at::empty(leaf.shape, at::TensorOptions().dtype(leaf.dtype).device(target_device));
    recv_bytes(e, t.data_ptr(), static_cast<size_t>(leaf.nbytes), t, "a leaf");
    result.set(NestedKey(leaf.key), t);
  }
  return result;
}

// ---- lifecycle ----------------------------------------------------------------------------------

void PipeImpl::peer_left(Endpoint& e) {
  peer_closed = true;
  // Our orderly close is the closer's cue that everything was read (see say_goodbye).
  e.close(options.timeout);
  TORCH_CHECK(false, "recv: the peer ", e.peer(), " closed the pipe");
}

void PipeImpl::say_goodbye(Endpoint& e) noexcept {
  // A send in flight (another thread) or a partial one would put the marker mid-message.
  std::unique_lock<std::mutex> send_lk(send_mu, std::try_to_lock);
  if (!send_lk.owns_lock() || !at_message_boundary) return;
  const auto deadline = Clock::now() + std::min(options.linger, options.timeout);
  const size_t n = options.consolidated ? 1 : 8;
  bool sent_data;
  {
    std::lock_guard<std::mutex> lk(stats_mu);
    sent_data = stats.bytes_sent > 0;
  }
  try {
    std::memset(send_scratch.data_ptr(), kCloseFlag, 8);
    e.send(send_scratch.data_ptr(), n, send_scratch, "the close marker", options.timeout);
  } catch (...) {
    return;  // the peer is gone already
  }
  if (!sent_data || options.linger.count() <= 0) return;
  // Linger: the peer reads up to the marker, then closes, which fails our endpoint. A peer that
  // is closing too may have unread messages of its own before its marker: when no recv() is in
  // flight here, receive (and drop) them until its marker, so neither end waits for the other.
  std::unique_lock<std::mutex> recv_lk(recv_mu, std::try_to_lock);
  if (recv_lk.owns_lock()) {
    recv_deadline = deadline;
    try {
      while (Clock::now() < deadline) {
        if (options.consolidated) {
          recv_consolidated(e, std::nullopt, at::Device(at::kCPU));
        } else {
          recv_uncollated(e, std::nullopt);
        }
      }
    } catch (...) {
      // The peer's marker, its disconnect, or the deadline (which broke the endpoint).
    }
    recv_deadline.reset();
    return;
  }
  e.wait_gone(std::chrono::duration_cast<Millis>(deadline - Clock::now()));
}

void PipeImpl::close() noexcept {
  if (closed.exchange(true)) return;
  if (listener) listener->close(options.timeout);  // wakes an accept() waiting for a client
  std::shared_ptr<Endpoint> e;
  {
    std::lock_guard<std::mutex> lk(ep_mu);
    e = ep;
  }
  if (!e) return;
  if (!peer_closed.load()) say_goodbye(*e);
  e->close(options.timeout);
}

}  // namespace detail

// ---- Pipe -------------------------------------------------------------------------------------

using detail::PipeImpl;

Pipe::Pipe(std::shared_ptr<PipeImpl> impl) : impl_(std::move(impl)) {}

Pipe Pipe::listen(int port, const std::string& host, const PipeOptions& options) {
  auto impl = std::make_shared<PipeImpl>(options, detail::Worker::create());
  impl->listener = detail::Listener::create(impl->worker.get(), host, port, /*max_clients=*/1,
                                            options.timeout);
  impl->port = impl->listener->port();
  return Pipe(std::move(impl));
}

Pipe Pipe::connect(const std::string& host, int port, const PipeOptions& options) {
  auto impl = std::make_shared<PipeImpl>(options, detail::Worker::create());
  impl->ep = detail::Endpoint::connect(impl->worker.get(), host, port, options.timeout);
  impl->port = port;
  return Pipe(std::move(impl));
}

void Pipe::send(const TensorDict& td) {
  std::lock_guard<std::mutex> lk(impl_->send_mu);
  auto e = impl_->endpoint("send");
  impl_->at_message_boundary = false;
  if (impl_->options.consolidated) {
    impl_->send_consolidated(*e, td);
  } else {
    impl_->send_uncollated(*e, td);
  }
  impl_->at_message_boundary = true;
  impl_->count(&PipeStats::sends, 1);
}

TensorDict Pipe::recv(const std::optional<TensorDict>& td, std::optional<at::Device> device) {
  std::lock_guard<std::mutex> lk(impl_->recv_mu);
  auto e = impl_->endpoint("recv");
  TensorDict out = impl_->options.consolidated ? impl_->recv_consolidated(*e, td, device)
                                               : impl_->recv_uncollated(*e, device);
  impl_->count(&PipeStats::recvs, 1);
  return out;
}

void Pipe::accept() { impl_->endpoint("accept"); }

void Pipe::close() noexcept { impl_->close(); }
bool Pipe::closed() const { return impl_->closed.load(); }
bool Pipe::peer_closed() const { return impl_->peer_closed.load(); }
int Pipe::port() const { return impl_->port; }

std::string Pipe::peer() const {
  std::lock_guard<std::mutex> lk(impl_->ep_mu);
  return impl_->ep ? impl_->ep->peer() : std::string();
}

const PipeOptions& Pipe::options() const { return impl_->options; }

PipeStats Pipe::stats() const {
  std::lock_guard<std::mutex> lk(impl_->stats_mu);
  return impl_->stats;
}

void Pipe::send_raw(const void* data, size_t n) {
  std::lock_guard<std::mutex> lk(impl_->send_mu);
  auto e = impl_->endpoint("send");
  impl_->at_message_boundary = false;  // the framing is the caller's now
  const at::Tensor copy = detail::bytes_tensor(std::string(static_cast<const char*>(data), n));
  impl_->send_bytes(*e, copy.data_ptr(), n, copy, "raw bytes");
}

std::string Pipe::recv_raw(size_t n) {
  std::lock_guard<std::mutex> lk(impl_->recv_mu);
  auto e = impl_->endpoint("recv");
  const at::Tensor buf = detail::bytes_tensor(n);
  impl_->recv_bytes(*e, buf.data_ptr(), n, buf, "raw bytes");
  return std::string(static_cast<const char*>(buf.const_data_ptr()), n);
}

}  // namespace tensordict::pipe

// The pipe's send half (wire/pipe_frames.h's FrameWriter): every message of a TensorDict in both
// modes (docs/wire-format.md §6.1, §6.2, §6.8) and the close marker (§6.7). Bytes only: the
// pipe (src/pipe/pipe_impl.cpp) sends what it writes, in order.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "core/bytes.h"
#include "wire/pipe_frames.h"

namespace tensordict::wire::frames {
namespace {

std::optional<at::Device> first_leaf_device(const TensorDict& td) {
  for (const auto& [key, value] : td.entries()) {  // a lazy stack's entries: its members
    if (value.is_tensor()) return value.tensor().device();
    if (value.is_tensordict()) {
      if (auto d = first_leaf_device(value.tensordict())) return d;
    }
  }
  return std::nullopt;
}

// The reference's _infer_device: the TensorDict's device, else its first leaf's, else the CPU.
at::Device infer_device(const TensorDict& td) {
  if (td.device()) return *td.device();
  return first_leaf_device(td).value_or(at::Device(at::kCPU));
}

}  // namespace

FrameWriter::FrameWriter(bool consolidated)
    : consolidated_(consolidated), scratch_(bytes_tensor(16)) {}

std::vector<OutFrame> FrameWriter::write(const TensorDict& td, bool joins, const SendCheck& check,
                                         bool* new_schema) {
  if (new_schema != nullptr) *new_schema = false;
  return consolidated_ ? write_consolidated(td, joins, check, new_schema)
                       : write_uncollated(td, check);
}

bool FrameWriter::schema_changes(const ConsolidatedState& state) {
  // The schema is the sorted JSON text itself rather than its SHA-256 (the reference's
  // _metadata_hash): comparing the text is exact, and no cheaper to get wrong. The state makes
  // it once and keeps it; it is compared only when the metadata object changes (a consolidated
  // TensorDict keeps the same one).
  bool changed = !sent_once_;
  if (state.metadata != last_metadata_) {
    const std::string& schema = state.sorted_json();
    changed = changed || schema != last_schema_;
    last_metadata_ = state.metadata;
    last_schema_ = schema;
  }
  return changed;
}

std::vector<OutFrame> FrameWriter::write_consolidated(const TensorDict& td, bool joins,
                                                      const SendCheck& check, bool* new_schema) {
  const TensorDict tdc = is_consolidated(td) ? td : consolidate(td, {.device = infer_device(td)});
  const auto state = tdc.consolidated_state();
  TORCH_INTERNAL_ASSERT(state && state->metadata);
  const at::Tensor& storage = state->storage;
  check("the consolidated storage", storage);
  const bool fresh = schema_changes(*state);
  sent_once_ = true;
  const auto n = static_cast<size_t>(storage.numel());
  auto* scratch = scratch_.data_ptr<uint8_t>();
  std::vector<OutFrame> out;
  if (fresh) {
    // Insertion order with the transport keys last, as 0.15.3's json.dumps writes it (the
    // schema is compared on the sorted form above).
    text_ = bytes_tensor(
        metadata_to_json(*state->metadata, /*sort_keys=*/false,
                         {{"_total_bytes", storage.numel()}, {"_device", storage.device().str()}}));
    scratch[0] = kNewSchemaFlag;
    core::put_le(scratch + 8, static_cast<uint64_t>(text_.numel()));
    out.push_back({scratch, 1, scratch_, "the flag byte"});
    out.push_back({scratch + 8, 8, scratch_, "the metadata length"});
    out.push_back({text_.data_ptr(), static_cast<size_t>(text_.numel()), text_, "the metadata"});
    if (new_schema != nullptr) *new_schema = true;
  } else if (joins && storage.numel() <= kMaxJoinedStorage) {
    // One message, a copy: it may be a credit send still in flight when the send returns, while
    // the caller may write its storage at once. The buffer is reused unless a send in flight
    // still holds it.
    if (!joined_.defined() || joined_.use_count() > 1)
      joined_ = bytes_tensor(1 + kMaxJoinedStorage);
    auto* buf = joined_.data_ptr<uint8_t>();
    buf[0] = kSameSchemaFlag;
    if (n > 0) std::memcpy(buf + 1, storage.const_data_ptr(), n);
    out.push_back({buf, 1 + n, joined_, "the flag byte and the storage"});
    return out;
  } else {
    scratch[0] = kSameSchemaFlag;
    out.push_back({scratch, 1, scratch_, "the flag byte"});
  }
  out.push_back({storage.data_ptr(), n, storage, "the storage"});
  return out;
}

bool FrameWriter::writes_joined(const TensorDict& td) const {
  if (!consolidated_ || !sent_once_ || !is_consolidated(td)) return false;
  const auto state = td.consolidated_state();
  const at::Tensor& storage = state->storage;
  if (!storage.device().is_cpu() || storage.numel() > kMaxJoinedStorage) return false;
  return state->metadata == last_metadata_ || state->sorted_json() == last_schema_;
}

std::vector<OutFrame> FrameWriter::write_uncollated(const TensorDict& td, const SendCheck& check) {
  // The header and leaves of the form tensordict 0.15.3 sends, after the header's length.
  UncollatedFrame frame = uncollated_frame(td, [&](const NestedKey& key, const at::Tensor& t) {
    check(c10::str("leaf ", key.str()), t);
  });
  text_ = bytes_tensor(frame.header);
  auto* scratch = scratch_.data_ptr<uint8_t>();
  core::put_le(scratch, static_cast<uint64_t>(text_.numel()));
  std::vector<OutFrame> out;
  out.push_back({scratch, 8, scratch_, "the header length"});
  out.push_back({text_.data_ptr(), static_cast<size_t>(text_.numel()), text_, "the header"});
  for (const at::Tensor& t : frame.leaves) out.push_back({t.data_ptr(), t.nbytes(), t, "a leaf"});
  return out;
}

OutFrame FrameWriter::close_marker() {
  std::memset(scratch_.data_ptr(), kCloseFlag, 8);
  return {scratch_.data_ptr(), consolidated_ ? size_t{1} : size_t{8}, scratch_, "the close marker"};
}

}  // namespace tensordict::wire::frames

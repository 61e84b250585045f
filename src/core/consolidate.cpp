#include "tensordict/consolidate.h"

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/MapAllocator.h>
#include <c10/core/TensorImpl.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <thread>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "core/byte_tensor.h"
#include "core/bytes.h"
#include "core/json_text.h"
#include "core/metadata.h"
#include "non_tensor_ops.h"
#include "tensor_dict_impl.h"
#include "tensordict/dtypes.h"
#include "tensordict/leaf.h"

namespace tensordict {
namespace {

using core::check_leaf_dtype;
using core::is_reserved_node_key;
using core::path_str;
using core::validate;
using detail::TensorDictImpl;

constexpr int64_t kAlign = core::kLeafAlign;
// Below this many bytes per thread, starting a thread costs more than the copy it saves.
constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;

// A tensor of `dtype` and `shape` over the bytes [start, ...) of `storage`. Built directly on
// the storage, which is what narrow().view(dtype).view(shape) yields, without three dispatches
// per leaf (1000-leaf TensorDicts are the common case on the wire).
at::Tensor leaf_view(const at::Tensor& storage, int64_t start, at::ScalarType dtype,
                     at::IntArrayRef shape) {
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(storage.storage()), storage.key_set(), c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous(shape);
  // Validation guarantees alignment whenever there are elements; an empty leaf may sit at any
  // multiple of 8, so its offset is rounded down.
  impl->set_storage_offset((storage.storage_offset() + start) / esize);
  return at::Tensor(std::move(impl));
}

at::Tensor leaf_view(const at::Tensor& storage, const LeafMetadata& leaf) {
  return leaf_view(storage, leaf.start, leaf.dtype, leaf.shape);
}

ClsMetadata cls_metadata_of(const TensorDict& td) {
  const auto bs = td.batch_size();
  if (td.is_lazy_stack()) {
    const auto& lazy = *TensorDictImpl::of(td).lazy;
    ClsMetadata cm;
    cm.names.assign(bs.size(), std::nullopt);
    cm.batch_size.assign(bs.begin(), bs.end());
    cm.is_locked = td.is_locked();
    cm.stack_dim = lazy.stack_dim;
    cm.stack_dim_name = lazy.stack_dim_name;
    return cm;
  }
  const auto device = td.device();
  return ClsMetadata{device ? std::optional<std::string>(device->str()) : std::nullopt,
                     std::vector<std::optional<std::string>>(bs.size()),
                     std::vector<int64_t>(bs.begin(), bs.end()),
                     td.is_locked(),
                     0,
                     std::nullopt};
}

// A non-tensor entry as a node's "non_tensors" records it: (data, batch_size, str(device) or
// None), the device being `device_override` when the entry has one.
NonTensorMetadata non_tensor_metadata(const NonTensorData& nt,
                                      const std::optional<at::Device>& device_override) {
  std::optional<std::string> dev;
  if (nt.device()) dev = (device_override ? *device_override : *nt.device()).str();
  return NonTensorMetadata{nt.data(), nt.batch_size().vec(), dev, nt.is_metadata()};
}

// A NonTensorStack's node, as the reference records it: its members "0", "1", ... as
// "non_tensors" entries, or as nodes of their own when they are stacks too.
Metadata stack_node(const NonTensorData& nt, bool locked,
                    const std::optional<at::Device>& device_override) {
  Metadata m;
  m.cls = std::string(kNonTensorStackCls);
  auto& cm = m.cls_metadata;
  cm.batch_size = nt.batch_size().vec();
  cm.names.assign(cm.batch_size.size(), std::nullopt);
  cm.stack_dim = nt.stack_dim();
  cm.stack_dim_name = nt.stack_dim_name();
  cm.is_locked = locked;
  const auto& members = nt.members();
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].is_stack()) {
      m.children.emplace_back(std::to_string(i), stack_node(members[i], locked, device_override));
    } else {
      m.non_tensors.emplace_back(std::to_string(i),
                                 non_tensor_metadata(members[i], device_override));
    }
  }
  return m;
}

// The NonTensorStack a validated stack node describes; a member that names a device gets the
// storage's.
NonTensorData rebuild_stack(const Metadata& m, const at::Device& device) {
  const size_t n = m.non_tensors.size() + m.children.size();
  std::vector<std::optional<NonTensorData>> members(n);
  for (const auto& [key, nt] : m.non_tensors) {
    const std::optional<at::Device> dev = nt.device ? std::optional(device) : std::nullopt;
    members[std::stoul(key)] = NonTensorData(
        nt.data, nt.batch_size, dev, nt.metadata ? NonTensorKind::kMetaData : NonTensorKind::kData);
  }
  for (const auto& [key, child] : m.children)
    members[std::stoul(key)] = rebuild_stack(child, device);
  std::vector<NonTensorData> out;
  out.reserve(n);
  for (auto& member : members) out.push_back(std::move(*member));  // validated: each key once
  if (out.empty()) return detail::empty_stack(m.cls_metadata.batch_size, std::nullopt);
  return NonTensorData::stack(std::move(out), m.cls_metadata.stack_dim,
                              m.cls_metadata.stack_dim_name);
}

// ---- consolidate --------------------------------------------------------------------------

// Walks a TensorDict depth first in insertion order, assigning byte ranges and recording the
// metadata the reference would record.
struct Planner {
  std::optional<at::Device> device_override;
  int64_t offset = 0;
  std::vector<std::string> path{};

  // A lazy stack's members are its entries, so they become its children "0", "1", ...
  void node(const TensorDict& td, Metadata& m, int depth, std::vector<at::Tensor>& srcs) {
    if (td.is_lazy_stack()) m.cls = std::string(kLazyStackCls);
    m.cls_metadata = cls_metadata_of(td);
    if (device_override && td.device() && !td.is_lazy_stack()) {
      m.cls_metadata.device = device_override->str();
    }
    size_t n_leaves = 0, n_children = 0;
    for (const auto& [key, value] : td.entries()) {
      n_leaves += value.is_tensor();
      n_children +=
          value.is_tensordict() || (value.is_non_tensor() && value.non_tensor().is_stack());
    }
    m.leaves.reserve(n_leaves);
    m.children.reserve(n_children);
    for (const auto& [key, value] : td.entries()) {
      if (value.is_tensor()) {
        // The reference would rebuild it as a plain tensor, and refuses it (its message).
        TORCH_CHECK_NOT_IMPLEMENTED(!value.is_unbatched(),
                                    "UnbatchedTensor entries cannot be "
                                    "consolidated yet, but ",
                                    path_str(path, key), " is one.");
        m.leaves.emplace_back(key, leaf(key, value.tensor()));
        srcs.push_back(value.tensor());
        continue;
      }
      if (value.is_non_tensor() && value.non_tensor().is_stack()) {
        TORCH_CHECK_VALUE(!is_reserved_node_key(key), "consolidate: nested key ",
                          path_str(path, key), " collides with a field of the metadata");
        m.children.emplace_back(key,
                                stack_node(value.non_tensor(), td.is_locked(), device_override));
        continue;
      }
      if (value.is_non_tensor()) {
        m.non_tensors.emplace_back(key, non_tensor_metadata(value.non_tensor(), device_override));
        continue;
      }
      TORCH_CHECK_VALUE(!is_reserved_node_key(key), "consolidate: nested key ", path_str(path, key),
                        " collides with a field of the metadata");
      TORCH_CHECK_VALUE(depth < kMaxMetadataDepth, "consolidate: ", path_str(path, key),
                        " is nested deeper than ", kMaxMetadataDepth, " levels");
      path.push_back(key);
      node(value.tensordict(), m.children.emplace_back(key, Metadata{}).second, depth + 1, srcs);
      path.pop_back();
    }
  }

  LeafMetadata leaf(const std::string& key, const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.defined(), "consolidate: leaf ", path_str(path, key), " is undefined");
    TORCH_CHECK_TYPE(t.layout() == at::kStrided && !t.is_nested(), "consolidate: leaf ",
                     path_str(path, key), " has layout ", t.layout(),
                     "; only strided tensors can be consolidated");
    if (t.unsafeGetTensorImpl()->is_python_dispatch()) {
      check_transferable("consolidate", path_str(path, key), t);  // a DTensor: refused
    }
    check_leaf_dtype(t.scalar_type(), "consolidate", [&] { return path_str(path, key); });
    TORCH_CHECK_VALUE(!t.is_meta(), "consolidate: leaf ", path_str(path, key),
                      " is on the meta device, which holds no data to pack");
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    const int64_t pad = (kAlign - nbytes % kAlign) % kAlign;
    const int64_t esize = static_cast<int64_t>(t.element_size());
    // The reference fails here too (view(dtype) needs an aligned storage offset).
    TORCH_CHECK_VALUE(nbytes == 0 || offset % esize == 0, "consolidate: leaf ", path_str(path, key),
                      " (", dtype_name(t.scalar_type()), ") would start at byte ", offset,
                      ", not a multiple of its ", esize,
                      "-byte element size, so it cannot be a view of the storage");
    LeafMetadata l{t.scalar_type(), t.sizes().vec(), offset, offset + nbytes + pad, pad};
    offset = l.stop;
    return l;
  }
};

struct Plan {
  Metadata metadata;
  std::vector<at::Tensor> srcs;  // leaves in depth-first insertion order
  int64_t total = 0;
};

Plan plan(const TensorDict& td, std::optional<at::Device> device_override = std::nullopt) {
  Plan p;
  Planner planner{device_override};
  planner.node(td, p.metadata, 0, p.srcs);
  p.total = planner.offset;
  return p;
}

// The metadata's leaves in the TensorDict's depth-first insertion order, the order plan() gave
// the sources (a node lists its leaves before its children, the TensorDict may not).
void leaves_in_td_order(const TensorDict& td, const Metadata& m,
                        std::vector<const LeafMetadata*>& out) {
  size_t li = 0, ci = 0;
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensor()) {
      out.push_back(&m.leaves[li++].second);
    } else if (value.is_tensordict()) {
      leaves_in_td_order(value.tensordict(), m.children[ci++].second, out);
    } else if (value.non_tensor().is_stack()) {
      ++ci;  // a NonTensorStack's node holds no leaf
    }
  }
}

at::Tensor allocate_storage(int64_t total, at::Device device, const ConsolidateOptions& o) {
  if (o.share_memory && device.is_cpu() && total > 0) {
    // What Python's storage.share_memory_() does under the default file_descriptor strategy,
    // so that torch.multiprocessing shares the storage without another copy.
    const int flags = at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_EXCLUSIVE |
                      at::ALLOCATOR_MAPPED_KEEPFD | at::ALLOCATOR_MAPPED_UNLINK;
    auto data = at::MapAllocator::makeDataPtr(at::NewProcessWideShmHandle(), flags,
                                              static_cast<size_t>(total), nullptr);
    c10::Storage storage(c10::Storage::use_byte_size_t(), total, std::move(data),
                         /*allocator=*/nullptr, /*resizable=*/false);
    return at::empty({0}, at::kByte).set_(std::move(storage), 0, {total}, {1});
  }
  return core::fresh_bytes(total, device, o.pin_memory);
}

// The storage of consolidate(filename=...), in the reference's file layout (docs/wire-format.md
// §3.5): the leaves' bytes, then the metadata JSON, then its length as a little-endian int64.
// The file is made anew (a mapping of a file it replaces keeps that file's data) and mapped
// shared, so that the leaves written into the storage, and later writes to them, reach it.
at::Tensor file_storage(const std::string& filename, const Plan& p) {
  const std::string json = metadata_to_json(p.metadata);
  const auto json_bytes = static_cast<int64_t>(json.size());
  std::error_code ec;
  // remove() would delete an empty directory and write the file in its place.
  TORCH_CHECK(!std::filesystem::is_directory(filename, ec), "consolidate: cannot write ", filename,
              ": it is a directory");
  std::filesystem::remove(filename, ec);  // a missing file is fine
  at::Tensor file;
  try {
    file = at::from_file(filename, /*shared=*/true, p.total + json_bytes + 8, at::kByte);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "consolidate: cannot write ", filename, ": ", e.what_without_backtrace());
  }
  auto* base = file.data_ptr<uint8_t>();
  std::memcpy(base + p.total, json.data(), json.size());
  core::put_le(base + p.total + json_bytes, static_cast<uint64_t>(json_bytes));
  return file.narrow(0, 0, p.total);
}

struct Segment {
  uint8_t* dst;
  const uint8_t* src;  // nullptr: zero fill (padding)
  int64_t n;
};

// Copies the segments' bytes [lo, hi) of their concatenation.
void run_segments(const std::vector<Segment>& segs, int64_t lo, int64_t hi) {
  int64_t pos = 0;
  for (const auto& s : segs) {
    const int64_t a = std::max(lo, pos), b = std::min(hi, pos + s.n);
    if (a < b) {
      if (s.src) {
        std::memcpy(s.dst + (a - pos), s.src + (a - pos), static_cast<size_t>(b - a));
      } else {
        std::memset(s.dst + (a - pos), 0, static_cast<size_t>(b - a));
      }
    }
    pos += s.n;
    if (pos >= hi) break;
  }
}

void copy_leaves(const std::vector<at::Tensor>& srcs,
                 const std::vector<const LeafMetadata*>& leaves, const at::Tensor& storage,
                 int num_threads) {
  const bool cpu = storage.is_cpu();
  uint8_t* base = cpu ? storage.data_ptr<uint8_t>() : nullptr;
  std::vector<Segment> segs;
  std::vector<size_t> slow;  // leaves that need ATen's copy (strided, conjugate, other device)
  int64_t seg_bytes = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto& t = srcs[i];
    const auto& l = *leaves[i];
    const int64_t n = l.stop - l.start - l.pad;
    const bool fast = cpu && t.is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg();
    if (n > 0 && fast) {
      segs.push_back({base + l.start, static_cast<const uint8_t*>(t.const_data_ptr()), n});
      seg_bytes += n;
    } else if (n > 0) {
      slow.push_back(i);
    }
    if (l.pad > 0 && cpu) {
      segs.push_back({base + l.stop - l.pad, nullptr, l.pad});
      seg_bytes += l.pad;
    } else if (l.pad > 0) {
      storage.narrow(0, l.stop - l.pad, l.pad).zero_();
    }
  }
  // More threads than cores only add switches to a bandwidth-bound copy.
  const int64_t cores = std::max<int64_t>(std::thread::hardware_concurrency(), 1);
  const int64_t k = std::clamp<int64_t>(seg_bytes / kMinBytesPerThread, 1,
                                        std::min<int64_t>(std::max(num_threads, 1), cores));
  {
    std::vector<std::jthread> workers;  // joined on scope exit, also if a slow copy throws
    for (int64_t t = 1; t < k; ++t) {
      workers.emplace_back(
          [&, t] { run_segments(segs, seg_bytes * t / k, seg_bytes * (t + 1) / k); });
    }
    run_segments(segs, 0, seg_bytes / k);
    for (size_t i : slow) leaf_view(storage, *leaves[i]).copy_(srcs[i]);
  }
}

// Whether td still holds exactly the views that `m` describes. A level mutated through its own
// handle does not clear its parents' state, so the state alone is not proof.
bool views_match(const TensorDict& td, const Metadata& m, const at::Tensor& storage) {
  const auto& impl = TensorDictImpl::of(td);
  if (impl.entries.size() != m.leaves.size() + m.children.size() + m.non_tensors.size() ||
      impl.lazy.has_value() != m.is_lazy_stack()) {
    return false;
  }
  const auto* base = static_cast<const uint8_t*>(storage.const_data_ptr());
  for (const auto& [key, l] : m.leaves) {
    const Value* v = impl.find(key);
    if (!v || !v->is_tensor()) return false;
    const at::Tensor& t = v->tensor();
    if (t.scalar_type() != l.dtype || t.sizes() != at::IntArrayRef(l.shape)) return false;
    if (t.numel() > 0 && (!t.is_contiguous() || !t.storage().is_alias_of(storage.storage()) ||
                          static_cast<const uint8_t*>(t.const_data_ptr()) != base + l.start)) {
      return false;
    }
  }
  for (const auto& [key, child] : m.children) {
    const Value* v = impl.find(key);
    if (!v) return false;
    if (child.is_non_tensor_stack()) {
      if (!v->is_non_tensor() || !v->non_tensor().is_stack() ||
          stack_node(v->non_tensor(), child.cls_metadata.is_locked, std::nullopt) != child) {
        return false;
      }
    } else if (!v->is_tensordict() || !views_match(v->tensordict(), child, storage)) {
      return false;
    }
  }
  for (const auto& [key, nt] : m.non_tensors) {
    const Value* v = impl.find(key);
    if (!v || !v->is_non_tensor() || v->non_tensor().is_stack() ||
        v->non_tensor().is_metadata() != nt.metadata ||
        !core::json_identical(v->non_tensor().data(), nt.data)) {
      return false;
    }
  }
  return true;
}

// The levels of a consolidation, pre-order, with the generations they had when they were
// known to hold its views. Walking the metadata keeps nested levels that are not part of it
// (none, when td matches m) out.
struct CheckedLevels {
  struct Level {
    TensorDictImpl* impl;
    const Metadata* metadata;
    uint32_t begin, end;  // the level's subtree in `generations`
  };
  std::vector<Level> levels;
  std::shared_ptr<std::vector<uint64_t>> generations = std::make_shared<std::vector<uint64_t>>();

  void add(const TensorDict& td, const Metadata& m) {
    auto& impl = TensorDictImpl::of(td);
    impl.watched = true;
    const size_t i = levels.size();
    const auto begin = static_cast<uint32_t>(generations->size());
    levels.push_back({&impl, &m, begin, 0});
    generations->push_back(impl.generation);
    for (const auto& [key, child] : m.children) {
      if (!child.is_non_tensor_stack()) add(impl.find(key)->tensordict(), child);
    }
    levels[i].end = static_cast<uint32_t>(generations->size());
  }

  // Gives a level its state and its slice of the shared generations.
  void check(const Level& l, std::shared_ptr<const ConsolidatedState> state, uint64_t epoch) const {
    l.impl->consolidated = std::move(state);
    l.impl->checked_generations = generations;
    l.impl->checked_begin = l.begin;
    l.impl->checked_end = l.end;
    l.impl->checked_epoch.store(epoch, std::memory_order_relaxed);
  }
};

// Whether no level's entries changed since they were recorded. An unchanged level still holds
// the same nested levels, so walking them by key is safe.
bool generations_unchanged(const TensorDict& td, const Metadata& m, const uint64_t*& next,
                           const uint64_t* end) {
  const auto& impl = TensorDictImpl::of(td);
  if (next == end || *next++ != impl.generation) return false;
  for (const auto& [key, child] : m.children) {
    if (child.is_non_tensor_stack()) continue;  // a value of this level, which it would change
    if (!generations_unchanged(impl.find(key)->tensordict(), child, next, end)) return false;
  }
  return true;
}

uint64_t current_epoch() { return detail::watched_changes.load(std::memory_order_relaxed); }

// Gives td a consolidation whose views it is known to hold, remembering its generations.
void set_checked_state(const TensorDict& td, std::shared_ptr<const ConsolidatedState> state) {
  CheckedLevels levels;
  levels.add(td, *state->metadata);
  levels.check(levels.levels.front(), std::move(state), current_epoch());
}

// Whether no level's entries changed since td's consolidation was last known to match: at
// once when no watched level changed anywhere since, by walking the levels otherwise.
bool generations_current(const TensorDict& td, const Metadata& m) {
  const auto& impl = TensorDictImpl::of(td);
  if (!impl.checked_generations) return false;
  const uint64_t epoch = current_epoch();
  if (impl.checked_epoch.load(std::memory_order_relaxed) == epoch) return true;
  const uint64_t* next = impl.checked_generations->data() + impl.checked_begin;
  if (!generations_unchanged(td, m, next, impl.checked_generations->data() + impl.checked_end)) {
    return false;
  }
  impl.checked_epoch.store(epoch, std::memory_order_relaxed);  // the next call is O(1) again
  return true;
}

// Whether td's consolidation still describes its views: by the generations when no entry
// changed since it was checked, by visiting every leaf otherwise. Only changes made through
// the TensorDict are seen by the first; a leaf changed in place through its own handle
// (Tensor.set_, resize_, unsqueeze_, ...) is not, as the reference never sees it.
bool holds_consolidation(const TensorDict& td, const ConsolidatedState& state) {
  return generations_current(td, *state.metadata) ||
         views_match(td, *state.metadata, state.storage);
}

// Writes td's current batch sizes and devices into `out` (a copy of m), as the reference's
// _update_consolidated_metadata does before reusing a consolidation; with out == nullptr,
// only says whether anything differs.
bool refresh_metadata(const TensorDict& td, const Metadata& m, Metadata* out) {
  bool changed = false;
  const auto bs = td.batch_size();
  if (!std::equal(bs.begin(), bs.end(), m.cls_metadata.batch_size.begin(),
                  m.cls_metadata.batch_size.end())) {
    changed = true;
    if (out) {
      out->cls_metadata.batch_size.assign(bs.begin(), bs.end());
      out->cls_metadata.names.assign(bs.size(), std::nullopt);
    }
  }
  const auto& impl = TensorDictImpl::of(td);
  for (size_t i = 0; i < m.children.size(); ++i) {
    const Value* v = impl.find(m.children[i].first);
    if (v && v->is_tensordict()) {
      changed |= refresh_metadata(v->tensordict(), m.children[i].second,
                                  out ? &out->children[i].second : nullptr);
    }
  }
  return changed;
}

TensorDict consolidate_impl(const TensorDict& td, const ConsolidateOptions& o) {
  TORCH_CHECK_VALUE(o.num_threads >= 0, "consolidate: num_threads must be >= 0, got ",
                    o.num_threads);
  TORCH_CHECK_VALUE(!o.filename || !o.device || o.device->is_cpu(),
                    "device and filename are mutually exclusive arguments.");
  const at::Device device = o.device ? *o.device : td.device().value_or(at::Device(at::kCPU));
  const bool moved = o.device && td.device() && *td.device() != *o.device;
  Plan p = plan(td, moved ? o.device : std::nullopt);
  at::Tensor storage =
      o.filename ? file_storage(*o.filename, p) : allocate_storage(p.total, device, o);
  std::vector<const LeafMetadata*> leaves;
  leaves.reserve(p.srcs.size());
  leaves_in_td_order(td, p.metadata, leaves);
  copy_leaves(p.srcs, leaves, storage, o.num_threads);

  // The result mirrors td's entry order; its leaves are views of the storage.
  const auto build = [&](const auto& self, const TensorDict& src, const Metadata& m) -> TensorDict {
    if (src.is_lazy_stack()) {
      std::vector<TensorDict> members;
      size_t ci = 0;
      for (const auto& [key, value] : src.entries()) {
        members.push_back(self(self, value.tensordict(), m.children[ci++].second));
      }
      const auto& lazy = *TensorDictImpl::of(src).lazy;
      return TensorDictImpl::make_lazy(std::move(members), lazy.stack_dim, lazy.stack_dim_name);
    }
    auto dev = src.device();
    if (dev && moved) dev = device;
    auto bs = src.batch_size();
    TensorDict out = TensorDictImpl::make(std::vector<int64_t>(bs.begin(), bs.end()), dev);
    auto& impl = TensorDictImpl::of(out);
    size_t li = 0, ci = 0;
    for (const auto& [key, value] : src.entries()) {
      if (value.is_tensor()) {
        impl.put(key, leaf_view(storage, m.leaves[li++].second));
      } else if (value.is_non_tensor()) {
        const NonTensorData& nt = value.non_tensor();
        if (nt.is_stack()) ++ci;
        impl.put(key, moved && nt.device() ? nt.with_device(device) : nt);
      } else {
        impl.put(key, self(self, value.tensordict(), m.children[ci++].second));
      }
    }
    return out;
  };
  TensorDict result = build(build, td, p.metadata);
  result.lock_();
  set_checked_state(result, std::make_shared<const ConsolidatedState>(
                                storage, std::make_shared<const Metadata>(std::move(p.metadata))));
  return result;
}

TensorDict rebuild_node(const Metadata& m, const at::Tensor& storage, bool parent_locked) {
  const auto& cm = m.cls_metadata;
  const bool locked = cm.is_locked || parent_locked;
  if (m.is_lazy_stack()) {  // validated: members "0", "1", ... with one batch size
    std::vector<TensorDict> members;
    members.reserve(m.children.size());
    for (const auto& [key, child] : m.children)
      members.push_back(rebuild_node(child, storage, locked));
    TensorDict td = TensorDictImpl::make_lazy(std::move(members), cm.stack_dim, cm.stack_dim_name);
    TensorDictImpl::of(td).locked = locked;
    return td;
  }
  // The peer's device label is not trusted: the data lives where the storage is.
  TensorDict td = TensorDictImpl::make(
      cm.batch_size, cm.device ? std::optional<at::Device>(storage.device()) : std::nullopt);
  auto& impl = TensorDictImpl::of(td);
  impl.entries.reserve(m.non_tensors.size() + m.leaves.size() + m.children.size());
  // Non-tensor entries first, then leaves, then nested nodes: the reference's rebuild order.
  for (const auto& [key, nt] : m.non_tensors) {
    impl.put(key,
             NonTensorData(nt.data, nt.batch_size,
                           nt.device ? std::optional<at::Device>(storage.device()) : std::nullopt,
                           nt.metadata ? NonTensorKind::kMetaData : NonTensorKind::kData));
  }
  for (const auto& [key, leaf] : m.leaves) impl.put(key, leaf_view(storage, leaf));
  // A locked level locks the levels below, as lock_() would (without walking them again).
  for (const auto& [key, child] : m.children) {
    if (child.is_non_tensor_stack()) {
      impl.put(key, rebuild_stack(child, storage.device()));
    } else {
      impl.put(key, rebuild_node(child, storage, locked));
    }
  }
  impl.locked = locked;
  return td;
}

}  // namespace

TensorDict consolidate(const TensorDict& td, const ConsolidateOptions& options) {
  // A file is always written: the reference writes nothing for a TensorDict that is already
  // consolidated in memory (it warns), which is never what the call asks for.
  if (options.filename) return consolidate_impl(td, options);
  auto state = td.consolidated_state();
  const bool current = state && generations_current(td, *state->metadata);
  if (current || (state && views_match(td, *state->metadata, state->storage))) {
    // As the reference: a pinned copy is made only when asked for and possible.
    const bool repin = options.pin_memory && state->storage.is_cpu() &&
                       at::getAccelerator(false).has_value() && !state->storage.is_pinned();
    if (!repin) {
      if (refresh_metadata(td, *state->metadata, nullptr)) {
        auto fresh = std::make_shared<Metadata>(*state->metadata);
        refresh_metadata(td, *state->metadata, fresh.get());
        set_checked_state(
            td, std::make_shared<const ConsolidatedState>(state->storage, std::move(fresh)));
      } else if (!current) {
        set_checked_state(td, state);  // matched leaf by leaf: remember it
      }
      return td;
    }
  }
  return consolidate_impl(td, options);
}

const std::string& ConsolidatedState::sorted_json() const {
  std::call_once(sorted_json_once_, [this] { sorted_json_ = metadata_to_json(*metadata, true); });
  return sorted_json_;
}

bool is_consolidated(const TensorDict& td) {
  auto state = td.consolidated_state();
  return state && holds_consolidation(td, *state);
}

at::Tensor consolidated_storage(const TensorDict& td) {
  auto state = td.consolidated_state();
  TORCH_CHECK(state, "consolidated_storage: the TensorDict is not consolidated");
  return state->storage;
}

std::shared_ptr<const Metadata> consolidated_metadata(const TensorDict& td) {
  auto state = td.consolidated_state();
  TORCH_CHECK(state, "consolidated_metadata: the TensorDict is not consolidated");
  return state->metadata;
}

Metadata metadata_of(const TensorDict& td) { return plan(td).metadata; }

int64_t metadata_storage_bytes(const Metadata& metadata) {
  return validate(metadata, std::nullopt, 0);
}

namespace {

void check_storage_tensor(const at::Tensor& storage) {
  TORCH_CHECK_VALUE(storage.defined() && storage.scalar_type() == at::kByte && storage.dim() == 1 &&
                        (storage.numel() <= 1 || storage.stride(0) == 1),
                    "rebuild: the storage must be a 1-D contiguous uint8 tensor, got ",
                    storage.defined() ? storage.toString() : std::string("an undefined tensor"),
                    storage.defined()
                        ? c10::str(storage.sizes(), " with strides ", storage.strides())
                        : std::string());
}

// Every level of the result holds its node of the consolidation (is_consolidated() of a nested
// level is true, as after the reference's from_consolidated).
TensorDict rebuild_root(Metadata metadata, const at::Tensor& storage) {
  auto root = std::make_shared<const Metadata>(std::move(metadata));
  TensorDict td = rebuild_node(*root, storage, /*parent_locked=*/false);
  CheckedLevels levels;
  levels.add(td, *root);
  const uint64_t epoch = current_epoch();
  for (const auto& l : levels.levels) {
    levels.check(l,
                 std::make_shared<const ConsolidatedState>(
                     storage, std::shared_ptr<const Metadata>(root, l.metadata)),
                 epoch);
  }
  return td;
}

}  // namespace

TensorDict rebuild(Metadata metadata, const at::Tensor& storage) {
  check_storage_tensor(storage);
  validate(metadata, storage.numel(), storage.storage_offset());
  return rebuild_root(std::move(metadata), storage);
}

TensorDict from_consolidated(const std::string& filename, const FromConsolidatedOptions& options) {
  const auto fail = [&](const auto&... why) {
    // RuntimeError, as the reference fails on such files (it has no check of its own).
    TORCH_CHECK(false, "from_consolidated: ", filename, ": ", why...);
  };
  // Only a regular file (a FIFO or device would block or never end): checked on the open
  // descriptor, which is also the one mapped, so the checks and the mapping see one file.
  const int fd = ::open(filename.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TORCH_CHECK(fd >= 0, "from_consolidated: cannot open ", filename, ": ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  TORCH_CHECK(::fstat(fd, &st) == 0, "from_consolidated: cannot stat ", filename);
  if (!S_ISREG(st.st_mode)) fail("not a regular file");
  const auto size = static_cast<int64_t>(st.st_size);
  const auto read_at = [&](void* out, int64_t n, int64_t at) {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd, p, static_cast<size_t>(n), at);
      if (got <= 0) fail("the file changed or could not be read while it was read");
      p += got;
      n -= got;
      at += got;
    }
  };
  if (size < 8) fail("the file is ", size, " bytes, shorter than its 8-byte trailer");
  uint8_t trailer[8];
  read_at(trailer, 8, size - 8);
  const uint64_t json_bytes = core::get_le(trailer);
  if (json_bytes == 0 || json_bytes > static_cast<uint64_t>(size - 8)) {
    fail("its trailer announces ", static_cast<int64_t>(json_bytes),
         " bytes of metadata, but the file holds ", size - 8,
         " bytes before it (a truncated or foreign file)");
  }
  if (json_bytes > static_cast<uint64_t>(options.max_metadata_bytes)) {
    fail("its metadata is ", json_bytes, " bytes, beyond max_metadata_bytes (",
         options.max_metadata_bytes, ")");
  }
  const int64_t storage_bytes = size - 8 - static_cast<int64_t>(json_bytes);
  std::string json(json_bytes, '\0');
  read_at(json.data(), static_cast<int64_t>(json_bytes), storage_bytes);
  std::optional<core::ValidatedMetadata> metadata;
  try {
    metadata = core::read_metadata_json(json);
  } catch (const core::ValueBudgetError& e) {
    TORCH_CHECK_VALUE(false, "from_consolidated: ", filename, ": ", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());
  }
  if (metadata->storage_bytes() > storage_bytes) {
    fail("its metadata places leaves up to byte ", metadata->storage_bytes(), ", but only ",
         storage_bytes, " bytes come before the metadata");
  }
  // Copy-on-write, as the reference maps it: writes to the leaves do not reach the file.
  void* map =
      ::mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  TORCH_CHECK(map != MAP_FAILED, "from_consolidated: cannot map ", filename, ": ",
              std::strerror(errno));
  at::Tensor file = at::from_blob(
      map, {storage_bytes}, [size](void* p) { ::munmap(p, static_cast<size_t>(size)); },
      at::TensorOptions().dtype(at::kByte));
  return core::rebuild_validated(std::move(*metadata), file);
}

namespace core {

TensorDict rebuild_validated(ValidatedMetadata metadata, const at::Tensor& storage) {
  check_storage_tensor(storage);
  // validate() checked alignment for a storage starting at offset 0; an offset that is a
  // multiple of the largest element size (16) keeps it. Anything else is checked again.
  constexpr int64_t kMaxElementSize = 16;
  if (storage.numel() < metadata.storage_bytes() || storage.storage_offset() % kMaxElementSize) {
    return rebuild(std::move(metadata).take(), storage);
  }
  return rebuild_root(std::move(metadata).take(), storage);
}

}  // namespace core

}  // namespace tensordict

// Validation of metadata (core/metadata.h): what a layout must satisfy before any byte of a
// storage is viewed through it (docs/wire-format.md §3.1-3.3).

#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <array>
#include <unordered_set>

#include "core/excerpt.h"
#include "core/json_text.h"
#include "core/metadata.h"
#include "tensordict/dtypes.h"
#include "tensordict/nested_key.h"

namespace tensordict::core {
namespace {

// The reference's utils._TORCH_DTYPES: the dtypes whose names the metadata may carry.
constexpr std::array kWireDtypes{
    at::kBFloat16, at::kBool,  at::kComplexDouble, at::kComplexHalf, at::kComplexFloat,
    at::kHalf,     at::kFloat, at::kDouble,        at::kShort,       at::kInt,
    at::kLong,     at::kChar,  at::kQInt32,        at::kQInt8,       at::kQUInt4x2,
    at::kQUInt8,   at::kByte,  at::kUInt16,        at::kUInt32,      at::kUInt64,
};

std::string node_str(const std::vector<std::string>& path) {
  return path.empty() ? std::string("the root") : key_path_excerpt(path);
}

bool starts_with(at::IntArrayRef shape, at::IntArrayRef prefix) {
  return shape.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), shape.begin());
}

std::string nth_leaf_path(const Metadata& m, int64_t& n, std::vector<std::string>& path) {
  if (n < static_cast<int64_t>(m.leaves.size())) return path_str(path, m.leaves[n].first);
  n -= static_cast<int64_t>(m.leaves.size());
  for (const auto& [key, child] : m.children) {
    path.push_back(key);
    auto found = nth_leaf_path(child, n, path);
    path.pop_back();
    if (!found.empty()) return found;
  }
  return {};
}

struct Validator {
  const Metadata& root;
  std::optional<int64_t> storage_bytes;
  int64_t storage_offset = 0;
  int64_t entries = 0;
  int64_t max_stop = 0;
  int64_t leaf_index = 0;
  struct Range {
    int64_t start, stop, leaf;
  };
  std::vector<Range> ranges{};
  std::vector<std::string> path{};

  void node(const Metadata& m, at::IntArrayRef parent_batch, int depth) {
    const auto here = [&] { return node_str(path); };
    TORCH_CHECK_VALUE(depth <= kMaxMetadataDepth, "metadata: node ", here(),
                      " is nested deeper than ", kMaxMetadataDepth, " levels");
    // "module.qualname": a class reference (the reference's tensorclass node), rebuilt as a
    // TensorDict node; only metadata_from_pickle makes one.
    TORCH_CHECK_VALUE(m.cls == "TensorDict" || m.is_stack() || is_class_reference_name(m.cls),
                      "metadata: node ", here(), " has cls ", quoted_excerpt(m.cls),
                      "; only TensorDict, LazyStackedTensorDict and NonTensorStack nodes are "
                      "supported");
    entries += 1 + static_cast<int64_t>(m.leaves.size() + m.non_tensors.size());
    TORCH_CHECK_VALUE(entries <= kMaxMetadataEntries, "metadata: more than ", kMaxMetadataEntries,
                      " entries");
    const auto& cm = m.cls_metadata;
    const at::IntArrayRef batch(cm.batch_size);
    // A stack's batch size comes from its members: their checks say what is wrong first.
    if (m.is_lazy_stack()) lazy_stack(m, depth);
    if (m.is_non_tensor_stack()) non_tensor_stack(m, depth);
    for (int64_t d : batch) {
      TORCH_CHECK_VALUE(d >= 0, "metadata: node ", here(), " has a negative batch dim in ", batch);
    }
    TORCH_CHECK_VALUE(starts_with(batch, parent_batch), "metadata: node ", here(),
                      " has batch_size ", batch, ", which does not start with its parent's ",
                      parent_batch);
    TORCH_CHECK_VALUE(cm.names.size() == batch.size(), "metadata: node ", here(), " has ",
                      cm.names.size(), " names for ", batch.size(), " batch dims");
    if (m.is_stack()) return;
    TORCH_CHECK_VALUE(!cm.device || parse_device_name(*cm.device), "metadata: node ", here(),
                      " has device ", quoted_excerpt(*cm.device), ", which is not a device name");
    // Duplicate keys: a scan in the common small node, a hash set in a large one.
    const size_t n_keys = m.non_tensors.size() + m.leaves.size() + m.children.size();
    std::array<std::string_view, kScanKeys> few;
    size_t n_few = 0;
    std::unordered_set<std::string_view> many;
    if (n_keys > kScanKeys) many.reserve(n_keys);
    const auto unique = [&](const std::string& key) {
      bool fresh = true;
      if (n_keys <= kScanKeys) {
        fresh = std::find(few.begin(), few.begin() + n_few, key) == few.begin() + n_few;
        few[n_few++] = key;
      } else {
        fresh = many.insert(key).second;
      }
      TORCH_CHECK_VALUE(fresh, "metadata: key ", path_str(path, key), " appears twice");
    };
    for (const auto& [key, nt] : m.non_tensors) {
      unique(key);
      non_tensor(key, nt, batch);
    }
    for (const auto& [key, leaf_md] : m.leaves) {
      unique(key);
      leaf(key, leaf_md, batch);
    }
    for (const auto& [key, child] : m.children) {
      unique(key);
      TORCH_CHECK_VALUE(!is_reserved_node_key(key), "metadata: nested key ", path_str(path, key),
                        " collides with a field of the node");
      path.push_back(key);
      node(child, batch, depth + 1);
      path.pop_back();
    }
  }

  // A lazy stack's node: members "0", "1", ... sharing a batch size, nothing of its own.
  void lazy_stack(const Metadata& m, int depth) {
    const auto here = [&] { return node_str(path); };
    TORCH_CHECK_VALUE(m.leaves.empty() && m.non_tensors.empty(), "metadata: the lazy stack ",
                      here(), " has leaves or non-tensors of its own; its members hold them");
    TORCH_CHECK_VALUE(!m.children.empty(), "metadata: the lazy stack ", here(), " has no members");
    for (size_t i = 0; i < m.children.size(); ++i) {
      TORCH_CHECK_VALUE(m.children[i].first == std::to_string(i), "metadata: member ", i,
                        " of the lazy stack ", here(), " is keyed ",
                        quoted_excerpt(m.children[i].first), ", not '", i, "'");
      TORCH_CHECK_VALUE(!m.children[i].second.is_non_tensor_stack(), "metadata: member ", i,
                        " of the lazy stack ", here(), " is a NonTensorStack, not a TensorDict");
      TORCH_CHECK_VALUE(m.children[i].second.cls_metadata.batch_size ==
                            m.children[0].second.cls_metadata.batch_size,
                        "metadata: the members of the lazy stack ", here(),
                        " have different batch sizes, ",
                        at::IntArrayRef(m.children[0].second.cls_metadata.batch_size), " and ",
                        at::IntArrayRef(m.children[i].second.cls_metadata.batch_size));
    }
    stacked(m, "the lazy stack",
            static_cast<int64_t>(m.children[0].second.cls_metadata.batch_size.size()), depth);
  }

  // A NonTensorStack's node: members "0" ... "n-1", each a non-tensor entry or a NonTensorStack
  // node, sharing a batch size; no leaves.
  void non_tensor_stack(const Metadata& m, int depth) {
    const auto here = [&] { return node_str(path); };
    TORCH_CHECK_VALUE(m.leaves.empty(), "metadata: the NonTensorStack ", here(),
                      " has leaves; its members are non-tensor data");
    const size_t n = m.non_tensors.size() + m.children.size();
    std::vector<const std::vector<int64_t>*> member_batch(n, nullptr);
    const auto member = [&](const std::string& key, const std::vector<int64_t>& batch) {
      size_t i = n;
      if (!key.empty() && key.size() <= 10 &&
          key.find_first_not_of("0123456789") == std::string::npos &&
          (key == "0" || key[0] != '0')) {
        i = std::stoul(key);
      }
      TORCH_CHECK_VALUE(i < n, "metadata: the NonTensorStack ", here(), " has the member key ",
                        quoted_excerpt(key), "; its ", n, " members are keyed '0' to '", n - 1,
                        "'");
      TORCH_CHECK_VALUE(member_batch[i] == nullptr, "metadata: the NonTensorStack ", here(),
                        " has member ", i, " twice");
      member_batch[i] = &batch;
    };
    for (const auto& [key, nt] : m.non_tensors) {
      member(key, nt.batch_size);
      non_tensor(key, nt, {});
    }
    for (const auto& [key, child] : m.children) {
      TORCH_CHECK_VALUE(child.is_non_tensor_stack(), "metadata: member ", quoted_excerpt(key),
                        " of the NonTensorStack ", here(), " is a ", excerpt(child.cls),
                        " node; a member is a non-tensor entry or a NonTensorStack");
      member(key, child.cls_metadata.batch_size);
    }
    for (size_t i = 1; i < n; ++i) {
      TORCH_CHECK_VALUE(*member_batch[i] == *member_batch[0],
                        "metadata: the members of the "
                        "NonTensorStack ",
                        here(), " have different batch sizes, ", at::IntArrayRef(*member_batch[0]),
                        " and ", at::IntArrayRef(*member_batch[i]));
    }
    stacked(m, "the NonTensorStack", n ? static_cast<int64_t>(member_batch[0]->size()) : 0, depth);
  }

  // What a stack's node (`what`: "the lazy stack") must be beside its members, which have
  // `member_dims` batch dims each: a stack dim among them, and their batch size with it; then
  // the members themselves.
  void stacked(const Metadata& m, const char* what, int64_t member_dims, int depth) {
    const auto here = [&] { return node_str(path); };
    TORCH_CHECK_VALUE(m.cls_metadata.stack_dim >= 0 && m.cls_metadata.stack_dim <= member_dims,
                      "metadata: ", what, " ", here(), " has stack_dim ", m.cls_metadata.stack_dim,
                      " for members with ", member_dims, " batch dims");
    TORCH_CHECK_VALUE(stack_batch_size(m) == m.cls_metadata.batch_size, "metadata: ", what, " ",
                      here(), " has batch_size ", at::IntArrayRef(m.cls_metadata.batch_size),
                      ", which is not its members' with the stack dim");
    for (const auto& [key, child] : m.children) {
      path.push_back(key);
      node(child, {}, depth + 1);  // the members' batch sizes were checked above
      path.pop_back();
    }
  }

  void non_tensor(const std::string& key, const NonTensorMetadata& nt, at::IntArrayRef batch) {
    const at::IntArrayRef bs(nt.batch_size);
    for (int64_t d : bs) {
      TORCH_CHECK_VALUE(d >= 0, "metadata: non-tensor entry ", path_str(path, key),
                        " has a negative dim in its batch_size ", bs);
    }
    TORCH_CHECK_VALUE(starts_with(bs, batch), "metadata: non-tensor entry ", path_str(path, key),
                      " has batch_size ", bs, ", which does not start with the batch size ", batch);
    TORCH_CHECK_VALUE(!nt.device || parse_device_name(*nt.device), "metadata: non-tensor entry ",
                      path_str(path, key), " has device ", quoted_excerpt(*nt.device),
                      ", which is not a device name");
  }

  void leaf(const std::string& key, const LeafMetadata& l, at::IntArrayRef batch) {
    const auto where = [&] { return path_str(path, key); };
    check_leaf_dtype(l.dtype, "metadata", where);
    int64_t numel = 1;
    for (int64_t d : l.shape) {
      TORCH_CHECK_VALUE(d >= 0, "metadata: leaf ", where(), " has a negative dim in shape ",
                        at::IntArrayRef(l.shape));
      TORCH_CHECK_VALUE(!c10::mul_overflows(numel, d, &numel), "metadata: leaf ", where(),
                        " has a shape whose size overflows: ", at::IntArrayRef(l.shape));
    }
    const int64_t esize = static_cast<int64_t>(c10::elementSize(l.dtype));
    int64_t nbytes = 0;
    TORCH_CHECK_VALUE(!c10::mul_overflows(numel, esize, &nbytes), "metadata: leaf ", where(),
                      " has a shape whose byte size overflows: ", at::IntArrayRef(l.shape));
    TORCH_CHECK_VALUE(starts_with(l.shape, batch), "metadata: leaf ", where(), " has shape ",
                      at::IntArrayRef(l.shape), ", which does not start with the batch size ",
                      batch);
    TORCH_CHECK_VALUE(
        l.start >= 0 && l.start % kLeafAlign == 0 && l.stop >= l.start && l.stop % kLeafAlign == 0,
        "metadata: leaf ", where(), " has the byte range [", l.start, ", ", l.stop,
        "); start and stop must be multiples of 8 with 0 <= start <= stop");
    TORCH_CHECK_VALUE(l.pad >= 0 && l.pad < kLeafAlign && l.stop - l.start - l.pad == nbytes,
                      "metadata: leaf ", where(), " is ", dtype_name(l.dtype),
                      at::IntArrayRef(l.shape), " (", nbytes, " bytes) but its range [", l.start,
                      ", ", l.stop, ") with pad ", l.pad, " holds ", l.stop - l.start - l.pad);
    TORCH_CHECK_VALUE(!storage_bytes || l.stop <= *storage_bytes, "metadata: leaf ", where(),
                      " ends at byte ", l.stop, ", past the end of the ", *storage_bytes,
                      "-byte storage");
    TORCH_CHECK_VALUE(numel == 0 || (storage_offset + l.start) % esize == 0, "metadata: leaf ",
                      where(), " starts at byte ", storage_offset + l.start,
                      " of its storage, which is not a multiple of the ", esize,
                      "-byte element size of ", dtype_name(l.dtype));
    if (l.stop > l.start) ranges.push_back({l.start, l.stop, leaf_index});
    max_stop = std::max(max_stop, l.stop);
    ++leaf_index;
  }

  void check_overlaps() {
    // Depth-first order is already sorted for the reference's layouts: sort only if needed.
    const auto by_start = [](const Range& a, const Range& b) { return a.start < b.start; };
    if (!std::is_sorted(ranges.begin(), ranges.end(), by_start)) {
      std::sort(ranges.begin(), ranges.end(), by_start);
    }
    for (size_t i = 1; i < ranges.size(); ++i) {
      const auto& a = ranges[i - 1];
      const auto& b = ranges[i];
      if (b.start >= a.stop) continue;
      const auto name = [&](int64_t n) {
        std::vector<std::string> p;
        return nth_leaf_path(root, n, p);
      };
      TORCH_CHECK_VALUE(false, "metadata: leaves ", name(a.leaf), " [", a.start, ", ", a.stop,
                        ") and ", name(b.leaf), " [", b.start, ", ", b.stop, ") overlap");
    }
  }
};

}  // namespace

std::optional<std::vector<int64_t>> stack_batch_size(const Metadata& m) {
  std::vector<int64_t> bs;
  size_t n = m.children.size();
  if (m.is_lazy_stack()) {
    if (m.children.empty()) return std::nullopt;
    bs = m.children[0].second.cls_metadata.batch_size;
  } else if (m.is_non_tensor_stack()) {
    n += m.non_tensors.size();
    if (n == 0)
      return m.cls_metadata.stack_dim == 0 ? std::optional(std::vector<int64_t>{0}) : std::nullopt;
    // Member "0"'s (validation checks that every member has it).
    bool found = false;
    for (const auto& [key, nt] : m.non_tensors) {
      if (key == "0") bs = nt.batch_size, found = true;
    }
    for (const auto& [key, child] : m.children) {
      if (key == "0") bs = child.cls_metadata.batch_size, found = true;
    }
    if (!found) return std::nullopt;
  } else {
    return std::nullopt;
  }
  const int64_t d = m.cls_metadata.stack_dim;
  if (d < 0 || d > static_cast<int64_t>(bs.size())) return std::nullopt;
  bs.insert(bs.begin() + d, static_cast<int64_t>(n));
  return bs;
}

int64_t validate(const Metadata& m, std::optional<int64_t> storage_bytes, int64_t storage_offset) {
  TORCH_CHECK_VALUE(!m.is_non_tensor_stack(),
                    "metadata: the root is a NonTensorStack; only a "
                    "TensorDict or a LazyStackedTensorDict can be the root of a transfer");
  Validator v{m, storage_bytes, storage_offset};
  v.node(m, {}, 0);
  v.check_overlaps();
  return v.max_stop;
}

bool valid_dotted_name(std::string_view name) {
  bool start = true;  // at the start of a component
  for (const char c : name) {
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (c == '.') {
      if (start) return false;  // empty component
      start = true;
    } else if (alpha || (digit && !start)) {
      start = false;
    } else {
      return false;
    }
  }
  return !start;  // non-empty, no trailing dot
}

std::optional<at::Device> parse_device_name(std::string_view name) {
  if (name.size() > kExcerptBytes) return std::nullopt;  // "privateuseone:N" is the longest
  try {
    return at::Device(std::string(name));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool is_wire_dtype(at::ScalarType t) {
  return std::find(kWireDtypes.begin(), kWireDtypes.end(), t) != kWireDtypes.end();
}

std::string path_str(const std::vector<std::string>& path, const std::string& key) {
  return key_path_excerpt(path, key);
}

ValidatedMetadata validated(Metadata metadata, TransportFields transport) {
  ValidatedMetadata out;
  out.storage_bytes_ = validate(metadata);
  out.metadata_ = std::move(metadata);
  out.transport_ = std::move(transport);
  return out;
}

}  // namespace tensordict::core

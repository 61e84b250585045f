#include "tensordict/distributed/collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "remote.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/errors.h"
#include "tensordict/leaf.h"
#include "tensordict/nested_key.h"
#include "wire/metadata_pickle.h"

namespace tensordict::dist {
namespace {

using detail::Incoming;

// Runs count collectives: posted one after another and waited in turn (async_op=False, as the
// reference calls them), or all posted and then waited on together.
template <typename Post>
void run_each(const detail::Waiter& w, size_t count, bool async_op, Post&& post) {
  const auto leaf = [](size_t i) { return c10::str("leaf ", i, " in insertion order"); };
  if (async_op) {
    w.wait(detail::post_all(count, post), leaf);
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    w.wait(post(i), leaf(i));
  }
}

// Depth-first insertion order: consolidate's order, and all_reduce's in the reference.
void insertion_leaves(const TensorDict& td, std::vector<at::Tensor>& out) {
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensor()) {
      out.push_back(value.tensor());
    } else if (value.is_tensordict()) {  // non-tensor entries are skipped, as in the reference
      insertion_leaves(value.tensordict(), out);
    }
  }
}

bool supports_complex(const c10d::ReduceOp& op) {
  return op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG || op == c10d::ReduceOp::PREMUL_SUM;
}

// One leaf's allreduce; complex leaves travel as their real view, as torch.distributed does.
struct AllReducer {
  const std::vector<at::Tensor>& leaves;
  Group group;
  c10d::ReduceOp op;
  WorkPtr operator()(size_t i) const {
    return detail::post_in_place(leaves[i], /*reads_leaf=*/true, [&](const at::Tensor& t) {
      std::vector<at::Tensor> one{t.is_complex() ? at::view_as_real(t) : t};
      return group.allreduce(one, op);
    });
  }
};

void check_layout(const char* call, const Group& group, const std::vector<at::Tensor>& leaves,
                  std::optional<int64_t> bucket_bytes,
                  std::optional<std::chrono::milliseconds> timeout);

std::vector<at::Tensor> all_reduce_leaves(const TensorDict& td, const AllReduceOptions& o) {
  std::vector<at::Tensor> leaves;
  insertion_leaves(td, leaves);
  detail::check_leaves("all_reduce", td, leaves);
  for (const auto& leaf : leaves) {
    detail::check_writable("all_reduce", leaf, "reduce into", "reducing rank");
    TORCH_CHECK_VALUE(!leaf.is_complex() || supports_complex(o.op),
                      "all_reduce does not support this op on complex tensors");
  }
  if (o.check_buckets) {
    check_layout("all_reduce", detail::resolve_group(o.group), leaves, o.bucket_bytes, o.timeout);
  }
  // Gloo (or a bucket's memcpy) writes the leaves behind autograd's back.
  for (const auto& leaf : leaves) mark_written(leaf);
  return leaves;
}

// reduce's leaves in the reference's order: each level's keys sorted; a lazy stack's common
// keys, each leaf stacked from the members (LazyStackedTensorDict._reduce): that copy is
// reduced, and at dst written back into the members (`lazy` and `key` say where).
struct ReduceLeaf {
  std::vector<std::string> path;
  at::Tensor leaf;
  std::optional<TensorDict> lazy;
  std::string key;
};

void reduce_order(const TensorDict& td, std::vector<std::string>& path,
                  std::vector<ReduceLeaf>& out) {
  for (const auto& key : td.sorted_keys()) {
    const Value v = td.get(key);
    path.push_back(key);
    if (v.is_tensor()) {
      out.push_back({path, v.tensor(), td.is_lazy_stack() ? std::optional(td) : std::nullopt, key});
    } else if (v.is_tensordict()) {
      reduce_order(v.tensordict(), path, out);
    }  // non-tensor entries are skipped, as in the reference
    path.pop_back();
  }
}

struct Reducer {
  std::vector<ReduceLeaf> leaves;
  Group group;
  c10d::ReduceOp op;
  int root = 0;  // the destination's group rank
  bool is_dst = false;
  // With `callbacks`, a stacked leaf is written back when its reduction completes (the
  // reference's future.then); without, write_back() does it after the waits.
  bool callbacks = false;
  WorkPtr operator()(size_t i) const {
    WorkPtr work =
        detail::post_in_place(leaves[i].leaf, /*reads_leaf=*/true, [&](const at::Tensor& t) {
          std::vector<at::Tensor> one{t};
          return group.reduce(one, op, root);
        });
    if (callbacks && is_dst && leaves[i].lazy) {
      const ReduceLeaf l = leaves[i];
      work->getFuture()->addCallback(
          [l](c10::ivalue::Future&) { TensorDict(*l.lazy).set_(l.key, l.leaf); });
    }
    return work;
  }
  void write_back() const {
    if (!is_dst) return;
    for (const auto& l : leaves) {
      if (l.lazy) TensorDict(*l.lazy).set_(l.key, l.leaf);
    }
  }
};

// Keeps `group` for every leaf, nested ones included (the reference drops it below the root).
Reducer make_reducer(const TensorDict& td, std::optional<int64_t> dst, const ReduceOptions& o) {
  const auto root = detail::resolve_peer("reduce", dst, o.group_dst, o.group, "dst", "group_dst",
                                         /*refuse_self=*/false);
  Reducer r{{}, root.group, o.op, root.rank};
  r.is_dst = root.group.rank() == root.rank;
  std::vector<std::string> path;
  reduce_order(td, path, r.leaves);
  for (const auto& l : r.leaves) {
    check_transferable("reduce", NestedKey(l.path).str(), l.leaf);
    if (!l.lazy) detail::check_writable("reduce", l.leaf, "reduce into", "reducing rank");
  }
  if (o.check_buckets) {
    std::vector<at::Tensor> leaves;
    for (const auto& l : r.leaves) leaves.push_back(l.leaf);
    check_layout("reduce", r.group, leaves, o.bucket_bytes, o.timeout);
  }
  // Every rank's leaves are written (the others' hold Gloo's partial results); a lazy stack's
  // stacked copy is written back into its members with set_, which marks them itself.
  for (const auto& l : r.leaves) mark_written(l.leaf);
  return r;
}

// ---- bucket_bytes (the reference's _bucketed_collective, docs/wire-format.md §5.8) ----------

// The buckets of `leaves`, as indices in leaf order: each leaf that is not a contiguous strided
// tensor alone, first; then the others grouped by device and dtype, groups in order of first
// appearance, each packed greedily into buckets of at most bucket_bytes (a larger leaf alone).
std::vector<std::vector<size_t>> make_buckets(const std::vector<at::Tensor>& leaves,
                                              int64_t bucket_bytes) {
  TORCH_CHECK_VALUE(bucket_bytes > 0, "bucket_bytes must be a positive number of bytes, got ",
                    bucket_bytes, ".");
  std::vector<std::vector<size_t>> buckets;
  std::vector<std::pair<std::pair<at::Device, at::ScalarType>, std::vector<size_t>>> groups;
  for (size_t i = 0; i < leaves.size(); ++i) {
    const at::Tensor& t = leaves[i];
    if (t.layout() != at::kStrided || !t.is_contiguous()) {
      buckets.push_back({i});
      continue;
    }
    const auto kind = std::make_pair(t.device(), t.scalar_type());
    auto g =
        std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == kind; });
    if (g == groups.end()) g = groups.insert(groups.end(), {kind, {}});
    g->second.push_back(i);
  }
  for (const auto& [kind, members] : groups) {
    std::vector<size_t> bucket;
    int64_t size = 0;
    for (size_t i : members) {
      const int64_t n = static_cast<int64_t>(leaves[i].nbytes());
      if (!bucket.empty() && size + n > bucket_bytes) {
        buckets.push_back(std::move(bucket));
        bucket.clear();
        size = 0;
      }
      bucket.push_back(i);
      size += n;
    }
    if (!bucket.empty()) buckets.push_back(std::move(bucket));
  }
  return buckets;
}

// Posts one collective per bucket: a bucket of one leaf through post_leaf(i) (the leaf itself,
// as without buckets), a larger one on the flat concatenation of its leaves through
// post_flat(flat). A flat bucket's values go back into its leaves when copy_back (after the
// bucket's work, in the work's wait()), then `after` runs (the lazy write back of reduce).
template <typename PostLeaf, typename PostFlat>
std::vector<WorkPtr> post_buckets(const std::vector<at::Tensor>& leaves, int64_t bucket_bytes,
                                  bool copy_back, const std::function<void(size_t)>& after,
                                  PostLeaf&& post_leaf, PostFlat&& post_flat) {
  const auto buckets = make_buckets(leaves, bucket_bytes);
  return detail::post_all(buckets.size(), [&](size_t b) -> WorkPtr {
    const auto& members = buckets[b];
    if (members.size() == 1) return post_leaf(members[0]);
    // A bucket's leaves share a device and dtype and are contiguous (make_buckets): on the CPU
    // they are packed and unpacked with memcpy, as at::cat and a copy_ per leaf cost
    // microseconds each (all_reduce of 1000 leaves of 64 B in benchmarks/run: 11 ms, now 3).
    const bool cpu =
        leaves[members[0]].is_cpu() && std::none_of(members.begin(), members.end(), [&](size_t i) {
          return leaves[i].is_conj() || leaves[i].is_neg();  // lazy bits: torch's copy
        });
    at::Tensor flat;
    {
      at::NoGradGuard no_grad;
      if (cpu) {
        int64_t numel = 0;
        for (size_t i : members) numel += leaves[i].numel();
        flat = at::empty({numel}, leaves[members[0]].options().requires_grad(false));
        auto* out = static_cast<char*>(flat.data_ptr());
        for (size_t i : members) {
          std::memcpy(out, leaves[i].const_data_ptr(), leaves[i].nbytes());
          out += leaves[i].nbytes();
        }
      } else {
        std::vector<at::Tensor> parts;
        for (size_t i : members) parts.push_back(leaves[i].reshape(-1));
        flat = at::cat(parts);
      }
    }
    WorkPtr work = post_flat(flat);
    if (!copy_back && !after) return work;
    return detail::then(
        {std::move(work)},
        [flat, members, leaves, copy_back, after, cpu] {
          if (copy_back && cpu) {
            const auto* in = static_cast<const char*>(flat.const_data_ptr());
            for (size_t i : members) {
              std::memcpy(leaves[i].data_ptr(), in, leaves[i].nbytes());
              in += leaves[i].nbytes();
            }
          } else if (copy_back) {
            int64_t at = 0;
            for (size_t i : members) {
              const at::Tensor& leaf = leaves[i];
              at::Tensor(leaf).copy_(flat.narrow(0, at, leaf.numel()).view(leaf.sizes()));
              at += leaf.numel();
            }
          }
          if (after) {
            for (size_t i : members) after(i);
          }
        },
        {flat});
  });
}

// ---- check_buckets: the ranks' layouts compared before any bucket is posted ----------------

// The collectives `leaves` make with `bucket_bytes` (each leaf alone without it), hashed: for
// each in posting order, its dtype and its leaves' element counts (64-bit FNV-1a).
uint64_t layout_hash(const std::vector<at::Tensor>& leaves,
                     const std::vector<std::vector<size_t>>& buckets) {
  uint64_t h = 0xcbf29ce484222325ULL;
  const auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 0x100000001b3ULL;
  };
  mix(buckets.size());
  for (const auto& bucket : buckets) {
    mix(bucket.size());
    mix(static_cast<uint64_t>(leaves[bucket.front()].scalar_type()));
    for (size_t i : bucket) mix(static_cast<uint64_t>(leaves[i].numel()));
  }
  return h;
}

void check_layout(const char* call, const Group& group, const std::vector<at::Tensor>& leaves,
                  std::optional<int64_t> bucket_bytes,
                  std::optional<std::chrono::milliseconds> timeout) {
  std::vector<std::vector<size_t>> buckets;
  if (bucket_bytes) {
    buckets = make_buckets(leaves, *bucket_bytes);
  } else {
    for (size_t i = 0; i < leaves.size(); ++i) buckets.push_back({i});
  }
  const detail::Waiter w(call, timeout, "the group", /*keeps_group=*/false);
  const int size = group.size();
  std::vector<at::Tensor> mine{
      at::tensor({static_cast<int64_t>(layout_hash(leaves, buckets)), bucket_bytes.value_or(0),
                  static_cast<int64_t>(buckets.size())},
                 at::kLong)};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < size; ++r) all[0].push_back(at::empty({3}, at::kLong));
  w.wait(group.allgather(all, mine), "the bucket layouts (check_buckets)");
  const auto* first = all[0][0].const_data_ptr<int64_t>();
  bool same = true;
  for (int r = 1; r < size; ++r) same = same && all[0][r].const_data_ptr<int64_t>()[0] == first[0];
  if (same) return;
  // Every rank gathered the same rows, so every rank raises the same error.
  std::string ranks;
  for (int r = 0; r < size; ++r) {
    const auto* row = all[0][r].const_data_ptr<int64_t>();
    ranks += c10::str(r == 0 ? "" : "; ", "rank ", r,
                      ": bucket_bytes = ", row[1] == 0 ? std::string("None") : c10::str(row[1]),
                      ", ", row[2], row[2] == 1 ? " collective" : " collectives");
  }
  TORCH_CHECK_VALUE(false, call,
                    "(check_buckets=True): the ranks' buckets differ, so their "
                    "collectives would not match and Gloo would abort a rank (",
                    ranks,
                    "). Every rank must pass the same bucket_bytes and hold the same leaves "
                    "(keys, order, shapes and dtypes)");
}

std::vector<WorkPtr> all_reduce_buckets(const TensorDict& td, const AllReduceOptions& o) {
  const auto leaves = all_reduce_leaves(td, o);
  AllReducer post{leaves, detail::resolve_group(o.group), o.op};
  return post_buckets(
      leaves, *o.bucket_bytes, /*copy_back=*/true, nullptr, post, [&](const at::Tensor& flat) {
        std::vector<at::Tensor> one{flat.is_complex() ? at::view_as_real(flat) : flat};
        return post.group.allreduce(one, post.op);
      });
}

// reduce's buckets: only the destination takes the values back (the others' leaves keep
// theirs, as the reference's), and writes a lazy stack's stacked leaf back into its members.
std::vector<WorkPtr> reduce_buckets(const Reducer& r, int64_t bucket_bytes) {
  std::vector<at::Tensor> leaves;
  for (const auto& l : r.leaves) leaves.push_back(l.leaf);
  std::function<void(size_t)> after;
  if (r.is_dst && r.callbacks) {
    after = [&r](size_t i) {
      const ReduceLeaf& l = r.leaves[i];
      if (l.lazy) TensorDict(*l.lazy).set_(l.key, l.leaf);
    };
  }
  return post_buckets(leaves, bucket_bytes, r.is_dst, after, r, [&](const at::Tensor& flat) {
    std::vector<at::Tensor> one{flat};
    return r.group.reduce(one, r.op, r.root);
  });
}

std::string describe(const char* call, int group_rank) {
  return c10::str(call, " (from group rank ", group_rank, ")");
}

// A gather of `size` buffers of `longest` bytes costs the receiving rank twice their bytes
// (ProcessGroupGloo gathers into one flat tensor, then copies each rank's part out): checked
// against the call's budget before anything is allocated, on every rank alike, so that a
// header's size alone cannot make a rank spend more than max_total_bytes.
void check_call_budget(const char* call, int size, int64_t longest, int64_t max_total_bytes) {
  const int64_t budget_each = max_total_bytes / 2 / size;
  TD_CHECK_PEER(longest <= budget_each, call, ": the ranks announce buffers of up to ", longest,
                " bytes; receiving ", size, " of them takes 2 x ", size, " x ", longest,
                " bytes (Gloo's flat buffer and ours), above this call's budget of max_total_bytes"
                " = ",
                max_total_bytes, " bytes; raise max_total_bytes to receive them");
}

}  // namespace

TensorDict broadcast(const TensorDict& td, std::optional<int64_t> src,
                     const BroadcastOptions& options,
                     std::optional<std::string>* tensorclass_type) {
  constexpr const char* kCall = "broadcast";
  const auto root = detail::resolve_peer(kCall, src, options.group_src, options.group, "src",
                                         "group_src", /*refuse_self=*/false);
  const detail::Waiter w(kCall, options.timeout,
                         c10::str("the group (source rank ", root.rank, ")"),
                         /*keeps_group=*/false);
  if (root.group.rank() == root.rank) {
    TensorDict c = detail::consolidated(td, options.device);
    std::vector<at::Tensor> storage{consolidated_storage(c)};
    TransportFields fields{{"_total_bytes", storage[0].numel()},
                           {"_storage_device", storage[0].device().str()}};
    if (options.tensorclass_type) {
      fields.emplace_back("_tensorclass_type", *options.tensorclass_type);
    }
    const std::string pickle = detail::metadata_pickle(c, fields);
    detail::broadcast_object(w, root, &pickle);
    w.wait(root.group.broadcast(storage, root.rank), "the storage");
    if (tensorclass_type != nullptr) *tensorclass_type = options.tensorclass_type;
    return c;
  }
  const int64_t max_total_bytes = detail::resolve_max_total_bytes(kCall, options.max_total_bytes);
  const std::string from = describe(kCall, root.rank);
  const std::string pickle = detail::broadcast_object(w, root, nullptr);
  Incoming in = detail::parse_incoming(from, pickle, max_total_bytes, /*padded=*/false);
  const int64_t n = detail::transfer_bytes(in, /*padded=*/false);
  auto buffer = detail::storage_buffer(in, n, detail::receive_device(from, options.device, in));
  std::vector<at::Tensor> storage{buffer.bytes};
  w.wait(root.group.broadcast(storage, root.rank), c10::str("the storage of ", n, " bytes"));
  TensorDict out = detail::finish(in, buffer);
  if (tensorclass_type != nullptr) *tensorclass_type = in.tensorclass_type;
  return out;
}

std::vector<TensorDict> all_gather(const TensorDict& td, const AllGatherOptions& options) {
  constexpr const char* kCall = "all_gather";
  const Group group = detail::resolve_group(options.group);
  const int size = group.size();
  const int64_t max_total_bytes = detail::resolve_max_total_bytes(kCall, options.max_total_bytes);
  const detail::Waiter w(kCall, options.timeout, "the group", /*keeps_group=*/false);
  TensorDict c = detail::consolidated(td, std::nullopt);
  const at::Tensor storage = consolidated_storage(c);
  const auto pickles = detail::all_gather_objects(
      w, group, detail::metadata_pickle(c, {{"_total_bytes", storage.numel()}}));
  std::vector<Incoming> incoming;
  int64_t longest = 0;
  for (int r = 0; r < size; ++r) {
    incoming.push_back(
        detail::parse_incoming(describe(kCall, r), pickles[r], max_total_bytes, /*padded=*/false));
  }
  // Every rank parses the same pickles, so an unknown size stops every rank here alike.
  for (const auto& in : incoming) {
    longest = std::max(longest, detail::transfer_bytes(in, /*padded=*/false));
  }
  check_call_budget(kCall, size, longest, max_total_bytes);
  std::vector<at::Tensor> padded{detail::byte_buffer(longest, storage.device())};
  padded[0].narrow(0, 0, storage.numel()).copy_(storage);
  padded[0].narrow(0, storage.numel(), longest - storage.numel()).zero_();  // no old memory sent
  std::vector<detail::StorageBuffer> buffers;
  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int r = 0; r < size; ++r) {
    buffers.push_back(detail::storage_buffer(incoming[r], longest, storage.device()));
    gathered[0].push_back(buffers.back().bytes);
  }
  w.wait(group.allgather(gathered, padded), c10::str("the storages, ", longest, " bytes each"));
  std::vector<TensorDict> out;
  for (int r = 0; r < size; ++r) {
    out.push_back(detail::finish(incoming[r], buffers[r]));
  }
  return out;
}

std::optional<TensorDict> gather_and_stack(const TensorDict& td, std::optional<int64_t> dst,
                                           const GatherAndStackOptions& options) {
  constexpr const char* kCall = "gather_and_stack";
  // The reference's header kinds (docs/wire-format.md §5.6).
  constexpr int64_t kNothing = 0, kPickle = 1, kStorage = 2;
  const auto root = detail::resolve_peer(kCall, dst, options.group_dst, options.group, "dst",
                                         "group_dst", /*refuse_self=*/false);
  const int64_t max_total_bytes = detail::resolve_max_total_bytes(kCall, options.max_total_bytes);
  const detail::Waiter w(kCall, options.timeout,
                         c10::str("the group (destination rank ", root.rank, ")"),
                         /*keeps_group=*/false);
  const int me = root.group.rank(), size = root.group.size();
  const bool is_dst = me == root.rank;

  at::Tensor storage;
  std::string pickle;
  if (!is_dst) {
    TensorDict c = detail::consolidated(td, std::nullopt);
    storage = consolidated_storage(c);
    TORCH_CHECK_VALUE(storage.is_cpu(), kCall,
                      ": Gloo gathers CPU tensors; this rank's storage is on ", storage.device());
    pickle = detail::metadata_pickle(c, {});  // the reference reads no transport field here
  }
  const int64_t storage_bytes = is_dst ? 0 : storage.numel();
  const int64_t buffer_bytes = storage_bytes + static_cast<int64_t>(pickle.size());
  std::vector<at::Tensor> header{
      at::tensor({is_dst ? kNothing : kStorage, storage_bytes, buffer_bytes}, at::kLong)};
  std::vector<std::vector<at::Tensor>> headers(1);
  for (int r = 0; r < size; ++r) headers[0].push_back(at::empty({3}, at::kLong));
  w.wait(root.group.allgather(headers, header), "the headers");

  // Every rank checks every header the same way, so that all refuse before the gather.
  int64_t longest = 0;
  for (int r = 0; r < size; ++r) {
    const auto* h = headers[0][r].const_data_ptr<int64_t>();
    const std::string who = describe(kCall, r);
    if (r == root.rank) {
      TD_CHECK_PEER(h[2] == 0, who, ": the destination announces ", h[2], " bytes to send");
      continue;
    }
    TD_CHECK_PEER(h[0] != kPickle, who,
                  " sent a pickled TensorDict (it could not consolidate "
                  "it); pickles of objects are never loaded here");
    TD_CHECK_PEER(h[0] == kStorage, who, ": unknown header kind ", h[0]);
    TD_CHECK_PEER(h[1] >= 0 && h[1] <= max_total_bytes, who, ": a storage of ", h[1],
                  " bytes, outside [0, max_total_bytes = ", max_total_bytes, "]");
    TD_CHECK_PEER(h[2] > h[1] && h[2] - h[1] <= static_cast<int64_t>(kMaxMetadataJsonBytes), who,
                  ": a metadata pickle of ", h[2] - h[1], " bytes, outside [1, ",
                  kMaxMetadataJsonBytes, "]");
    longest = std::max(longest, h[2]);
  }
  check_call_budget(kCall, size, longest, max_total_bytes);
  // Nothing is zero-filled ahead: pages are committed as the ranks' bytes land in them. Only
  // a sender's padding is cleared, so that no old memory of ours travels.
  std::vector<at::Tensor> mine{detail::byte_buffer(longest, at::kCPU)};
  if (!is_dst) {
    auto* out = mine[0].data_ptr<uint8_t>();
    std::memcpy(out, storage.const_data_ptr(), static_cast<size_t>(storage_bytes));
    std::memcpy(out + storage_bytes, pickle.data(), pickle.size());
    std::memset(out + buffer_bytes, 0, static_cast<size_t>(longest - buffer_bytes));
  }
  std::vector<std::vector<at::Tensor>> gathered(is_dst ? 1 : 0);
  if (is_dst) {
    for (int r = 0; r < size; ++r) gathered[0].push_back(detail::byte_buffer(longest, at::kCPU));
  }
  w.wait(root.group.gather(gathered, mine, root.rank),
         c10::str("the buffers, ", longest, " bytes each"));
  if (!is_dst) return std::nullopt;

  std::vector<TensorDict> rows;
  for (int r = 0; r < size; ++r) {
    if (r == root.rank) continue;
    const auto* h = headers[0][r].const_data_ptr<int64_t>();
    const at::Tensor& got = gathered[0][r];
    const std::string_view bytes(
        reinterpret_cast<const char*>(got.const_data_ptr<uint8_t>()) + h[1],
        static_cast<size_t>(h[2] - h[1]));
    core::ValidatedMetadata m = [&] {
      try {
        return wire::read_metadata_pickle(bytes);
      } catch (const c10::Error& e) {
        TD_THROW(MalformedPeerDataError, describe(kCall, r),
                 ": the metadata is refused: ", e.msg());
      }
    }();
    TD_CHECK_PEER(m.storage_bytes() <= h[1], describe(kCall, r), ": the layout needs ",
                  m.storage_bytes(), " bytes of a ", h[1], "-byte storage");
    rows.push_back(core::rebuild_validated(std::move(m), got.narrow(0, 0, h[1])));
  }
  TensorDict out(td);
  out.update(stack(rows, 0), {.inplace = true});
  return out;
}

TensorDict scatter(std::optional<int64_t> src, const std::vector<TensorDict>& tensordicts,
                   const ScatterOptions& options) {
  constexpr const char* kCall = "scatter";
  const auto root = detail::resolve_peer(kCall, src, options.group_src, options.group, "src",
                                         "group_src", /*refuse_self=*/false);
  const detail::Waiter w(kCall, options.timeout,
                         c10::str("the group (source rank ", root.rank, ")"),
                         /*keeps_group=*/false);
  const int me = root.group.rank();
  if (me == root.rank) {
    const size_t size = static_cast<size_t>(root.group.size());
    TORCH_CHECK_VALUE(tensordicts.size() == size, "scatter: the source passes ", tensordicts.size(),
                      " TensorDicts to a group of ", size, " ranks");
    std::vector<TensorDict> cs;
    int64_t longest = 0;
    for (const auto& td : tensordicts) {
      cs.push_back(detail::consolidated(td, std::nullopt));
      longest = std::max(longest, consolidated_storage(cs.back()).numel());
    }
    const at::Device device = consolidated_storage(cs[0]).device();
    std::vector<std::string> pickles;
    std::vector<std::vector<at::Tensor>> padded(1);
    for (const auto& c : cs) {
      const at::Tensor storage = consolidated_storage(c);
      pickles.push_back(detail::metadata_pickle(c, {{"_total_bytes", storage.numel()},
                                                    {"_max_bytes", longest},
                                                    {"_storage_device", device.str()}}));
      padded[0].push_back(detail::byte_buffer(longest, device, /*zeroed=*/true));
      padded[0].back().narrow(0, 0, storage.numel()).copy_(storage);
    }
    detail::scatter_objects(w, root, &pickles);
    std::vector<at::Tensor> mine{detail::byte_buffer(longest, device)};
    w.wait(root.group.scatter(mine, padded, root.rank), "the storages");
    const at::Tensor& own = consolidated_storage(cs[me]);
    return rebuild(*consolidated_metadata(cs[me]), mine[0].narrow(0, 0, own.numel()));
  }
  // Other ranks ignore `tensordicts`, as the reference does.
  const int64_t max_total_bytes = detail::resolve_max_total_bytes(kCall, options.max_total_bytes);
  const std::string from = describe(kCall, root.rank);
  const std::string pickle = detail::scatter_objects(w, root, nullptr);
  Incoming in = detail::parse_incoming(from, pickle, max_total_bytes, /*padded=*/true);
  const int64_t n = detail::transfer_bytes(in, /*padded=*/true);
  auto buffer = detail::storage_buffer(in, n, detail::receive_device(from, options.device, in));
  std::vector<at::Tensor> mine{buffer.bytes};
  std::vector<std::vector<at::Tensor>> none;
  w.wait(root.group.scatter(mine, none, root.rank), c10::str("the storage of ", n, " bytes"));
  return detail::finish(in, buffer);
}

void all_reduce(const TensorDict& td, const AllReduceOptions& options) {
  const detail::Waiter w("all_reduce", options.timeout, "the group", /*keeps_group=*/false);
  if (options.bucket_bytes) {
    w.wait(all_reduce_buckets(td, options), [](size_t i) { return c10::str("bucket ", i); });
    return;
  }
  const auto leaves = all_reduce_leaves(td, options);
  AllReducer post{leaves, detail::resolve_group(options.group), options.op};
  run_each(w, leaves.size(), options.async_op, post);
}

// The works of all_reduce_async and reduce_premature, which the caller waits on: their wait()
// raises TimeoutError / PeerLostError as the blocking calls do.
std::vector<WorkPtr> typed(const char* call, std::string peer, std::vector<WorkPtr> works,
                           bool buckets) {
  return detail::typed_works(
      call, peer, std::move(works),
      [buckets](size_t i) { return buckets ? c10::str("bucket ", i) : c10::str("leaf ", i); },
      /*keeps_group=*/false);
}

std::vector<WorkPtr> all_reduce_async(const TensorDict& td, const AllReduceOptions& options) {
  if (options.bucket_bytes) {
    return typed("all_reduce", "the group", all_reduce_buckets(td, options), true);
  }
  const auto leaves = all_reduce_leaves(td, options);
  AllReducer post{leaves, detail::resolve_group(options.group), options.op};
  return typed("all_reduce", "the group", detail::post_all(leaves.size(), post), false);
}

void reduce(const TensorDict& td, std::optional<int64_t> dst, const ReduceOptions& options) {
  const detail::Waiter w("reduce", options.timeout, "the group", /*keeps_group=*/false);
  const Reducer post = make_reducer(td, dst, options);
  if (options.bucket_bytes) {
    w.wait(reduce_buckets(post, *options.bucket_bytes),
           [](size_t i) { return c10::str("bucket ", i); });
  } else {
    run_each(w, post.leaves.size(), options.async_op, post);
  }
  post.write_back();
}

std::vector<WorkPtr> reduce_premature(const TensorDict& td, std::optional<int64_t> dst,
                                      const ReduceOptions& options) {
  auto post = std::make_shared<Reducer>(make_reducer(td, dst, options));
  post->callbacks = true;
  const std::string peer = c10::str("the group (destination rank ", post->root, ")");
  if (options.bucket_bytes) {
    // The works' finishing steps use the reducer's leaves: they keep it alive.
    auto works = reduce_buckets(*post, *options.bucket_bytes);
    for (auto& w : works) w = detail::then({w}, [post] {}, {});
    return typed("reduce", peer, std::move(works), true);
  }
  return typed("reduce", peer, detail::post_all(post->leaves.size(), *post), false);
}

}  // namespace tensordict::dist

// Single-process micro-benchmarks (Google Benchmark) of the work around a transfer: tag
// generation, key sorting, consolidate (against memcpy of the same bytes), metadata encode and
// parse, the restricted pickle reader, and a relay's work on each piece (checksum, copy).
// benchmarks/run runs this and prints its table next to the reference tensordict's times for the
// same work.
//
// Consolidate cases, all nested 3 deep (a{i}/b{j}/c{k}/x): 1 x 100 MB, 16 x 8 MB, 1000 x 64 B.
// Its baselines: "MemcpyFresh" allocates the destination each time (as consolidate must) and
// copies every leaf into it; "MemcpyWarm" copies into a destination allocated once, the floor
// no allocation-bearing copy can reach.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/consolidate.h"
#include "tensordict/tensor_dict.h"
#include "wire/metadata_pickle.h"
#include "wire/pickle.h"
#include "wire/publication.h"
#ifdef TENSORDICT_BENCH_DIST
#include "tensordict/distributed/tags.h"
#endif

namespace {

using namespace tensordict;
using namespace tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

// `count` float32 leaves of `bytes` each, spread over three nested levels a{i}/b{j}/c{k}/x.
TensorDict make_case(int64_t count, int64_t bytes) {
  int64_t per_level = 1;
  while (per_level * per_level * per_level < count) ++per_level;
  TensorDict td;
  for (int64_t i = 0; i < count; ++i) {
    const auto a = i / (per_level * per_level), b = (i / per_level) % per_level, c = i % per_level;
    td.set({"a" + std::to_string(a), "b" + std::to_string(b), "c" + std::to_string(c), "x"},
           at::rand({bytes / 4}));
  }
  return td;
}

struct Case {
  const char* name;
  int64_t count;
  int64_t bytes;
};
constexpr Case kCases[] = {
    {"1x100MB", 1, 100 << 20}, {"16x8MB", 16, 8 << 20}, {"1000x64B", 1000, 64}};
constexpr int kSmall = 2;  // the 1000 x 64 B case: the metadata benchmarks use its metadata

// Built on first use, so that a --benchmark_filter run pays only for the cases it selects.
const TensorDict& case_td(int i) {
  static std::vector<std::optional<TensorDict>> tds(std::size(kCases));
  if (!tds[i]) tds[i] = make_case(kCases[i].count, kCases[i].bytes);
  return *tds[i];
}

std::vector<at::Tensor> leaves(const TensorDict& td) {
  std::vector<at::Tensor> out;
  for (const auto& [k, v] : td.items({.include_nested = true, .leaves_only = true})) {
    out.push_back(v.tensor());
  }
  return out;
}

void set_bytes(benchmark::State& state, int64_t total) {
  state.SetBytesProcessed(state.iterations() * total);
  state.counters["bytes"] = static_cast<double>(total);
}

// ---- tags -----------------------------------------------------------------------------------
#ifdef TENSORDICT_BENCH_DIST
void BM_IntGenerator(benchmark::State& state) {
  int64_t tag = 0;
  for (auto _ : state) {
    tag = dist::int_generator(tag + 1);  // the pseudo_rand chain, as a per-leaf send walks it
    benchmark::DoNotOptimize(tag);
  }
}
BENCHMARK(BM_IntGenerator);
#endif

// ---- key sorting: 1000 keys at one level ----------------------------------------------------
void BM_SortedKeys(benchmark::State& state) {
  TensorDict td;
  // Inserted in a scrambled order, so that the sort has work to do.
  for (int i = 0; i < 1000; ++i) td.set("key" + std::to_string((i * 7919) % 1000), at::zeros({1}));
  for (auto _ : state) {
    auto keys = td.sorted_keys();
    benchmark::DoNotOptimize(keys.data());
  }
}
BENCHMARK(BM_SortedKeys)->Unit(benchmark::kMicrosecond);

// ---- everyday methods (docs/api-coverage.md) on 100 leaves, half of them one level down -------
const TensorDict& hundred_leaves() {
  static const TensorDict td = [] {
    TensorDict t({}, {4, 3});
    for (int i = 0; i < 100; ++i) {
      const std::string k = "k" + std::to_string(i);
      t.set(i < 50 ? NestedKey(k) : NestedKey({"n", k}), at::full({4, 3}, double(i)));
    }
    return t;
  }();
  return td;
}

void BM_Method(benchmark::State& state) {
  const TensorDict& td = hundred_leaves();
  const std::vector<NestedKey> ten = {"k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9"};
  const auto call = [&]() -> size_t {
    switch (state.range(0)) {
      case 0: return td.get("k0").tensor().numel() > 0;
      case 1: return td.keys({.include_nested = true, .leaves_only = true}).size();
      case 2: return td.select(ten).entries().size();
      case 3: return td.exclude(ten).entries().size();
      case 4: return td.copy().entries().size();
      case 5: return td.clone().entries().size();
      case 6: return (td + td).entries().size();
      default: return td.sum({.dims = {0}}).entries().size();
    }
  };
  for (auto _ : state) benchmark::DoNotOptimize(call());
  static const char* names[] = {
      "get",       "keys(nested, leaves)", "select(10)", "exclude(10)", "copy", "clone", "td + td",
      "sum(dim=0)"};
  state.SetLabel(names[state.range(0)]);
}
BENCHMARK(BM_Method)->DenseRange(0, 7)->Unit(benchmark::kMicrosecond);

// ---- consolidate ----------------------------------------------------------------------------
void BM_Consolidate(benchmark::State& state) {
  const auto& td = case_td(static_cast<int>(state.range(0)));
  const int threads = static_cast<int>(state.range(1));
  int64_t total = 0;
  for (auto _ : state) {
    TensorDict c = consolidate(td, {.num_threads = threads});
    total = consolidated_storage(c).numel();
    benchmark::DoNotOptimize(total);
  }
  set_bytes(state, total);
}

void copy_leaves(const std::vector<at::Tensor>& ls, uint8_t* dst) {
  for (const auto& t : ls) {
    std::memcpy(dst, t.const_data_ptr(), t.nbytes());
    dst += (t.nbytes() + 7) / 8 * 8;
  }
}

int64_t padded_total(const std::vector<at::Tensor>& ls) {
  int64_t total = 0;
  for (const auto& t : ls) total += static_cast<int64_t>((t.nbytes() + 7) / 8 * 8);
  return total;
}

void BM_MemcpyFresh(benchmark::State& state) {
  const auto ls = leaves(case_td(static_cast<int>(state.range(0))));
  const int64_t total = padded_total(ls);
  for (auto _ : state) {
    at::Tensor dst = at::empty({total}, at::kByte);
    copy_leaves(ls, dst.data_ptr<uint8_t>());
    benchmark::DoNotOptimize(dst.data_ptr());
  }
  set_bytes(state, total);
}

void BM_MemcpyWarm(benchmark::State& state) {
  const auto ls = leaves(case_td(static_cast<int>(state.range(0))));
  const int64_t total = padded_total(ls);
  at::Tensor dst = at::empty({total}, at::kByte);
  copy_leaves(ls, dst.data_ptr<uint8_t>());
  for (auto _ : state) {
    copy_leaves(ls, dst.data_ptr<uint8_t>());
    benchmark::ClobberMemory();
  }
  set_bytes(state, total);
}

void cases(benchmark::internal::Benchmark* b, bool threads) {
  for (int i = 0; i < 3; ++i) {
    b->Args({i, 1});
    if (threads && i < 2) b->Args({i, 4});
  }
  b->ArgNames({"case", "threads"})->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_Consolidate)->Apply([](auto* b) { cases(b, true); });
BENCHMARK(BM_MemcpyFresh)->Apply([](auto* b) { cases(b, false); });
BENCHMARK(BM_MemcpyWarm)->Apply([](auto* b) { cases(b, false); });

// ---- a relay's work on each piece (docs/wire-format.md §9.9) --------------------------------
// A relay checks each piece against the publisher's checksum and copies it into its stage: at
// under a link's rate (12.5 GB/s for the route model, benchmarks/route_model.py) a relay, not
// the link, would set the pace. Baseline: memcpy of the same piece. Pieces of 1 MiB, warm.
constexpr int64_t kPiece = 1 << 20;

std::vector<uint8_t> piece_bytes() {
  std::vector<uint8_t> v(kPiece);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(i * 31 + 7);
  return v;
}

void BM_PieceMemcpy(benchmark::State& state) {
  const auto from = piece_bytes();
  std::vector<uint8_t> to(kPiece);
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), kPiece);
    benchmark::ClobberMemory();
  }
  set_bytes(state, kPiece);
}

void BM_PieceChecksum(benchmark::State& state) {
  const auto from = piece_bytes();
  for (auto _ : state) benchmark::DoNotOptimize(publication::piece_checksum(from.data(), kPiece));
  set_bytes(state, kPiece);
}

// What a relay does: one pass that copies and checks.
void BM_PieceCopyChecksum(benchmark::State& state) {
  const auto from = piece_bytes();
  std::vector<uint8_t> to(kPiece);
  for (auto _ : state) {
    benchmark::DoNotOptimize(publication::copy_piece_checksum(to.data(), from.data(), kPiece));
    benchmark::ClobberMemory();
  }
  set_bytes(state, kPiece);
}

BENCHMARK(BM_PieceMemcpy)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PieceChecksum)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PieceCopyChecksum)->Unit(benchmark::kMicrosecond);

// ---- metadata of 1000 leaves: JSON encode / parse, pickle read ------------------------------
const Metadata& small_metadata() {
  static const Metadata m = metadata_of(case_td(kSmall));
  return m;
}

void BM_MetadataToJson(benchmark::State& state) {
  for (auto _ : state) {
    auto text = metadata_to_json(small_metadata(), /*sort_keys=*/true);
    benchmark::DoNotOptimize(text.data());
  }
}
BENCHMARK(BM_MetadataToJson)->Unit(benchmark::kMicrosecond);

void BM_MetadataFromJson(benchmark::State& state) {
  const std::string text = metadata_to_json(small_metadata(), true);
  for (auto _ : state) {
    auto m = metadata_from_json(text);  // parse and validate, as on receipt from a peer
    benchmark::DoNotOptimize(m.children.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(text.size()));
}
BENCHMARK(BM_MetadataFromJson)->Unit(benchmark::kMicrosecond);

void BM_PickleLoads(benchmark::State& state) {
  const std::string bytes = metadata_pickle_bytes(small_metadata());
  for (auto _ : state) {
    auto v = pickle::loads(bytes);
    benchmark::DoNotOptimize(v.kind());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes.size()));
}
BENCHMARK(BM_PickleLoads)->Unit(benchmark::kMicrosecond);

void BM_MetadataFromPickleBytes(benchmark::State& state) {
  const std::string bytes = metadata_pickle_bytes(small_metadata());
  for (auto _ : state) {
    auto m = metadata_from_pickle_bytes(bytes);  // loads + validation: init_remote's receive
    benchmark::DoNotOptimize(m.children.data());
  }
}
BENCHMARK(BM_MetadataFromPickleBytes)->Unit(benchmark::kMicrosecond);

void BM_MetadataToPickleBytes(benchmark::State& state) {
  for (auto _ : state) {
    auto bytes = metadata_pickle_bytes(small_metadata());  // init_remote's send
    benchmark::DoNotOptimize(bytes.data());
  }
}
BENCHMARK(BM_MetadataToPickleBytes)->Unit(benchmark::kMicrosecond);

void BM_Rebuild(benchmark::State& state) {
  const TensorDict c = consolidate(case_td(kSmall));
  const at::Tensor storage = consolidated_storage(c);
  for (auto _ : state) {
    TensorDict td = rebuild(small_metadata(), storage);  // views of the received storage
    benchmark::DoNotOptimize(td.batch_size().data());
  }
}
BENCHMARK(BM_Rebuild)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();

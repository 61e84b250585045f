// consolidate() against memcpy of the same bytes, on three shapes of TensorDict, all nested
// 3 deep: 1 x 100 MB, 16 x 8 MB, 1000 x 64 B. benchmarks/consolidate_bench.py runs this with
// repetitions, times the reference tensordict on the same data and prints the ratios.
//
// Baselines: "memcpy_fresh" allocates the destination each time (as consolidate must) and
// copies every leaf into it; "memcpy_warm" copies into a destination allocated once, the
// floor no allocation-bearing copy can reach.

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <cstring>

#include "tensordict/consolidate.h"
#include "tensordict/tensor_dict.h"

namespace {

using namespace tensordict;

// `count` float32 leaves of `bytes` each, spread over three nested levels a{i}/b{j}/c{k}.
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
constexpr Case kCases[] = {{"1x100MB", 1, 100 << 20}, {"16x8MB", 16, 8 << 20}, {"1000x64B", 1000, 64}};

const TensorDict& case_td(int i) {
  static std::vector<TensorDict> tds = [] {
    std::vector<TensorDict> out;
    for (const auto& c : kCases) out.push_back(make_case(c.count, c.bytes));
    return out;
  }();
  return tds[i];
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

void BM_MemcpyFresh(benchmark::State& state) {
  const auto ls = leaves(case_td(static_cast<int>(state.range(0))));
  int64_t total = 0;
  for (const auto& t : ls) total += static_cast<int64_t>((t.nbytes() + 7) / 8 * 8);
  for (auto _ : state) {
    at::Tensor dst = at::empty({total}, at::kByte);
    copy_leaves(ls, dst.data_ptr<uint8_t>());
    benchmark::DoNotOptimize(dst.data_ptr());
  }
  set_bytes(state, total);
}

void BM_MemcpyWarm(benchmark::State& state) {
  const auto ls = leaves(case_td(static_cast<int>(state.range(0))));
  int64_t total = 0;
  for (const auto& t : ls) total += static_cast<int64_t>((t.nbytes() + 7) / 8 * 8);
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

}  // namespace

BENCHMARK_MAIN();

#pragma once
// Shared by the fuzz targets: setup, the expected-error filter, and a walk over a received
// TensorDict that reads every byte of every leaf from instrumented code, so that a view past
// the end of its storage is an AddressSanitizer report rather than silently wrong data.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "tensordict/consolidate.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::fuzz {

// Each input runs on this thread only: torch's intra-op pool would hide nothing and cost time.
inline void init() { at::set_num_threads(1); }

// A broken invariant of our own code: a finding, reported as a crash.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
  std::abort();
}

// Sums every byte of every leaf (nested levels and lazy stacks' members included, where the
// leaves are: items() would stack a lazy stack's) and checks that each leaf lies inside
// `storage` when one is given (the rebuilt views must never leave it).
inline uint64_t touch(const TensorDict& td, const at::Tensor* storage = nullptr) {
  uint64_t sum = 0;
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensordict()) {
      sum += touch(value.tensordict(), storage);
      continue;
    }
    if (!value.is_tensor()) continue;
    const at::Tensor& t = value.tensor();
    if (!t.is_contiguous()) fail("a rebuilt leaf is not contiguous");
    const size_t n = t.nbytes();
    if (n == 0) continue;
    const auto* p = static_cast<const volatile uint8_t*>(t.const_data_ptr());
    if (storage) {
      const auto* lo = static_cast<const uint8_t*>(storage->const_data_ptr());
      const auto* hi = lo + storage->numel();
      const auto* q = const_cast<const uint8_t*>(p);
      if (q < lo || q + n > hi) fail("a rebuilt leaf lies outside its storage");
    }
    for (size_t i = 0; i < n; ++i) sum += p[i];
  }
  return sum;
}

// Metadata equality for round-trip checks: a non-tensor entry holding NaN is never == itself,
// so equal text counts too.
inline bool same_metadata(const Metadata& a, const Metadata& b) {
  return a == b || metadata_to_json(a) == metadata_to_json(b);
}

// A uint8 storage holding exactly `bytes` at a storage offset of `offset` (0..7) into an
// allocation of exactly offset + size bytes, so that a read past the end is caught.
inline at::Tensor storage_of(std::string_view bytes, int64_t offset) {
  at::Tensor base = at::empty({offset + static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(base.data_ptr<uint8_t>() + offset, bytes.data(), bytes.size());
  return base.narrow(0, offset, static_cast<int64_t>(bytes.size()));
}

}  // namespace tensordict::fuzz

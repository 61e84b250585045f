// Fuzz target: the lazy-stack node budget of the metadata readers (docs/reliability.md). The
// input describes an honest TensorDict of lazy stacks (members, their keys, nesting); its
// metadata is written as our init_remote writes it, then read back by the object collectives'
// reader (its fast path and the general one) and by the JSON reader of consolidated sends.
//
// Input: byte 0 the members per stack (1 to 256, times 64 when bit 7 of byte 1 is set; at most
// about 4,000 TensorDicts in all), byte 1
// the nesting (bits 0-1: lazy stacks inside members) and leaves per member (bits 2-4), byte 2
// the stack dim (members have batch size [2]), then an optional patch (position, byte) pairs
// applied to the pickle. Expected: an unpatched pickle is read back as the same metadata, within
// the budget; a patched one is read or refused with c10::Error. Findings: crashes, sanitizer
// reports, a refusal of honest metadata, a budget refusal without the budget's message.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "tensordict/lazy_stack.h"
#include "wire/metadata_pickle.h"

using namespace tensordict;
using namespace tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

namespace {

TensorDict member(int leaves, int depth, int64_t members, int64_t dim, int64_t seed) {
  std::vector<TensorDict::Entry> entries;
  for (int k = 0; k < leaves; ++k) {
    entries.emplace_back("l" + std::to_string(k), at::full({2}, static_cast<double>(seed + k)));
  }
  if (depth > 0) {
    std::vector<TensorDict> inner;
    for (int64_t i = 0; i < std::min<int64_t>(members, 4); ++i) {
      inner.push_back(member(leaves, depth - 1, members, 0, seed + i));
    }
    entries.emplace_back("s", LazyStackedTensorDict(inner, 1));  // batch [2, n] under [2]
  }
  return TensorDict(std::move(entries), {2});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const int depth = data[1] & 3;
  const int leaves = 1 + ((data[1] >> 2) & 7);
  // At most about 4,000 TensorDicts in all (a member holds 1 + 4 + 16 + ... of them), so that
  // an input runs in a fraction of a second under ASan.
  const int64_t per_member = (int64_t{1} << (2 * (depth + 1))) / 3;
  const int64_t members = std::min<int64_t>((int64_t{data[0]} + 1) * ((data[1] & 0x80) ? 64 : 1),
                                            4000 / per_member / (leaves > 4 ? 2 : 1));
  std::vector<TensorDict> tds;
  for (int64_t i = 0; i < members; ++i) tds.push_back(member(leaves, depth, members, 0, i));
  const int64_t dim = data[2] % 2;
  const TensorDict td = LazyStackedTensorDict(tds, dim);
  const TensorDict c = consolidate(td);
  const Metadata& m = *consolidated_metadata(c);
  std::string pickle =
      metadata_pickle_bytes(m, {{"_total_bytes", consolidated_storage(c).numel()}});

  // Honest metadata is read back, whatever its size within the documented limits.
  Metadata back;
  try {
    back = metadata_from_pickle_bytes(pickle);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    fuzz::fail("the reader refused an honest lazy stack's metadata pickle");
  }
  if (!fuzz::same_metadata(back, m)) fuzz::fail("the pickle changed a lazy stack's metadata");
  try {
    if (!fuzz::same_metadata(metadata_from_json(metadata_to_json(m)), m)) {
      fuzz::fail("the JSON changed a lazy stack's metadata");
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    fuzz::fail("the JSON reader refused an honest lazy stack's metadata");
  }

  // The same pickle, patched: read or refused, never worse.
  if (size < 5) return 0;
  for (size_t i = 3; i + 1 < size; i += 2) {
    pickle[(size_t{data[i]} * 257 + i) % pickle.size()] = static_cast<char>(data[i + 1]);
  }
  try {
    (void)metadata_from_pickle_bytes(pickle);
  } catch (const c10::Error&) {
  }
  return 0;
}

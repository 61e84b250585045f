#pragma once
// Message tags of the per-leaf transfers (docs/wire-format.md §1.3 and §2).

#include <cstdint>

namespace tensordict::dist {

/// The reference's `tensordict.utils._int_generator(seed)`:
/// `int.from_bytes(np.random.default_rng(seed).bytes(8), "big") % 10000`, bit-identical to
/// numpy (SeedSequence, then PCG64), computed without numpy in well under a microsecond.
/// Returns a value in [0, 9999]. Throws ValueError ("expected non-negative integer", numpy's
/// text) for a negative seed.
int64_t int_generator(int64_t seed);

/// The tag of the leaf after the one tagged `tag` (the first leaf follows `init_tag - 1`):
/// `tag + 1`, or `int_generator(tag + 1)` with pseudo_rand.
inline int64_t next_tag(int64_t tag, bool pseudo_rand) {
  return pseudo_rand ? int_generator(tag + 1) : tag + 1;
}

}  // namespace tensordict::dist

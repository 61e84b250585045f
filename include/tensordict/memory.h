#pragma once
// The machine's memory, for the defaults of the bounds on what a peer may make us allocate.

#include <cstdint>

namespace tensordict {

/// Half of this machine's physical memory (sysconf), or 4 GiB where that cannot be read: the
/// default bound on a storage a peer announces (dist's max_total_bytes, the pipe's
/// max_storage_bytes), large enough for any transfer the machine can hold, small enough that
/// passing the check means the allocation can succeed.
int64_t default_storage_limit_bytes();

}  // namespace tensordict

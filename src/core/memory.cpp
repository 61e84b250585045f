#include "tensordict/memory.h"

#include <unistd.h>

namespace tensordict {

int64_t default_storage_limit_bytes() {
  static const int64_t bytes = [] {
    const int64_t pages = sysconf(_SC_PHYS_PAGES);
    const int64_t page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? pages / 2 * page : int64_t{4} << 30;
  }();
  return bytes;
}

}  // namespace tensordict

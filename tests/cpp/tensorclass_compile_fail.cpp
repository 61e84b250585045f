// Declarations that must not compile (CTest tensorclass_compile_fail_*): each case must stop
// at the macro's static_assert, whose message the test matches.
#include "tensordict/tensorclass.h"

#if defined(TENSORCLASS_CASE_unsupported_type)
TENSORDICT_TENSORCLASS(BadType, (at::Tensor, obs), (int, count));  // int64_t, not int
#elif defined(TENSORCLASS_CASE_reserved_name)
TENSORDICT_TENSORCLASS(BadName, (at::Tensor, batch_size));
#endif

int main() { return 0; }

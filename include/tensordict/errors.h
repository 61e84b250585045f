#pragma once
// Error types beyond c10's. c10 already gives ValueError (TORCH_CHECK_VALUE), TypeError
// (TORCH_CHECK_TYPE) and Error (TORCH_CHECK); a missing key needs its own type so that the
// Python binding can raise KeyError, as the reference does.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>

namespace tensordict {

/// Thrown when a key (or a level of a nested key) is absent. Python: KeyError.
class KeyError : public c10::Error {
 public:
  using c10::Error::Error;
};

namespace detail {
[[noreturn]] void throw_key_error(const char* func, const char* file, uint32_t line,
                                  const std::string& msg);
}  // namespace detail

}  // namespace tensordict

/// Like TORCH_CHECK, but throws tensordict::KeyError.
#define TD_CHECK_KEY(cond, ...)                                                             \
  if (C10_UNLIKELY_OR_CONST(!(cond))) {                                                    \
    ::tensordict::detail::throw_key_error(__func__, __FILE__,                              \
                                          static_cast<uint32_t>(__LINE__),                 \
                                          ::c10::str(__VA_ARGS__));                        \
  }

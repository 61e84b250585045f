#include "tensordict/errors.h"

namespace tensordict::detail {

void throw_key_error(const char* func, const char* file, uint32_t line, const std::string& msg) {
  throw KeyError(c10::SourceLocation{func, file, line}, msg);
}

}  // namespace tensordict::detail

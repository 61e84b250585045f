# The include rule of docs/architecture.md, checked (ctest's include_rule):
#   cmake -DSOURCE_DIR=<repo> -P cmake/include_rule.cmake
# Each layer may include the layers below it only. A line that breaks the rule is printed with
# its file and the rule it breaks, and the check fails.

# <files (glob)>@<forbidden include (regex)>@<why>
set(_rules
  "include/tensordict/*.h@#include [<\"](shm/|wire/|core/|ucp/|ucs/|torch/csrc/distributed/|tensordict/(distributed|pipe)/)@the core's public headers see torch and themselves only"
  "src/shm/*@#include [<\"](core/|wire/|tensordict/|torch/|ATen/|c10/|ucp/|ucs/)@shared memory is the operating system's: nothing of ours, no torch"
  "src/core/*@#include [<\"](shm/|wire/|ucp/|ucs/|torch/csrc/distributed/|tensordict/(distributed|pipe)/)@the core sits below the wire and the transports"
  "src/wire/*@#include [<\"](ucp/|ucs/|torch/csrc/distributed/|tensordict/(distributed|pipe)/)@the wire is bytes only: no transport"
  "include/tensordict/distributed/*.h@#include [<\"](wire/|core/|ucp/|ucs/|tensordict/pipe/)@the c10d layer's public headers do not expose internals or the pipe"
  "src/distributed/*@#include [<\"](shm/|ucp/|ucs/|tensordict/pipe/)@the c10d layer does not reach into the pipe"
  "include/tensordict/pipe/*.h@#include [<\"](wire/|core/|ucp/|ucs/|torch/csrc/distributed/|tensordict/distributed/)@the pipe's public headers do not expose internals or c10d"
  "src/pipe/*@#include [<\"](shm/|torch/csrc/distributed/|tensordict/distributed/)@the pipe does not depend on c10d"
)

set(_faults 0)
foreach(_rule IN LISTS _rules)
  string(REPLACE "@" ";" _parts "${_rule}")
  list(GET _parts 0 _glob)
  list(GET _parts 1 _pattern)
  list(GET _parts 2 _why)
  # Public headers: the folder itself (a layer's headers have folders of their own); sources: the
  # whole tree of the folder.
  if(_glob MATCHES "^include/")
    file(GLOB _files RELATIVE "${SOURCE_DIR}" "${SOURCE_DIR}/${_glob}")
  else()
    file(GLOB_RECURSE _files RELATIVE "${SOURCE_DIR}" "${SOURCE_DIR}/${_glob}")
  endif()
  list(LENGTH _files _count)
  if(_count EQUAL 0)
    message(SEND_ERROR "include_rule: no file matches ${_glob} (the rule is stale)")
    math(EXPR _faults "${_faults} + 1")
  endif()
  foreach(_file IN LISTS _files)
    file(STRINGS "${SOURCE_DIR}/${_file}" _lines REGEX "^[ \t]*#[ \t]*include")
    foreach(_line IN LISTS _lines)
      if(_line MATCHES "${_pattern}")
        message(SEND_ERROR "include_rule: ${_file}: ${_line}: ${_why}")
        math(EXPR _faults "${_faults} + 1")
      endif()
    endforeach()
  endforeach()
endforeach()
if(_faults GREATER 0)
  message(FATAL_ERROR "include_rule: ${_faults} fault(s): see docs/architecture.md")
endif()
message(STATUS "include_rule: every include follows docs/architecture.md")

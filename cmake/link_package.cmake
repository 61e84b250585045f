# cmake -DSOURCE=<package dir> -DDEST=<dir> -P link_package.cmake
# Makes DEST hold a symbolic link to each file of SOURCE (the Python files of tensordict_cpp) and
# nothing else of it, so that edits to those files take effect without a build and the module
# built into DEST sits beside them. Runs on every build: it is cheap and sees added files.
cmake_policy(VERSION 3.25)
file(MAKE_DIRECTORY "${DEST}")
file(GLOB _want RELATIVE "${SOURCE}" LIST_DIRECTORIES false "${SOURCE}/*")
file(GLOB _have RELATIVE "${DEST}" LIST_DIRECTORIES false "${DEST}/*")
foreach(_f IN LISTS _have)
  if(IS_SYMLINK "${DEST}/${_f}" AND NOT _f IN_LIST _want)
    file(REMOVE "${DEST}/${_f}")
  endif()
endforeach()
foreach(_f IN LISTS _want)
  if(NOT IS_SYMLINK "${DEST}/${_f}")
    file(CREATE_LINK "${SOURCE}/${_f}" "${DEST}/${_f}" SYMBOLIC)
  endif()
endforeach()

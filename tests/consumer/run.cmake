# Installs the build into a scratch prefix, checks that the installed headers are exactly the
# public headers of include/tensordict/ (those of the transports this build has), then
# configures, builds and runs the consumer project against it: a program that includes every
# installed header and uses what docs/ show (publication's classes of both transports among
# them). Invoked by CTest with -DSOURCE_DIR, -DBUILD_DIR, -DTORCH_PREFIX, -DGENERATOR, -DWITH_DIST,
# -DWITH_PIPE.
set(prefix "${BUILD_DIR}/consumer-install")
set(work "${BUILD_DIR}/consumer-build")
file(REMOVE_RECURSE "${prefix}" "${work}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")

# What must be installed: every header of include/tensordict/, but a transport's this build lacks.
file(GLOB_RECURSE expected RELATIVE "${SOURCE_DIR}/include" "${SOURCE_DIR}/include/tensordict/*.h")
if(NOT WITH_DIST)
  list(FILTER expected EXCLUDE REGEX "^tensordict/distributed/")
endif()
if(NOT WITH_PIPE)
  list(FILTER expected EXCLUDE REGEX "^tensordict/pipe/")
endif()
file(GLOB_RECURSE installed RELATIVE "${prefix}/include" "${prefix}/include/*")
list(SORT expected)
list(SORT installed)
set(missing ${expected})
list(REMOVE_ITEM missing ${installed})
if(missing)
  message(FATAL_ERROR "public headers not installed: ${missing}")
endif()
set(extra ${installed})
list(REMOVE_ITEM extra ${expected})
if(extra)
  message(FATAL_ERROR "installed files that are not public headers under include/: ${extra}")
endif()
# None reaches an internal header.
foreach(header IN LISTS installed)
  file(STRINGS "${prefix}/include/${header}" internal REGEX "#include [<\"](wire|core)/")
  if(internal)
    message(FATAL_ERROR "the installed ${header} includes an internal header: ${internal}")
  endif()
endforeach()

# One translation unit that includes each installed header, compiled into the consumer.
set(every "// Written by tests/consumer/run.cmake: every installed header of tensordict.\n")
foreach(header IN LISTS installed)
  string(APPEND every "#include <${header}>\n")
endforeach()
file(WRITE "${work}/every_header.cpp" "${every}")
list(LENGTH installed count)
message(STATUS "consumer: ${count} headers installed, each included by every_header.cpp")

run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer" -B "${work}" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix}" "-DTorch_DIR=${TORCH_PREFIX}"
    "-DTD_EVERY_HEADER=${work}/every_header.cpp")
run(${CMAKE_COMMAND} --build "${work}")
run("${work}/consumer")

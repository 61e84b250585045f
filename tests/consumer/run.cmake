# Installs the build into a scratch prefix, then configures, builds and runs the consumer
# project against it. Invoked by CTest with -DSOURCE_DIR, -DBUILD_DIR, -DTORCH_PREFIX, -DGENERATOR.
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
# Only public headers are installed (CMakeLists.txt lists them), and none reaches an internal one.
file(GLOB_RECURSE installed RELATIVE "${prefix}/include" "${prefix}/include/*")
foreach(header IN LISTS installed)
  if(NOT EXISTS "${SOURCE_DIR}/include/${header}")
    message(FATAL_ERROR "installed ${header}, which is not a public header under include/")
  endif()
  file(STRINGS "${prefix}/include/${header}" internal REGEX "#include \"wire/")
  if(internal)
    message(FATAL_ERROR "the installed ${header} includes an internal header: ${internal}")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer" -B "${work}" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix}" "-DTorch_DIR=${TORCH_PREFIX}")
run(${CMAKE_COMMAND} --build "${work}")
run("${work}/consumer")

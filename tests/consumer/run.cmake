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
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer" -B "${work}" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix}" "-DTorch_DIR=${TORCH_PREFIX}")
run(${CMAKE_COMMAND} --build "${work}")
run("${work}/consumer")

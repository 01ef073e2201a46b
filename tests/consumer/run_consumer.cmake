# ctest driver for the consumer project. MODE=installed installs the build tree
# into a private prefix and uses find_package; MODE=subdirectory builds the
# consumer with add_subdirectory on the source tree (CUDA off to save time).
file(REMOVE_RECURSE ${WORK_DIR})
set(consumer_source ${SOURCE_DIR}/tests/consumer)
if(MODE STREQUAL "installed")
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install failed (${rc})")
  endif()
  set(configure_args -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
else()
  set(configure_args -DSPARSEKV_SOURCE_DIR=${SOURCE_DIR} -DSPARSEKV_CUDA=OFF)
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${consumer_source} -B ${WORK_DIR}/build -G ${GENERATOR}
                        -DCMAKE_BUILD_TYPE=${BUILD_TYPE} ${configure_args} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer failed (${rc})")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the consumer failed (${rc})")
endif()

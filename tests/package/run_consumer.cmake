# ctest -P script: install the already-built tree into WORK/prefix (the default install, then each
# install component in COMPONENTS), then configure, build and run tests/package/CONSUMER
# (default: consumer) against it with find_package(keel). The installed headers must be public
# ones only (check_headers.cmake). With NO_FAULTS, it first checks that
# the install holds nothing of keel::faults or keel::grpc (no header, library or export file) and
# no keel-demo.
if(NOT CONSUMER)
  set(CONSUMER consumer)
endif()
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${KEEL_BUILD} --prefix ${WORK}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
foreach(component IN LISTS COMPONENTS)
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${KEEL_BUILD} --prefix ${WORK}/prefix
                          --component ${component}
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "installing the component ${component} failed: ${rc}")
  endif()
endforeach()
include(${CMAKE_CURRENT_LIST_DIR}/check_headers.cmake)
if(NO_FAULTS)
  file(GLOB_RECURSE faults_files RELATIVE ${WORK}/prefix ${WORK}/prefix/*keel_faults*
       ${WORK}/prefix/*keel-faults*)
  if(EXISTS ${WORK}/prefix/include/keel/faults OR faults_files)
    message(FATAL_ERROR "the default install has keel::faults: include/keel/faults or "
                        "${faults_files}")
  endif()
  file(GLOB_RECURSE grpc_files RELATIVE ${WORK}/prefix ${WORK}/prefix/*keel_grpc*
       ${WORK}/prefix/*keel-grpc*)
  if(EXISTS ${WORK}/prefix/include/keel/grpc OR grpc_files)
    message(FATAL_ERROR "the default install has keel::grpc (the install component grpc): "
                        "include/keel/grpc or ${grpc_files}")
  endif()
  if(EXISTS ${WORK}/prefix/bin/keel-demo)
    message(FATAL_ERROR "the default install has keel-demo (the install component demo)")
  endif()
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${KEEL_SOURCE}/tests/package/${CONSUMER} -B ${WORK}/build
                        -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
                        -DCMAKE_PREFIX_PATH=${WORK}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK}/build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "consumer said: ${out}")
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()

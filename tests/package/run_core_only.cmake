# ctest -P script: configure keel with core only (no adapters, tools, tests or benchmarks),
# build and install it into WORK/prefix, check that no adapter header was installed, then build
# and run tests/package/consumer against it.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} -S ${KEEL_SOURCE} -B ${WORK}/keel -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release
                        -DKEEL_WITH_ADAPTERS=OFF -DKEEL_BUILD_TESTS=OFF -DKEEL_BUILD_TOOLS=OFF
                        -DKEEL_BUILD_BENCH=OFF -DKEEL_INSTALL=ON
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring keel (core only) failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/keel RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building keel (core only) failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --install ${WORK}/keel --prefix ${WORK}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "installing keel (core only) failed: ${rc}")
endif()
foreach(adapter http store sim asio)
  if(EXISTS ${WORK}/prefix/include/keel/${adapter})
    message(FATAL_ERROR "a core-only install has include/keel/${adapter}")
  endif()
endforeach()
if(NOT EXISTS ${WORK}/prefix/include/keel/version.hpp)
  message(FATAL_ERROR "keel/version.hpp was not installed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${KEEL_SOURCE}/tests/package/consumer -B ${WORK}/build
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

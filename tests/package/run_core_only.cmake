# ctest -P script: configure keel with core only (no adapters, tools, tests or benchmarks) and
# build it in WORK-keel, then install it and build and run tests/package/consumer against it
# (run_consumer.cmake), and check that no adapter header was installed.
set(keel_build ${WORK}-keel)
file(REMOVE_RECURSE ${keel_build})
execute_process(COMMAND ${CMAKE_COMMAND} -S ${KEEL_SOURCE} -B ${keel_build} -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release
                        -DKEEL_WITH_ADAPTERS=OFF -DKEEL_BUILD_TESTS=OFF -DKEEL_BUILD_TOOLS=OFF
                        -DKEEL_BUILD_BENCH=OFF -DKEEL_INSTALL=ON
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring keel (core only) failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${keel_build} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building keel (core only) failed: ${rc}")
endif()
set(KEEL_BUILD ${keel_build})
include(${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
foreach(adapter http store sim asio faults grpc db json queue consumers idempotency fleet handlers
                serve)
  if(EXISTS ${WORK}/prefix/include/keel/${adapter})
    message(FATAL_ERROR "a core-only install has include/keel/${adapter}")
  endif()
endforeach()
if(NOT EXISTS ${WORK}/prefix/include/keel/version.hpp)
  message(FATAL_ERROR "keel/version.hpp was not installed")
endif()

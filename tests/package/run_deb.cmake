# ctest -P script: the Debian package of the already-built tree (cpack -G DEB, the configuration
# of cmake/KeelCPack.cmake) unpacked with dpkg-deb -x into WORK/root, checked (public headers
# only, nothing of keel::faults, no keel-demo, .pc files with prefix=/usr, a stripped keel binary with
# READELF), then tests/package/adapters configured against WORK/root/usr with find_package(keel),
# built and run.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CPACK} -G DEB -B ${WORK}/cpack --config ${KEEL_BUILD}/CPackConfig.cmake
                WORKING_DIRECTORY ${KEEL_BUILD} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "cpack -G DEB failed: ${rc}\n${out}")
endif()
file(GLOB debs ${WORK}/cpack/*.deb)
list(LENGTH debs count)
if(NOT count EQUAL 1)
  message(FATAL_ERROR "expected one .deb in ${WORK}/cpack, found: ${debs}")
endif()
message(STATUS "package: ${debs}")
execute_process(COMMAND ${DPKG_DEB} -x ${debs} ${WORK}/root RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "dpkg-deb -x failed: ${rc}")
endif()
set(usr ${WORK}/root/usr)

set(INSTALLED_PREFIX ${usr})
include(${CMAKE_CURRENT_LIST_DIR}/check_headers.cmake)
file(GLOB_RECURSE faults_files RELATIVE ${WORK}/root ${WORK}/root/*keel_faults*
     ${WORK}/root/*keel-faults*)
if(EXISTS ${usr}/include/keel/faults OR faults_files)
  message(FATAL_ERROR "the package has keel::faults: include/keel/faults or ${faults_files}")
endif()
if(EXISTS ${usr}/bin/keel-demo)
  message(FATAL_ERROR "the package has keel-demo (the install component demo)")
endif()
file(STRINGS ${usr}/${LIBDIR}/pkgconfig/keel.pc prefix_line REGEX "^prefix=")
if(NOT prefix_line STREQUAL "prefix=/usr")
  message(FATAL_ERROR "keel.pc in the package: '${prefix_line}', expected prefix=/usr")
endif()
if(READELF)
  execute_process(COMMAND ${READELF} -S --wide ${usr}/bin/keel RESULT_VARIABLE rc
                  OUTPUT_VARIABLE sections)
  if(rc OR sections MATCHES "\\.(symtab|debug_info)")
    message(FATAL_ERROR "the package's usr/bin/keel is not stripped (readelf: ${rc})")
  endif()
endif()

# keel-config.cmake finds its prefix from its own location: the unpacked usr works as a prefix.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${KEEL_SOURCE}/tests/package/adapters -B ${WORK}/build
                        -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${usr}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer against the package failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer against the package failed: ${rc}")
endif()
execute_process(COMMAND ${WORK}/build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "consumer said: ${out}")
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()

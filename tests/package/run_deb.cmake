# ctest -P script: the Debian packages of the already-built tree (cpack -G DEB, the configuration
# of cmake/KeelCPack.cmake: keel, libkeel-dev, keel-dbgsym) checked with dpkg-deb -f/-c and
# unpacked with dpkg-deb -x into WORK/root: what each holds (the systemd unit, its sysusers entry
# and example in keel, the libraries in the multiarch folder LIBDIR in libkeel-dev), public
# headers only, nothing of keel::faults, no keel-demo, .pc files with prefix=/usr, with READELF a
# stripped keel program whose debug information is in keel-dbgsym and static libraries without
# debug information, the unit's ExecStart and systemd-analyze verify, the copyright file
# (keel's licence, uPlot's when bundled) and lintian where installed. Then
# tests/package/adapters configured against WORK/root/usr with find_package(keel), built and run.
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CPACK} -G DEB -B ${WORK}/cpack --config ${KEEL_BUILD}/CPackConfig.cmake
                WORKING_DIRECTORY ${KEEL_BUILD} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "cpack -G DEB failed: ${rc}\n${out}")
endif()
foreach(package keel libkeel-dev keel-dbgsym)
  file(GLOB deb_${package} ${WORK}/cpack/${package}_*.deb ${WORK}/cpack/${package}_*.ddeb)
  list(LENGTH deb_${package} count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "expected one package ${package} in ${WORK}/cpack, found: ${deb_${package}}")
  endif()
  file(SIZE ${deb_${package}} size)
  execute_process(COMMAND ${DPKG_DEB} -f ${deb_${package}} Installed-Size Depends
                  OUTPUT_VARIABLE fields_${package})
  execute_process(COMMAND ${DPKG_DEB} -c ${deb_${package}} OUTPUT_VARIABLE contents_${package})
  message(STATUS "${deb_${package}}: ${size} bytes\n${fields_${package}}")
  execute_process(COMMAND ${DPKG_DEB} -x ${deb_${package}} ${WORK}/root RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "dpkg-deb -x ${deb_${package}} failed: ${rc}")
  endif()
endforeach()
set(usr ${WORK}/root/usr)

# What each package holds (dpkg-deb -c), the program's package depending on no -dev package.
function(expect package)
  foreach(path IN LISTS ARGN)
    if(NOT contents_${package} MATCHES " \\./${path}\n")
      message(FATAL_ERROR "${package} has no ${path}:\n${contents_${package}}")
    endif()
  endforeach()
endfunction()
expect(keel usr/bin/keel usr/lib/systemd/system/keel-worker@\\.service
       usr/lib/sysusers\\.d/keel\\.conf usr/share/doc/keel/copyright usr/share/doc/keel/changelog\\.gz
       usr/share/doc/keel/examples/keel-worker\\.env\\.example)
expect(libkeel-dev usr/${LIBDIR}/libkeel_core\\.a usr/${LIBDIR}/libkeel_store_queue\\.a
       usr/${LIBDIR}/cmake/keel/keel-config\\.cmake usr/${LIBDIR}/pkgconfig/keel\\.pc
       usr/include/keel/retry\\.hpp usr/include/keel/core/retry\\.hpp
       usr/share/doc/libkeel-dev/copyright)
if(NOT LIBDIR MATCHES "^lib/[a-z0-9_]+-linux-gnu[a-z]*$")
  message(FATAL_ERROR "CMAKE_INSTALL_LIBDIR is ${LIBDIR}, not the multiarch folder lib/<triplet>")
endif()
if(contents_libkeel-dev MATCHES " \\./usr/lib/(libkeel|pkgconfig|cmake)")
  message(FATAL_ERROR "libkeel-dev has files in /usr/lib rather than /usr/${LIBDIR}")
endif()
if(fields_keel MATCHES "-dev")
  message(FATAL_ERROR "the keel program's package depends on -dev packages:\n${fields_keel}")
endif()

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

# The program stripped, its debug information in keel-dbgsym under its build ID; the static
# libraries without debug information.
if(READELF)
  execute_process(COMMAND ${READELF} -S -n --wide ${usr}/bin/keel RESULT_VARIABLE rc
                  OUTPUT_VARIABLE sections)
  if(rc OR sections MATCHES "\\.(symtab|debug_info)")
    message(FATAL_ERROR "the package's usr/bin/keel is not stripped (readelf: ${rc})")
  endif()
  if(NOT sections MATCHES "Build ID: ([0-9a-f][0-9a-f])([0-9a-f]+)")
    message(FATAL_ERROR "usr/bin/keel has no build ID")
  endif()
  set(debug_file ${usr}/lib/debug/.build-id/${CMAKE_MATCH_1}/${CMAKE_MATCH_2}.debug)
  if(NOT EXISTS ${debug_file})
    message(FATAL_ERROR "keel-dbgsym has no ${debug_file} for usr/bin/keel")
  endif()
  execute_process(COMMAND ${READELF} -S --wide ${debug_file} OUTPUT_VARIABLE sections)
  if(NOT sections MATCHES "\\.debug_info")
    message(FATAL_ERROR "${debug_file} has no debug information")
  endif()
  file(GLOB archives ${usr}/${LIBDIR}/libkeel_*.a)
  foreach(archive IN LISTS archives)
    execute_process(COMMAND ${READELF} -S --wide ${archive} OUTPUT_VARIABLE sections)
    if(sections MATCHES "\\.debug_info")
      message(FATAL_ERROR "${archive} still has debug information")
    endif()
  endforeach()
endif()

# The systemd unit runs the keel the package installs; systemd-analyze verify (when there) on a
# copy whose ExecStart is the unpacked one, as tests/integration/deploy/verify_systemd_unit.sh does.
set(unit ${usr}/lib/systemd/system/keel-worker@.service)
file(STRINGS ${unit} exec_start REGEX "^ExecStart=")
if(NOT exec_start MATCHES "^ExecStart=/usr/bin/keel jobs ")
  message(FATAL_ERROR "the packaged unit's ${exec_start} does not run /usr/bin/keel")
endif()
find_program(SYSTEMD_ANALYZE systemd-analyze)
if(SYSTEMD_ANALYZE)
  file(READ ${unit} unit_text)
  string(REPLACE "\nExecStart=/usr/bin/keel " "\nExecStart=${usr}/bin/keel " unit_text "${unit_text}")
  file(WRITE ${WORK}/unit/keel-worker@.service "${unit_text}")
  execute_process(COMMAND ${SYSTEMD_ANALYZE} verify ${WORK}/unit/keel-worker@test.service
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc OR NOT out STREQUAL "")
    message(FATAL_ERROR "systemd-analyze verify of the packaged unit: ${rc}\n${out}")
  endif()
endif()

# The copyright file: keel's licence, and uPlot's from its npm package when the package has it.
file(READ ${usr}/share/doc/keel/copyright copyright)
if(NOT copyright MATCHES "^Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
   OR NOT copyright MATCHES "\nFiles: \\*\nCopyright: [^\n]+\nLicense: MIT\n")
  message(FATAL_ERROR "usr/share/doc/keel/copyright has no keel paragraph:\n${copyright}")
endif()
if(EXISTS ${usr}/share/keel/web/node_modules/uplot)
  if(NOT copyright MATCHES "\nFiles: web/node_modules/uplot/\\*\n")
    message(FATAL_ERROR "the package bundles uPlot, its copyright file has no paragraph for it")
  endif()
  file(STRINGS ${KEEL_SOURCE}/web/node_modules/uplot/LICENSE license_lines REGEX "[^ \t]")
  foreach(line IN LISTS license_lines)
    string(FIND "${copyright}" "\n ${line}\n" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "uPlot's LICENSE line '${line}' is not in the copyright file")
    endif()
  endforeach()
endif()

# lintian, where it is installed: no error, except malformed-contact while the project has no
# maintainer address (KEEL_PACKAGE_CONTACT, cmake/KeelCPack.cmake).
find_program(LINTIAN lintian)
if(LINTIAN)
  execute_process(COMMAND ${LINTIAN} --allow-root ${deb_keel} ${deb_libkeel-dev}
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "lintian:\n${out}")
  string(REGEX MATCHALL "E: [^\n]+" errors "${out}")
  list(FILTER errors EXCLUDE REGEX "^E: [^:]+: malformed-contact ")
  if(errors)
    message(FATAL_ERROR "lintian errors: ${errors}")
  endif()
else()
  message(STATUS "lintian not found: not run")
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

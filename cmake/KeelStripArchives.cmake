# Strips the debug information from keel's static libraries under KEEL_STRIP_ROOT with
# KEEL_STRIP, as Debian strips a -dev package's static libraries (strip --strip-debug: the symbol
# tables stay, a program still links against them; deterministic archive headers). Included at
# install time by `cmake --install --strip` (CMakeLists.txt) and before a Debian package is made
# (cmake/KeelCPackPreBuild.cmake). The debug information of a static library cannot be split into
# a -dbgsym package (it has no build ID; the program linked against it carries its own).
if(NOT KEEL_STRIP)
  message(FATAL_ERROR "no strip program (CMAKE_STRIP) to strip keel's static libraries with")
endif()
file(GLOB_RECURSE keel_archives "${KEEL_STRIP_ROOT}/libkeel_*.a")
foreach(keel_archive IN LISTS keel_archives)
  execute_process(COMMAND "${KEEL_STRIP}" --strip-debug --enable-deterministic-archives
                          "${keel_archive}"
                  RESULT_VARIABLE keel_strip_rc ERROR_VARIABLE keel_strip_err)
  if(keel_strip_rc)
    message(FATAL_ERROR "strip --strip-debug ${keel_archive}: ${keel_strip_err}")
  endif()
endforeach()
list(LENGTH keel_archives keel_archive_count)
message(STATUS "Stripped the debug information of ${keel_archive_count} static libraries")

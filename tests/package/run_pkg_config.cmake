# ctest -P script: install the already-built tree into WORK/prefix with --strip (with READELF,
# check that the installed keel binary has no symbol table or debug sections left), then build and run programs
# against it with pkg-config alone (PKG_CONFIG_PATH=WORK/prefix/LIBDIR/pkgconfig, no CMake
# package): tests/package/consumer with `pkg-config --cflags --libs keel`, and, with ADAPTERS,
# tests/package/adapters with the module of every adapter it uses.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${KEEL_BUILD} --prefix ${WORK}/prefix --strip
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install --strip failed: ${rc}")
endif()
set(keel_binary ${WORK}/prefix/bin/keel)
if(READELF AND EXISTS ${keel_binary})
  execute_process(COMMAND ${READELF} -S --wide ${keel_binary} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE sections)
  if(rc OR sections MATCHES "\\.(symtab|debug_info)")
    message(FATAL_ERROR "install --strip left ${keel_binary} unstripped (readelf: ${rc})")
  endif()
  message(STATUS "${keel_binary} is stripped")
endif()
if(IS_ABSOLUTE "${LIBDIR}")
  message(FATAL_ERROR "an absolute CMAKE_INSTALL_LIBDIR (${LIBDIR}) is not under the scratch prefix")
endif()
set(ENV{PKG_CONFIG_PATH} ${WORK}/prefix/${LIBDIR}/pkgconfig)

# The .pc files carry the prefix of the install that wrote them.
execute_process(COMMAND ${PKG_CONFIG} --variable=prefix keel RESULT_VARIABLE rc
                OUTPUT_VARIABLE prefix OUTPUT_STRIP_TRAILING_WHITESPACE)
if(rc OR NOT prefix STREQUAL "${WORK}/prefix")
  message(FATAL_ERROR "keel.pc: prefix '${prefix}' (${rc}), expected ${WORK}/prefix")
endif()

# build_with(<program> <modules> <source>...): compile and link with pkg-config's flags, then run.
function(build_with program modules)
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs ${modules} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE flags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(rc)
    message(FATAL_ERROR "pkg-config --cflags --libs ${modules} failed: ${err}")
  endif()
  message(STATUS "pkg-config --cflags --libs ${modules}: ${flags}")
  separate_arguments(flags UNIX_COMMAND "${flags}")
  execute_process(COMMAND ${CXX} -std=c++20 ${ARGN} ${flags} -o ${WORK}/${program}
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "building ${program} with pkg-config's flags failed: ${rc}")
  endif()
  execute_process(COMMAND ${WORK}/${program} RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  message(STATUS "${program} said: ${out}")
  if(rc)
    message(FATAL_ERROR "${program} failed: ${rc}")
  endif()
endfunction()

set(sources ${KEEL_SOURCE}/tests/package)
build_with(consumer keel ${sources}/consumer/main.cpp)
if(ADAPTERS)
  build_with(adapters
             "keel-http;keel-store;keel-store-http;keel-store-handlers;keel-store-webhook;keel-store-beast;keel-sim;keel-asio;keel-metrics"
             ${sources}/adapters/main.cpp ${sources}/adapters/metrics.cpp
             ${sources}/adapters/beast.cpp)
endif()

cmake_minimum_required(VERSION 3.25)
# ctest -P script: what find_package(keel COMPONENTS ...) and the .pc files bring, from the
# default install of the already-built tree into WORK/prefix (tests/package/components):
#
# 1. A queue-only program (find_package(keel REQUIRED COMPONENTS store)) configures, builds and
#    runs where CURL, nlohmann_json, prometheus-cpp and Boost cannot be found
#    (CMAKE_DISABLE_FIND_PACKAGE_<name> fails any find_package call for them) and pkg-config finds
#    no module at all (PKG_CONFIG_LIBDIR an empty folder: no cpp-httplib). This proves keel's
#    package looked for none of them, and the program (READELF) needs none of their libraries.
#    It does not prove the libraries are absent from the machine: they are installed here.
# 2. The same view refuses find_package(keel REQUIRED COMPONENTS http), naming CURL: the view
#    does hide what it claims to.
# 3. Each installed component alone loads exactly itself and the keel targets it links, and
#    defines every target they link (tests/package/components/each).
# 4. Each .pc file Requires exactly the modules of what its target links, as its CMake imported
#    target says (3. writes them): keel targets by their module, third-party ones by theirs;
#    Threads as -pthread in Libs.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${KEEL_BUILD} --prefix ${WORK}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
set(package_dir ${WORK}/prefix/${LIBDIR}/cmake/keel)
file(GLOB target_files RELATIVE ${package_dir} ${package_dir}/keel-*-targets.cmake)
set(components "")
foreach(file IN LISTS target_files)
  string(REGEX REPLACE "^keel-(.*)-targets\\.cmake$" "\\1" component ${file})
  list(APPEND components ${component})
endforeach()
list(SORT components)
if(NOT "store_queue" IN_LIST components OR NOT "http" IN_LIST components)
  message(FATAL_ERROR "no keel-store_queue or keel-http targets file in ${package_dir}: ${components}")
endif()
message(STATUS "installed components: ${components}")
set(hide "CURL;nlohmann_json;prometheus-cpp;Boost")
set(source ${KEEL_SOURCE}/tests/package/components)

# 1.
file(MAKE_DIRECTORY ${WORK}/no-pkg-config-modules)
set(ENV{PKG_CONFIG_LIBDIR} ${WORK}/no-pkg-config-modules)
set(ENV{PKG_CONFIG_PATH} "")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${source} -B ${WORK}/build-queue -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix
                        "-DKEEL_HIDE=${hide}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "configuring the queue-only consumer failed: ${rc}\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build-queue
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the queue-only consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK}/build-queue/queue/queue_consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "queue_consumer said: ${out}")
if(rc)
  message(FATAL_ERROR "the queue-only consumer failed: ${rc}")
endif()
if(READELF)
  execute_process(COMMAND ${READELF} -d ${WORK}/build-queue/queue/queue_consumer OUTPUT_VARIABLE dynamic)
  if(dynamic MATCHES "NEEDED[^\n]*(libcurl|httplib|prometheus|libbrotli)")
    message(FATAL_ERROR "the queue-only consumer needs ${CMAKE_MATCH_1}:\n${dynamic}")
  endif()
endif()

# 2.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${source} -B ${WORK}/build-http -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix
                        "-DKEEL_HIDE=${hide}" -DKEEL_QUEUE_COMPONENT=http
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc OR NOT out MATCHES "keel::http_attempt needs CURL")
  message(FATAL_ERROR "find_package(keel COMPONENTS http) without CURL did not fail naming it "
                      "(${rc}):\n${out}")
endif()
unset(ENV{PKG_CONFIG_LIBDIR})

# 3.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${source} -B ${WORK}/build -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix
                        -DKEEL_QUEUE_COMPONENT= "-DKEEL_EACH=${components}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "loading each component alone failed: ${rc}\n${out}")
endif()

# 4.
set(ENV{PKG_CONFIG_PATH} ${WORK}/prefix/${LIBDIR}/pkgconfig)
function(module_of target var)
  set(module "")
  if(target MATCHES "^keel::core$")
    set(module keel)
  elseif(target MATCHES "^keel::(.*)$")
    string(REPLACE "_" "-" module "keel-${CMAKE_MATCH_1}")
  elseif(target STREQUAL "CURL::libcurl")
    set(module libcurl)
  elseif(target STREQUAL "OpenSSL::Crypto")
    set(module libcrypto)
  elseif(target STREQUAL "SQLite::SQLite3")
    set(module sqlite3)
  elseif(target STREQUAL "PostgreSQL::PostgreSQL")
    set(module libpq)
  elseif(target STREQUAL "prometheus-cpp::core")
    set(module prometheus-cpp-core)
  elseif(target STREQUAL "PkgConfig::KEEL_HTTPLIB")
    set(module cpp-httplib)
  elseif(target STREQUAL "PkgConfig::KEEL_IDN2")
    set(module libidn2)
  elseif(target STREQUAL "nlohmann_json::nlohmann_json")
    set(module nlohmann_json)
  elseif(NOT target MATCHES "^(Threads::Threads|Boost::headers)$")
    message(FATAL_ERROR "run_components.cmake knows no pkg-config module for ${target}")
  endif()
  set(${var} "${module}" PARENT_SCOPE)
endfunction()
foreach(component IN LISTS components)
  file(READ ${WORK}/build/links-${component}.txt links)
  set(expected "")
  set(pthread FALSE)
  foreach(item IN LISTS links)
    string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" item "${item}")
    if(item STREQUAL "")  # $<LINK_ONLY:> is what a $<BUILD_INTERFACE:...> one becomes
      continue()
    endif()
    if(item STREQUAL "Threads::Threads")
      set(pthread TRUE)
    endif()
    module_of("${item}" module)
    if(module AND NOT module IN_LIST expected)
      list(APPEND expected ${module})
    endif()
  endforeach()
  module_of(keel::${component} pc)
  execute_process(COMMAND ${PKG_CONFIG} --print-requires ${pc} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE requires ERROR_VARIABLE err)
  if(rc)
    message(FATAL_ERROR "pkg-config --print-requires ${pc}: ${err}")
  endif()
  string(REGEX REPLACE "[ \t]*[<>=]+[^\n]*" "" requires "${requires}")
  string(STRIP "${requires}" requires)
  string(REPLACE "\n" ";" requires "${requires}")
  list(SORT requires)
  list(SORT expected)
  if(NOT requires STREQUAL expected)
    message(FATAL_ERROR "${pc}.pc Requires '${requires}'; keel::${component} links '${links}', "
                        "whose modules are '${expected}'")
  endif()
  execute_process(COMMAND ${PKG_CONFIG} --libs ${pc} OUTPUT_VARIABLE libs)
  if(pthread AND NOT libs MATCHES "-pthread")
    message(FATAL_ERROR "keel::${component} links Threads, but ${pc}.pc's Libs have no -pthread")
  endif()
  message(STATUS "${pc}.pc Requires ${requires}: what keel::${component} links")
endforeach()

# Helpers for keel's library targets, so that each adapter's CMakeLists.txt says only what is its
# own (sources, dependencies) and not the shape every keel target shares.
include_guard(GLOBAL)
include(GNUInstallDirs)

# keel_add_library(<name> <source>...): the static library keel_<name>, alias keel::<name>,
# exported as keel::<name>, position-independent, C++20, with keel's public include directory.
function(keel_add_library name)
  add_library(keel_${name} ${ARGN})
  add_library(keel::${name} ALIAS keel_${name})
  set_target_properties(keel_${name} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME keel_${name}
                        POSITION_INDEPENDENT_CODE ON)
  target_include_directories(keel_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_features(keel_${name} PUBLIC cxx_std_20)
endfunction()

# keel_install_libraries(DEPS_FILE <name> TARGETS <target>... [DEPENDENCIES <package>...]):
# when KEEL_INSTALL is on, installs the targets into the keel-targets export set and writes
# keel-<name>-deps.cmake (read by keel-config.cmake) with one find_dependency(<package>) per
# dependency: a static keel library needs its private dependencies found by consumers.
function(keel_install_libraries)
  cmake_parse_arguments(ARG "" "DEPS_FILE" "TARGETS;DEPENDENCIES" ${ARGN})
  if(NOT KEEL_INSTALL)
    return()
  endif()
  install(TARGETS ${ARG_TARGETS} EXPORT keel-targets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  if(ARG_DEPENDENCIES)
    set(lines "")
    foreach(dependency IN LISTS ARG_DEPENDENCIES)
      string(APPEND lines "find_dependency(${dependency})\n")
    endforeach()
    file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/keel-${ARG_DEPS_FILE}-deps.cmake "${lines}")
    install(FILES ${CMAKE_CURRENT_BINARY_DIR}/keel-${ARG_DEPS_FILE}-deps.cmake
            DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/keel)
  endif()
endfunction()

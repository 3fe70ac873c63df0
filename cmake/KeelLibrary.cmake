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

# keel_install_libraries(DEPS_FILE <name> TARGETS <target>... [DEPENDENCIES <line>...]
#                        [LINES <line>...] [COMPONENT <component> HEADERS <folder>]):
# when KEEL_INSTALL is on, installs the targets into the keel-targets export set and writes
# keel-<name>-deps.cmake (read by keel-config.cmake) with one find_dependency(<line>) per
# dependency and then the LINES as they are: a static keel library needs its private
# dependencies found by consumers. With COMPONENT the targets, the deps file and
# include/keel/<folder> go into that install component instead, which the default install leaves
# out (EXCLUDE_FROM_ALL: only `cmake --install <build> --component <component>` installs it),
# with an export set of their own, keel-<component>-targets.cmake, that keel-config.cmake loads
# only when it is there.
function(keel_install_libraries)
  cmake_parse_arguments(ARG "" "DEPS_FILE;COMPONENT;HEADERS" "TARGETS;DEPENDENCIES;LINES" ${ARGN})
  if(NOT KEEL_INSTALL)
    return()
  endif()
  set(export keel-targets)
  set(component "")
  if(ARG_COMPONENT)
    set(export keel-${ARG_COMPONENT}-targets)
    set(component COMPONENT ${ARG_COMPONENT} EXCLUDE_FROM_ALL)
  endif()
  install(TARGETS ${ARG_TARGETS} EXPORT ${export}
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} ${component}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} ${component})
  if(ARG_COMPONENT)
    install(EXPORT ${export} NAMESPACE keel:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/keel
            ${component})
  endif()
  if(ARG_HEADERS)
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/keel/${ARG_HEADERS}
            DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/keel ${component} PATTERN "detail" EXCLUDE)
  endif()
  if(ARG_DEPENDENCIES OR ARG_LINES)
    set(lines "")
    foreach(dependency IN LISTS ARG_DEPENDENCIES)
      string(APPEND lines "find_dependency(${dependency})\n")
    endforeach()
    foreach(line IN LISTS ARG_LINES)
      string(APPEND lines "${line}\n")
    endforeach()
    file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/keel-${ARG_DEPS_FILE}-deps.cmake "${lines}")
    install(FILES ${CMAKE_CURRENT_BINARY_DIR}/keel-${ARG_DEPS_FILE}-deps.cmake
            DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/keel ${component})
  endif()
endfunction()

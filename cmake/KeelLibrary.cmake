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

# keel_install_targets(<target>... [COMPONENT <component> HEADERS <folder>]):
# when KEEL_INSTALL is on, installs each target (its archive, if it has one) into an export set of
# its own, keel-<export name>-targets, and records it for cmake/KeelPackage.cmake, which writes,
# from the target's installed link interface, what find_package(keel COMPONENTS <export name>)
# loads (that export set, and the find_package calls of the third-party libraries it links) and
# its pkg-config file. Nothing else is said here: the dependencies are those the target links.
#
# Without COMPONENT the files belong to the install component `dev` (the headers, libraries and
# package files a program built against keel needs). With COMPONENT they, and
# include/keel/<folder>, go into that install component instead, which the default install leaves
# out (EXCLUDE_FROM_ALL: only `cmake --install <build> --component <component>` installs it).
function(keel_install_targets)
  cmake_parse_arguments(ARG "" "COMPONENT;HEADERS" "" ${ARGN})
  if(NOT KEEL_INSTALL)
    return()
  endif()
  set(component COMPONENT dev)
  if(ARG_COMPONENT)
    set(component COMPONENT ${ARG_COMPONENT} EXCLUDE_FROM_ALL)
  endif()
  foreach(target IN LISTS ARG_UNPARSED_ARGUMENTS)
    get_target_property(name ${target} EXPORT_NAME)
    install(TARGETS ${target} EXPORT keel-${name}-targets
            ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} ${component}
            LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} ${component})
    set_property(TARGET ${target} PROPERTY KEEL_INSTALL_COMPONENT "${ARG_COMPONENT}")
    set_property(GLOBAL APPEND PROPERTY KEEL_INSTALLED_TARGETS ${target})
  endforeach()
  if(ARG_HEADERS)
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/keel/${ARG_HEADERS}
            DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/keel ${component} PATTERN "detail" EXCLUDE)
  endif()
endfunction()

# pkg-config files for keel's installed libraries, next to the CMake package: keel.pc for
# keel::core and keel-<component>.pc for each adapter (keel-http.pc, keel-store-http.pc ...),
# installed to ${CMAKE_INSTALL_LIBDIR}/pkgconfig.
#
# Each file is written when it is installed, with the prefix of that install (`cmake --install
# build --prefix P` writes prefix=P, a DESTDIR is left out as it should be), from a template
# filled in at configure time from cmake/keel.pc.in.
#
# keel's libraries are static archives unless BUILD_SHARED_LIBS is on. A static archive does not
# record its own dependencies, so every library its link needs (libcurl, libpq, sqlite3 ...) is
# in Requires/Libs and a plain `pkg-config --libs` links; with shared libraries they go to
# Requires.private/Libs.private, as pkg-config intends. Modules whose headers the public headers
# include (cpp-httplib, prometheus-cpp) are always in Requires.
include_guard(GLOBAL)
include(GNUInstallDirs)

# keel_pkg_config(<name> DESCRIPTION <text> TARGETS <target>... [REQUIRES <module>...]
#                 [LINKS <module>...] [LINK_FLAGS <flag>...] [CFLAGS <flag>...]
#                 [COMPONENT <component>]):
# <name>.pc for the libraries of TARGETS (their OUTPUT_NAME). REQUIRES: pkg-config modules the
# public headers need (other keel modules, cpp-httplib ...); LINKS: modules only the link needs;
# LINK_FLAGS: flags only the link needs (-pthread). With COMPONENT the file belongs to that
# install component, left out of the default install.
function(keel_pkg_config name)
  cmake_parse_arguments(ARG "" "DESCRIPTION;COMPONENT" "TARGETS;REQUIRES;LINKS;LINK_FLAGS;CFLAGS"
                        ${ARGN})
  set(KEEL_PC_NAME ${name})
  set(KEEL_PC_DESCRIPTION "${ARG_DESCRIPTION}")
  # Filled in at install time (see the install(CODE) below).
  set(KEEL_PC_PREFIX "@KEEL_PC_INSTALL_PREFIX@")
  foreach(dir LIBDIR INCLUDEDIR)
    if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
      set(KEEL_PC_${dir} "${CMAKE_INSTALL_${dir}}")
    else()
      set(KEEL_PC_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
    endif()
  endforeach()
  set(libs "")
  foreach(target IN LISTS ARG_TARGETS)
    get_target_property(output_name ${target} OUTPUT_NAME)
    if(NOT output_name)
      set(output_name ${target})
    endif()
    string(APPEND libs " -l${output_name}")
  endforeach()
  set(requires ${ARG_REQUIRES})
  set(requires_private "")
  set(libs_private "")
  if(BUILD_SHARED_LIBS)
    list(APPEND requires_private ${ARG_LINKS})
    list(JOIN ARG_LINK_FLAGS " " libs_private)
  else()
    list(APPEND requires ${ARG_LINKS})
    foreach(flag IN LISTS ARG_LINK_FLAGS)
      string(APPEND libs " ${flag}")
    endforeach()
  endif()
  list(REMOVE_DUPLICATES requires)
  list(JOIN requires ", " KEEL_PC_REQUIRES)
  list(JOIN requires_private ", " KEEL_PC_REQUIRES_PRIVATE)
  set(KEEL_PC_LIBS "${libs}")
  set(KEEL_PC_LIBS_PRIVATE "${libs_private}")
  set(KEEL_PC_CFLAGS "")
  foreach(flag IN LISTS ARG_CFLAGS)
    string(APPEND KEEL_PC_CFLAGS " ${flag}")
  endforeach()
  set(template ${PROJECT_BINARY_DIR}/pkgconfig/${name}.pc.in)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/keel.pc.in ${template} @ONLY)

  set(component "")
  if(ARG_COMPONENT)
    set(component COMPONENT ${ARG_COMPONENT} EXCLUDE_FROM_ALL)
  endif()
  if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
    set(destination "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  else()
    set(destination "\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  endif()
  install(CODE "
    set(KEEL_PC_INSTALL_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
    file(READ \"${template}\" keel_pc)
    string(CONFIGURE \"\${keel_pc}\" keel_pc @ONLY)
    set(keel_pc_file \"\$ENV{DESTDIR}${destination}/${name}.pc\")
    message(STATUS \"Installing: \${keel_pc_file}\")
    file(WRITE \"\${keel_pc_file}\" \"\${keel_pc}\")
    list(APPEND CMAKE_INSTALL_MANIFEST_FILES \"\${keel_pc_file}\")
  " ${component})
endfunction()

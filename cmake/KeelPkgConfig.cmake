# pkg-config files for keel's installed libraries, next to the CMake package: keel.pc for
# keel::core and keel-<component>.pc for each adapter (keel-http.pc, keel-store-http.pc ...),
# installed to ${CMAKE_INSTALL_LIBDIR}/pkgconfig.
#
# Each file is written when it is installed, with the prefix of that install (`cmake --install
# build --prefix P` writes prefix=P, a DESTDIR is left out as it should be), from a template
# filled in at configure time from cmake/keel.pc.in.
#
# Each file Requires what its target links and nothing more (keel_pkg_config below reads the
# target's link interface): keel-store-queue.pc requires keel-store-db, keel-store-json and
# libcrypto, not the HTTP client's libcurl. keel's libraries are static archives unless
# BUILD_SHARED_LIBS is on. A static archive does not record its own dependencies, so every library
# its link needs (libcurl, libpq, sqlite3 ...) is in Requires/Libs and a plain `pkg-config --libs`
# links; with shared libraries the link-only ones go to Requires.private/Libs.private, as
# pkg-config intends. Modules whose headers the public headers include (cpp-httplib,
# prometheus-cpp) are always in Requires.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(${CMAKE_CURRENT_LIST_DIR}/KeelPackage.cmake)

# keel_pkg_config_module(<target> <var>): the pkg-config module of an installed keel target.
function(keel_pkg_config_module target var)
  get_target_property(name ${target} EXPORT_NAME)
  if(name STREQUAL "core")
    set(${var} keel PARENT_SCOPE)
  else()
    string(REPLACE "_" "-" name "${name}")
    set(${var} keel-${name} PARENT_SCOPE)
  endif()
endfunction()

# keel_pkg_config(<target> DESCRIPTION <text> [NAME <module>] [CFLAGS <flag>...]):
# <module>.pc for the installed keel target <target>: its library (OUTPUT_NAME; none for an
# INTERFACE target such as the keel::store umbrella) and, in Requires, the modules of exactly what
# it links, read from its installed link interface (cmake/KeelPackage.cmake): the keel targets'
# modules and the third-party libraries' (PC, or PC_LIBS flags such as -pthread). NAME: the
# module, by default keel-<export name> with "-" for "_" (keel for keel::core). The file belongs
# to the target's install component.
function(keel_pkg_config target)
  cmake_parse_arguments(ARG "" "DESCRIPTION;NAME" "CFLAGS" ${ARGN})
  set(name ${ARG_NAME})
  if(NOT name)
    keel_pkg_config_module(${target} name)
  endif()
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
  get_target_property(type ${target} TYPE)
  if(NOT type STREQUAL "INTERFACE_LIBRARY")
    get_target_property(output_name ${target} OUTPUT_NAME)
    if(NOT output_name)
      set(output_name ${target})
    endif()
    string(APPEND libs " -l${output_name}")
  endif()
  # A static archive does not record its own dependencies: what its link needs (LINK_ONLY in its
  # link interface) goes to Requires and Libs too; for a shared library, to the .private fields.
  _keel_links(${target} keel third)
  set(requires "")
  set(requires_private "")
  set(libs_private "")
  foreach(entry IN LISTS keel third)
    set(private FALSE)
    if(entry MATCHES "^(.*)\\|private$")
      set(entry "${CMAKE_MATCH_1}")
      set(private ${BUILD_SHARED_LIBS})
    endif()
    set(modules "")
    set(flags "")
    if(TARGET ${entry} AND entry MATCHES "^keel_")
      keel_pkg_config_module(${entry} modules)
    else()
      get_property(modules GLOBAL PROPERTY KEEL_THIRD_PARTY_${entry}_PC)
      get_property(flags GLOBAL PROPERTY KEEL_THIRD_PARTY_${entry}_PC_LIBS)
    endif()
    if(private)
      list(APPEND requires_private ${modules})
      foreach(flag IN LISTS flags)
        string(APPEND libs_private " ${flag}")
      endforeach()
    else()
      list(APPEND requires ${modules})
      foreach(flag IN LISTS flags)
        string(APPEND libs " ${flag}")
      endforeach()
    endif()
  endforeach()
  list(REMOVE_DUPLICATES requires)
  list(REMOVE_DUPLICATES requires_private)
  list(JOIN requires ", " KEEL_PC_REQUIRES)
  list(JOIN requires_private ", " KEEL_PC_REQUIRES_PRIVATE)
  set(KEEL_PC_LIBS "${libs}")
  string(STRIP "${libs_private}" KEEL_PC_LIBS_PRIVATE)
  set(KEEL_PC_CFLAGS "")
  foreach(flag IN LISTS ARG_CFLAGS)
    string(APPEND KEEL_PC_CFLAGS " ${flag}")
  endforeach()
  set(template ${PROJECT_BINARY_DIR}/pkgconfig/${name}.pc.in)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/keel.pc.in ${template} @ONLY)

  get_target_property(install_component ${target} KEEL_INSTALL_COMPONENT)
  set(component COMPONENT dev)
  if(install_component)
    set(component COMPONENT ${install_component} EXCLUDE_FROM_ALL)
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

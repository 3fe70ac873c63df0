# What find_package(keel) and pkg-config read, written from each installed target's link
# interface (the targets keel_install_targets() recorded, cmake/KeelLibrary.cmake), so that a
# component brings the dependencies its libraries link and nothing else:
#
#   keel-<name>-targets.cmake  the imported target keel::<name> (one export set per target)
#   keel-<name>-deps.cmake     a find call per third-party library keel::<name> links
#   keel-config.cmake          loads, for the components asked for, those of the components they
#                              link and their dependencies, nothing more (cmake/keel-config.cmake.in)
#   <module>.pc                Requires: the modules of what keel::<name> links (cmake/keel.pc.in)
#
# The third-party libraries keel links are listed once, below: how a consumer finds each one with
# CMake, its pkg-config module, and the Debian package with its headers and library (the
# package's Depends, cmake/KeelCPack.cmake). A target that links a library missing from the list
# stops the configuration.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# keel_third_party(<imported target> [FIND <find_package arguments>]
#                  [PKG_CONFIG <module>] [PC <module>] [PC_LIBS <flag>...] [DEB <package>]):
# FIND: how keel-config.cmake finds it (find_package(<arguments>)); PKG_CONFIG: found instead as
# pkg_check_modules(<prefix> IMPORTED_TARGET <module>), the target being PkgConfig::<prefix>;
# PC: the module a .pc file Requires; PC_LIBS: link flags instead of a module; DEB: the Debian
# package.
function(keel_third_party target)
  cmake_parse_arguments(ARG "" "PKG_CONFIG;PC;DEB" "FIND;PC_LIBS" ${ARGN})
  set_property(GLOBAL PROPERTY KEEL_THIRD_PARTY_${target} TRUE)
  foreach(field FIND PKG_CONFIG PC PC_LIBS DEB)
    set_property(GLOBAL PROPERTY KEEL_THIRD_PARTY_${target}_${field} "${ARG_${field}}")
  endforeach()
endfunction()

keel_third_party(Threads::Threads FIND Threads PC_LIBS -pthread)
keel_third_party(CURL::libcurl FIND CURL PC libcurl DEB "libcurl4-openssl-dev | libcurl-dev")
keel_third_party(OpenSSL::Crypto FIND OpenSSL PC libcrypto DEB libssl-dev)
keel_third_party(SQLite::SQLite3 FIND SQLite3 PC sqlite3 DEB libsqlite3-dev)
keel_third_party(PostgreSQL::PostgreSQL FIND PostgreSQL PC libpq DEB libpq-dev)
keel_third_party(prometheus-cpp::core FIND prometheus-cpp CONFIG PC prometheus-cpp-core
                 DEB prometheus-cpp-dev)
# Header-only (Beast, Asio): in the compiler's include path, no pkg-config module in Debian.
keel_third_party(Boost::headers FIND Boost 1.74 DEB libboost-dev)
keel_third_party(nlohmann_json::nlohmann_json FIND nlohmann_json 3 CONFIG PC nlohmann_json
                 DEB nlohmann-json3-dev)
# libidn2: internationalised host names to their ASCII form (keel::http_attempt's parse_url).
keel_third_party(PkgConfig::KEEL_IDN2 PKG_CONFIG libidn2 PC libidn2 DEB libidn2-dev)
# cpp-httplib: Debian's library, through pkg-config (cmake/KeelHttplib.cmake).
keel_third_party(PkgConfig::KEEL_HTTPLIB PKG_CONFIG cpp-httplib PC cpp-httplib
                 DEB libcpp-httplib-dev)
# gRPC C++ (keel::grpc, the install component grpc); its package finds protobuf and Abseil.
keel_third_party(gRPC::grpc++ FIND gRPC CONFIG PC grpc++ DEB libgrpc++-dev)

# _keel_links(<target> <keel var> <third-party var>): what the installed <target> links, as its
# export writes it: the keel targets (installed ones) and the third-party targets, each entry
# "<name>" or "<name>|private" (LINK_ONLY: needed by the link of a static library, not by the
# headers). $<BUILD_INTERFACE:...> entries are the build tree's only.
function(_keel_links target keel_var third_var)
  get_property(installed GLOBAL PROPERTY KEEL_INSTALLED_TARGETS)
  get_target_property(items ${target} INTERFACE_LINK_LIBRARIES)
  if(NOT items)
    set(items "")
  endif()
  set(keel "")
  set(third "")
  foreach(item IN LISTS items)
    set(suffix "")
    if(item MATCHES "^\\$<LINK_ONLY:(.*)>$")
      set(item "${CMAKE_MATCH_1}")
      set(suffix "|private")
    endif()
    if(item MATCHES "^\\$<BUILD_INTERFACE:")
      continue()
    endif()
    if(item MATCHES "^\\$<INSTALL_INTERFACE:(.*)>$")
      set(item "${CMAKE_MATCH_1}")
    endif()
    if(item MATCHES "^\\$<")
      message(FATAL_ERROR "${target} links ${item}: cmake/KeelPackage.cmake does not know how "
                          "to install that")
    endif()
    set(real "${item}")
    if(TARGET "${item}")
      get_target_property(aliased "${item}" ALIASED_TARGET)
      if(aliased)
        set(real "${aliased}")
      endif()
    endif()
    get_property(known GLOBAL PROPERTY KEEL_THIRD_PARTY_${item})
    if(real IN_LIST installed)
      list(APPEND keel "${real}${suffix}")
    elseif(known)
      list(APPEND third "${item}${suffix}")
    else()
      message(FATAL_ERROR "${target} links ${item}, which is neither an installed keel target "
                          "nor a third-party library listed in cmake/KeelPackage.cmake")
    endif()
  endforeach()
  set(${keel_var} "${keel}" PARENT_SCOPE)
  set(${third_var} "${third}" PARENT_SCOPE)
endfunction()

# _keel_name(<target> <var>): keel::<name>'s <name> (its EXPORT_NAME).
function(_keel_name target var)
  get_target_property(name ${target} EXPORT_NAME)
  set(${var} ${name} PARENT_SCOPE)
endfunction()

# _keel_closure(<target> <var>): <target> and every installed keel target it links, directly or
# not, the linked ones first.
function(_keel_closure target var)
  set(result "")
  _keel_links(${target} keel third)
  foreach(entry IN LISTS keel)
    string(REGEX REPLACE "\\|private$" "" dep "${entry}")
    _keel_closure(${dep} sub)
    foreach(item IN LISTS sub)
      if(NOT item IN_LIST result)
        list(APPEND result ${item})
      endif()
    endforeach()
  endforeach()
  list(APPEND result ${target})
  set(${var} "${result}" PARENT_SCOPE)
endfunction()

# keel_install_package(): for every recorded target, its export set, its deps file and its part
# of keel-config.cmake (installed with the target's install component), then keel-config.cmake
# and its version file (install component dev).
function(keel_install_package)
  get_property(targets GLOBAL PROPERTY KEEL_INSTALLED_TARGETS)
  set(destination ${CMAKE_INSTALL_LIBDIR}/cmake/keel)
  set(order "")
  foreach(target IN LISTS targets)
    _keel_closure(${target} closure)
    foreach(item IN LISTS closure)
      if(NOT item IN_LIST order)
        list(APPEND order ${item})
      endif()
    endforeach()
  endforeach()

  set(table "")
  set(names "")
  foreach(target IN LISTS order)
    _keel_name(${target} name)
    list(APPEND names ${name})
    get_target_property(component ${target} KEEL_INSTALL_COMPONENT)
    if(component)
      set(component_args COMPONENT ${component} EXCLUDE_FROM_ALL)
    else()
      set(component_args COMPONENT dev)
    endif()
    install(EXPORT keel-${name}-targets NAMESPACE keel:: DESTINATION ${destination}
            ${component_args})

    _keel_closure(${target} closure)
    set(closure_names "")
    foreach(item IN LISTS closure)
      _keel_name(${item} item_name)
      list(APPEND closure_names ${item_name})
    endforeach()
    string(APPEND table "set(_keel_closure_${name} ${closure_names})\n")

    _keel_links(${target} keel third)
    set(lines "")
    foreach(entry IN LISTS third)
      string(REGEX REPLACE "\\|private$" "" dependency "${entry}")
      get_property(find GLOBAL PROPERTY KEEL_THIRD_PARTY_${dependency}_FIND)
      get_property(module GLOBAL PROPERTY KEEL_THIRD_PARTY_${dependency}_PKG_CONFIG)
      if(module)
        string(REGEX REPLACE "^PkgConfig::" "" prefix "${dependency}")
        set(line "_keel_find_pkg_config(${prefix} ${module})")
      else()
        list(JOIN find " " find)
        set(line "_keel_find_dependency(${find})")
      endif()
      if(NOT line IN_LIST lines)
        list(APPEND lines "${line}")
      endif()
    endforeach()
    list(JOIN lines "\n" deps)
    set(deps_file ${PROJECT_BINARY_DIR}/package/keel-${name}-deps.cmake)
    file(WRITE ${deps_file}
         "# What keel::${name} links besides keel, found for find_package(keel COMPONENTS ${name})\n"
         "# (keel-config.cmake defines these macros).\n${deps}\n")
    install(FILES ${deps_file} DESTINATION ${destination} ${component_args})
  endforeach()

  set(KEEL_CONFIG_COMPONENTS "${names}")
  set(KEEL_CONFIG_CLOSURES "${table}")
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/keel-config.cmake.in
    ${PROJECT_BINARY_DIR}/keel-config.cmake
    INSTALL_DESTINATION ${destination})
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/keel-config-version.cmake
    COMPATIBILITY SameMinorVersion)
  install(FILES ${PROJECT_BINARY_DIR}/keel-config.cmake ${PROJECT_BINARY_DIR}/keel-config-version.cmake
          DESTINATION ${destination} COMPONENT dev)
endfunction()

# keel_debian_depends(<var>): the Debian packages whose headers and libraries the default
# install's libraries need (DEB of each third-party library they link), comma-separated.
function(keel_debian_depends var)
  get_property(targets GLOBAL PROPERTY KEEL_INSTALLED_TARGETS)
  set(packages "")
  foreach(target IN LISTS targets)
    get_target_property(component ${target} KEEL_INSTALL_COMPONENT)
    if(component)
      continue()
    endif()
    _keel_links(${target} keel third)
    foreach(entry IN LISTS third)
      string(REGEX REPLACE "\\|private$" "" dependency "${entry}")
      get_property(package GLOBAL PROPERTY KEEL_THIRD_PARTY_${dependency}_DEB)
      if(package AND NOT package IN_LIST packages)
        list(APPEND packages "${package}")
      endif()
    endforeach()
  endforeach()
  list(JOIN packages ", " result)
  set(${var} "${result}" PARENT_SCOPE)
endfunction()

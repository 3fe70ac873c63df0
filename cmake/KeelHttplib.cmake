# keel::httplib: cpp-httplib for every keel target that uses it (the one place that decides).
#
# By default it is Debian's compiled library (libcpp-httplib-dev, found through pkg-config).
# With KEEL_HTTPLIB_HEADER_ONLY_DIR set (the tsan preset sets it), it is instead the upstream
# single header httplib.h in that folder, Debian's source package of the same version extracted
# by scripts/httplib-source.sh: everything in it is inline, so cpp-httplib is compiled into each
# keel target with keel's flags (-fsanitize=thread) and ThreadSanitizer sees its synchronisation.
# The same features as Debian's library are enabled (its pkg-config Cflags: OpenSSL, zlib,
# Brotli; and CPPHTTPLIB_USE_POLL, which debian/rules builds it with).
set(KEEL_HTTPLIB_HEADER_ONLY_DIR "" CACHE PATH
    "Folder with cpp-httplib's single header httplib.h, used instead of Debian's libcpp-httplib")

find_package(PkgConfig REQUIRED)
if(KEEL_HTTPLIB_HEADER_ONLY_DIR STREQUAL "")
  pkg_check_modules(KEEL_HTTPLIB REQUIRED IMPORTED_TARGET GLOBAL cpp-httplib)
  add_library(keel::httplib ALIAS PkgConfig::KEEL_HTTPLIB)
  return()
endif()

set(_keel_httplib_header ${KEEL_HTTPLIB_HEADER_ONLY_DIR}/httplib.h)
if(NOT EXISTS ${_keel_httplib_header})
  message(FATAL_ERROR "KEEL_HTTPLIB_HEADER_ONLY_DIR: no httplib.h in ${KEEL_HTTPLIB_HEADER_ONLY_DIR}; "
                      "run scripts/httplib-source.sh ${KEEL_HTTPLIB_HEADER_ONLY_DIR} first")
endif()
# Debian's package still gives the version and the feature macros; the header must match both.
pkg_check_modules(KEEL_HTTPLIB REQUIRED cpp-httplib)
file(STRINGS ${_keel_httplib_header} _keel_httplib_version_line
     REGEX "^#define CPPHTTPLIB_VERSION \"[^\"]+\"")
string(REGEX REPLACE ".*\"([^\"]+)\".*" "\\1" _keel_httplib_version "${_keel_httplib_version_line}")
if(NOT _keel_httplib_version STREQUAL KEEL_HTTPLIB_VERSION)
  message(FATAL_ERROR "${_keel_httplib_header} is cpp-httplib '${_keel_httplib_version}', the "
                      "installed libcpp-httplib-dev is ${KEEL_HTTPLIB_VERSION}; rerun "
                      "scripts/httplib-source.sh ${KEEL_HTTPLIB_HEADER_ONLY_DIR}")
endif()

find_package(Threads REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(ZLIB REQUIRED)
pkg_check_modules(KEEL_HTTPLIB_BROTLI REQUIRED IMPORTED_TARGET GLOBAL libbrotlidec libbrotlienc)
# IMPORTED, so its include folder is a system one (no keel warnings for the library's code).
add_library(keel_httplib_header_only INTERFACE IMPORTED GLOBAL)
set_target_properties(keel_httplib_header_only PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES ${KEEL_HTTPLIB_HEADER_ONLY_DIR}
  INTERFACE_COMPILE_OPTIONS "${KEEL_HTTPLIB_CFLAGS_OTHER}"
  INTERFACE_COMPILE_DEFINITIONS CPPHTTPLIB_USE_POLL)
target_link_libraries(keel_httplib_header_only INTERFACE
  OpenSSL::SSL OpenSSL::Crypto ZLIB::ZLIB PkgConfig::KEEL_HTTPLIB_BROTLI Threads::Threads)
add_library(keel::httplib ALIAS keel_httplib_header_only)
message(STATUS "cpp-httplib ${_keel_httplib_version}: header-only from ${KEEL_HTTPLIB_HEADER_ONLY_DIR}")

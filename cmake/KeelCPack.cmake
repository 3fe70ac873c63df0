# A Debian package of the default install (`cpack -G DEB` in the build folder): the keel binary,
# the static libraries, the public headers, the CMake package and the pkg-config files, under
# /usr. keel::faults and keel-demo (install components left out of the default install) are not
# in it.
#
# Depends: the shared libraries the keel binary links (dpkg-shlibdeps), and the -dev packages
# whose headers and libraries a program built against keel's static libraries needs (the
# find_dependency() lines of keel-config.cmake, the Requires of the .pc files).
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME keel)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_PACKAGE_CONTACT "keel maintainers")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_STRIP_FILES ON)  # the keel binary without its symbol table and debug information
set(CPACK_DEBIAN_PACKAGE_DEPENDS
    "libcurl4-openssl-dev, libidn2-dev, libssl-dev, libsqlite3-dev, libpq-dev, libcpp-httplib-dev, prometheus-cpp-dev, nlohmann-json3-dev, libasio-dev, libboost-dev, pkg-config")
include(CPack)

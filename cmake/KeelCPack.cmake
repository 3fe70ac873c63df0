# Debian packages of the default install (`cpack -G DEB` in the build folder), one per install
# component, under /usr:
#
#   keel         the keel program, the explorer page, the systemd unit keel-worker@.service with
#                its sysusers entry (the user keel, created when the package is configured) and
#                an example environment file; Depends: the shared libraries the program links
#                (dpkg-shlibdeps)
#   keel-dbgsym  the keel program's debug information, split off by build ID
#                (/usr/lib/debug/.build-id/, where gdb and debuginfod look), so the program ships
#                stripped and a crash can still be read
#   libkeel-dev  headers, static libraries, the CMake package and the pkg-config files in the
#                multiarch folder; Depends: the -dev packages of the third-party libraries keel's
#                libraries link (cmake/KeelPackage.cmake derives them from their link interfaces)
#
# The static libraries are stripped of their debug information (cmake/KeelStripArchives.cmake),
# as Debian does for a -dev package: 149 MB of the install was theirs. Each package has
# /usr/share/doc/<package>/copyright (cmake/KeelCopyright.cmake) and a changelog.gz.
# keel::faults and keel-demo (install components left out of the default install) are in none.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME keel)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(KEEL_PACKAGE_CONTACT "keel maintainers" CACHE STRING
    "The Maintainer of keel's Debian packages: \"Name <address>\"")
set(CPACK_PACKAGE_CONTACT "${KEEL_PACKAGE_CONTACT}")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)

set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME keel)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION net)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_RUNTIME_DEBUGINFO_PACKAGE ON)  # strips the program, its debug info to -dbgsym
# The extended descriptions (the summary line is CPACK_PACKAGE_DESCRIPTION_SUMMARY's).
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION "The keel program: keel call (a retrying HTTP request), keel sim
(the retry-storm simulator and its explorer page), keel jobs and keel dlq
(the durable job queue on SQLite or PostgreSQL, its workers and dead
letters), and the systemd unit keel-worker@.service, a worker per queue.")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/cmake/deb/postinst ${PROJECT_SOURCE_DIR}/cmake/deb/postrm)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_STRICT_PERMISSION ON)

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libkeel-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_SHLIBDEPS OFF)
keel_debian_depends(keel_dev_depends)
if(TARGET keel::asio)
  string(APPEND keel_dev_depends ", libasio-dev")  # keel::asio's headers include Asio's
endif()
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "${keel_dev_depends}")
set(CPACK_DEBIAN_DEV_DESCRIPTION "Development files: keel's C++20 headers and static libraries, retry
policies, backoff with full jitter, budgets, circuit breakers and
deadlines (keel::core), the HTTP clients, the idempotency store and job
queue, the simulator and the metrics, with a CMake package
(find_package(keel COMPONENTS ...)) and pkg-config files.")

# Before the packages are made: the static libraries stripped, each package's copyright and
# changelog in its doc folder (cmake/KeelCPackPreBuild.cmake).
set(CPACK_KEEL_STRIP "${CMAKE_STRIP}")
set(CPACK_KEEL_DOCDIR "${CMAKE_INSTALL_DOCDIR}")
set(CPACK_PRE_BUILD_SCRIPTS ${PROJECT_SOURCE_DIR}/cmake/KeelCPackPreBuild.cmake)
include(CPack)
cpack_add_component(runtime DISPLAY_NAME "keel program")
cpack_add_component(dev DISPLAY_NAME "keel development files")

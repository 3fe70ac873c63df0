# Install time: deploy/systemd/keel-worker@.service (KEEL_UNIT_SOURCE) into
# PREFIX/lib/systemd/system, where systemd reads units under /usr and /usr/local, with its
# ExecStart naming the keel this install puts in KEEL_UNIT_BINDIR (relative to the prefix, or
# absolute): /usr/bin/keel in the Debian package, /usr/local/bin/keel for a plain
# `cmake --install build`. The source's ExecStart line must start with
# "ExecStart=/usr/local/bin/keel ", or the install fails rather than ship a unit that runs nothing.
set(keel_unit_bindir "${KEEL_UNIT_BINDIR}")
if(NOT IS_ABSOLUTE "${keel_unit_bindir}")
  set(keel_unit_bindir "${CMAKE_INSTALL_PREFIX}/${keel_unit_bindir}")
endif()
file(READ "${KEEL_UNIT_SOURCE}" keel_unit)
set(keel_unit_exec "\nExecStart=/usr/local/bin/keel ")
string(FIND "${keel_unit}" "${keel_unit_exec}" keel_unit_at)
if(keel_unit_at EQUAL -1)
  message(FATAL_ERROR "${KEEL_UNIT_SOURCE} has no line starting 'ExecStart=/usr/local/bin/keel ' "
                      "to point at ${keel_unit_bindir}/keel")
endif()
string(REPLACE "${keel_unit_exec}" "\nExecStart=${keel_unit_bindir}/keel " keel_unit "${keel_unit}")
get_filename_component(keel_unit_name "${KEEL_UNIT_SOURCE}" NAME)
set(keel_unit_file "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/lib/systemd/system/${keel_unit_name}")
message(STATUS "Installing: ${keel_unit_file}")
file(WRITE "${keel_unit_file}" "${keel_unit}")
list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${keel_unit_file}")

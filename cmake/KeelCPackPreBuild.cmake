# CPACK_PRE_BUILD_SCRIPTS of the Debian packages (cmake/KeelCPack.cmake), run once the install of
# every package is staged (CPACK_TEMPORARY_DIRECTORY/<component>/usr) and before the packages are
# made: strips the static libraries' debug information (cmake/KeelStripArchives.cmake) and gives
# each package /usr/share/doc/<package>/copyright (the one the install wrote for the keel
# program's package, cmake/KeelCopyright.cmake) and a changelog.gz naming the version (the
# release notes are CHANGELOG.md). The date is the packaging time, or SOURCE_DATE_EPOCH's.
set(keel_root "${CPACK_TEMPORARY_DIRECTORY}")
set(KEEL_STRIP "${CPACK_KEEL_STRIP}")
set(KEEL_STRIP_ROOT "${keel_root}/dev")
include(${CMAKE_CURRENT_LIST_DIR}/KeelStripArchives.cmake)

set(keel_copyright "${keel_root}/runtime${CPACK_PACKAGING_INSTALL_PREFIX}/${CPACK_KEEL_DOCDIR}/copyright")
if(NOT EXISTS "${keel_copyright}")
  message(FATAL_ERROR "the install wrote no ${keel_copyright}")
endif()
string(TIMESTAMP keel_date "%a, %d %b %Y %H:%M:%S +0000" UTC)
find_program(KEEL_GZIP gzip REQUIRED)
foreach(keel_component runtime dev)
  string(TOUPPER ${keel_component} keel_upper)
  set(keel_package "${CPACK_DEBIAN_${keel_upper}_PACKAGE_NAME}")
  set(keel_doc "${keel_root}/${keel_component}${CPACK_PACKAGING_INSTALL_PREFIX}/share/doc/${keel_package}")
  file(MAKE_DIRECTORY "${keel_doc}")
  if(NOT EXISTS "${keel_doc}/copyright")
    file(COPY_FILE "${keel_copyright}" "${keel_doc}/copyright")
  endif()
  file(WRITE "${keel_doc}/changelog"
       "${keel_package} (${CPACK_PACKAGE_VERSION}) unstable; urgency=medium\n\n"
       "  * keel ${CPACK_PACKAGE_VERSION}: its changes are in keel's CHANGELOG.md.\n\n"
       " -- ${CPACK_PACKAGE_CONTACT}  ${keel_date}\n")
  execute_process(COMMAND ${KEEL_GZIP} -9nf "${keel_doc}/changelog" RESULT_VARIABLE keel_rc)
  if(keel_rc)
    message(FATAL_ERROR "gzip ${keel_doc}/changelog failed: ${keel_rc}")
  endif()
endforeach()

# Install time: DOCDIR/copyright (KEEL_DOCDIR under the prefix), the licences of what the install
# holds in Debian's machine-readable format (cmake/copyright.in): keel's, then one paragraph per
# bundled third-party file set with its copyright line and its own licence text as its package
# ships it. Today that is uPlot, from its npm package (scripts/web_setup.sh, web/package-lock.json),
# installed beside the explorer page when it is there (tools/keel/CMakeLists.txt), so its
# paragraph is written under the same condition.
set(keel_bundled "")
set(keel_uplot "${KEEL_SOURCE}/web/node_modules/uplot")
if(EXISTS "${keel_uplot}/dist/uPlot.iife.min.js")
  foreach(keel_file LICENSE package.json)
    if(NOT EXISTS "${keel_uplot}/${keel_file}")
      message(FATAL_ERROR "uPlot is installed from ${keel_uplot} without its ${keel_file}")
    endif()
  endforeach()
  file(READ "${keel_uplot}/package.json" keel_uplot_package)
  string(JSON keel_uplot_version GET "${keel_uplot_package}" version)
  string(JSON keel_uplot_license GET "${keel_uplot_package}" license)
  file(STRINGS "${keel_uplot}/LICENSE" keel_uplot_copyright REGEX "^Copyright")
  string(REGEX REPLACE "^Copyright (\\([cC]\\) )?" "" keel_uplot_copyright "${keel_uplot_copyright}")
  # The licence text as its file has it, each line indented, an empty line as " .".
  file(READ "${keel_uplot}/LICENSE" keel_uplot_text)
  string(STRIP "${keel_uplot_text}" keel_uplot_text)
  string(REGEX REPLACE "\n[ \t]*\n" "\n.\n" keel_uplot_text "${keel_uplot_text}")
  string(REGEX REPLACE "\n[ \t]*\n" "\n.\n" keel_uplot_text "${keel_uplot_text}")
  string(REPLACE "\n" "\n " keel_uplot_text " ${keel_uplot_text}")
  string(APPEND keel_bundled
    "\nFiles: web/node_modules/uplot/*\n"
    "Copyright: ${keel_uplot_copyright}\n"
    "License: ${keel_uplot_license}\n${keel_uplot_text}\n"
    "Comment: uPlot ${keel_uplot_version}, from its npm package; installed as\n"
    " share/keel/web/node_modules/uplot/dist/ (the storm explorer's charts).\n")
endif()
file(READ "${KEEL_SOURCE}/cmake/copyright.in" keel_copyright)
set(KEEL_BUNDLED "${keel_bundled}")
string(CONFIGURE "${keel_copyright}" keel_copyright @ONLY)
set(keel_copyright_file "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/${KEEL_DOCDIR}/copyright")
message(STATUS "Installing: ${keel_copyright_file}")
file(WRITE "${keel_copyright_file}" "${keel_copyright}")
list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${keel_copyright_file}")

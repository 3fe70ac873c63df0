# Included by run_consumer.cmake after the install into WORK/prefix (run_deb.cmake: into
# INSTALLED_PREFIX, the unpacked package's usr): the installed headers are the
# public ones only. No detail/ folder (private headers, such as keel/http/detail/attempt.hpp, which
# includes <curl/curl.h>), every keel header an installed header includes is installed too, and
# no installed header includes libcurl's: a consumer of keel::http builds without them.
# With CXX and COMPILE_HEADERS, the installed headers also compile without a warning under
# -Wall -Wextra -Wpedantic as a consumer sees them through -I (pkg-config's Cflags; CMake's
# imported targets use -isystem, which hides warnings): one translation unit per installed
# folder that includes each of its headers (keel::asio's standalone Asio and keel::store_beast's
# Boost.Asio cannot share one), compiled with -fsyntax-only -Werror.
if(NOT INSTALLED_PREFIX)
  set(INSTALLED_PREFIX ${WORK}/prefix)
endif()
set(include_dir ${INSTALLED_PREFIX}/include)
file(GLOB_RECURSE installed_headers RELATIVE ${include_dir} ${include_dir}/keel/*)
if(NOT installed_headers)
  message(FATAL_ERROR "no header installed under ${include_dir}/keel")
endif()
foreach(header IN LISTS installed_headers)
  if(header MATCHES "(^|/)detail/")
    message(FATAL_ERROR "a private header was installed: ${header}")
  endif()
  file(STRINGS ${include_dir}/${header} includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]+)[>\"].*" "\\1" included "${line}")
    if(included MATCHES "^curl/")
      message(FATAL_ERROR "${header} includes <${included}>: libcurl's headers would be needed")
    endif()
    if(included MATCHES "^keel/" AND NOT EXISTS ${include_dir}/${included})
      message(FATAL_ERROR "${header} includes ${included}, which is not installed")
    endif()
  endforeach()
endforeach()
list(LENGTH installed_headers count)
message(STATUS "${count} installed headers: public only, none includes libcurl's")

if(CXX AND COMPILE_HEADERS)
  set(folders "")
  foreach(header IN LISTS installed_headers)
    get_filename_component(folder ${header} DIRECTORY)
    list(APPEND folders ${folder})
  endforeach()
  list(REMOVE_DUPLICATES folders)
  set(tu_dir ${WORK}/headers)
  file(MAKE_DIRECTORY ${tu_dir})
  set(header_flags -std=c++20 -fsyntax-only -Wall -Wextra -Wpedantic -Werror)
  if(CXX MATCHES "clang")
    list(APPEND header_flags -DASIO_HAS_CO_AWAIT=1)  # as keel::asio's interface (src/asio)
  endif()
  foreach(folder IN LISTS folders)
    set(tu "")
    foreach(header IN LISTS installed_headers)
      get_filename_component(header_folder ${header} DIRECTORY)
      if(header_folder STREQUAL folder AND header MATCHES "\\.hpp$")
        string(APPEND tu "#include <${header}>\n")
      endif()
    endforeach()
    string(REPLACE "/" "_" tu_name ${folder})
    file(WRITE ${tu_dir}/${tu_name}.cpp "${tu}")
    execute_process(COMMAND ${CXX} ${header_flags} -I${include_dir} ${tu_dir}/${tu_name}.cpp
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(rc)
      message(FATAL_ERROR "the installed headers of ${folder} do not compile cleanly with "
                          "${header_flags}:\n${out}")
    endif()
  endforeach()
  list(LENGTH folders folder_count)
  message(STATUS "the installed headers of ${folder_count} folders compile with ${header_flags}")
endif()

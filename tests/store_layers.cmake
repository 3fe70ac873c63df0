# Checks keel::store's layering (ARCHITECTURE.md), run as `cmake -DKEEL_SOURCE=... -P`:
#
# 1. Only the database layer branches on the backend: outside src/store/db/ and
#    include/keel/store/db/, no store file names a Backend value (Backend::kSqlite ...) or
#    compares a backend(); it asks the connection's dialect (keel/store/db/dialect.hpp) instead.
#    The same holds for the programs over the store (tools/keel/, demo/): they ask the store
#    (database_exists, the dialect), so a new backend needs no change there either.
# 2. Includes point down: each folder includes, of the store's folders (public headers
#    keel/store/<folder>/ or private ones "<folder>/detail/"), only its own and those below it.
cmake_minimum_required(VERSION 3.25)
if(NOT KEEL_SOURCE)
  message(FATAL_ERROR "usage: cmake -DKEEL_SOURCE=<keel's source tree> -P store_layers.cmake")
endif()

# Each folder and the store folders it may include: the arrows of ARCHITECTURE.md.
set(allowed_db db)
set(allowed_json json)
set(allowed_queue queue db json)
set(allowed_fleet fleet db)
set(allowed_idempotency idempotency db json)
set(allowed_server server idempotency db json)
set(allowed_beast beast idempotency db json)
set(allowed_handlers handlers queue db json)
set(folders db json queue idempotency fleet server beast handlers)

set(failures "")
file(GLOB_RECURSE files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/src/store/*.cpp
     ${KEEL_SOURCE}/src/store/*.hpp ${KEEL_SOURCE}/include/keel/store/*.hpp)
foreach(file IN LISTS files)
  if(NOT file MATCHES "^(src|include/keel)/store/([a-z_]+)/")
    list(APPEND failures "${file}: outside the store's folders (${folders})")
    continue()
  endif()
  set(folder ${CMAKE_MATCH_2})
  if(NOT folder IN_LIST folders)
    list(APPEND failures "${file}: '${folder}' is not one of the store's folders (${folders})")
    continue()
  endif()
  file(STRINGS ${KEEL_SOURCE}/${file} lines)
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(NOT folder STREQUAL "db" AND line MATCHES "Backend::k|backend\\(\\) *[!=]=")
      list(APPEND failures "${file}:${n}: branches on the backend (ask the dialect): ${line}")
    endif()
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"](keel/store/([a-z_]+)/|([a-z_]+)/detail/)")
      set(included ${CMAKE_MATCH_2}${CMAKE_MATCH_3})
      if(NOT included IN_LIST allowed_${folder})
        list(APPEND failures
             "${file}:${n}: ${folder}/ includes ${included}/, which is not below it: ${line}")
      endif()
    endif()
  endforeach()
endforeach()

file(GLOB_RECURSE programs RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/tools/keel/*.cpp
     ${KEEL_SOURCE}/tools/keel/*.hpp ${KEEL_SOURCE}/demo/*.cpp ${KEEL_SOURCE}/demo/*.hpp)
foreach(file IN LISTS programs)
  file(STRINGS ${KEEL_SOURCE}/${file} lines)
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(line MATCHES "Backend::k|backend\\(\\) *[!=]=")
      list(APPEND failures "${file}:${n}: branches on the backend (ask the store): ${line}")
    endif()
  endforeach()
endforeach()

# 3. Core includes nothing of the adapters (keel/<adapter>/...), and keel::metrics nothing of the
#    store: the layers above a layer are not its dependencies.
file(GLOB core_files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/include/keel/*.hpp
     ${KEEL_SOURCE}/src/core/*.cpp ${KEEL_SOURCE}/src/core/*.hpp)
file(GLOB_RECURSE metrics_files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/include/keel/metrics/*.hpp
     ${KEEL_SOURCE}/src/metrics/*.cpp ${KEEL_SOURCE}/src/metrics/*.hpp)
foreach(file IN LISTS core_files metrics_files)
  file(STRINGS ${KEEL_SOURCE}/${file} lines)
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(file IN_LIST core_files AND line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"]keel/([a-z_]+)/"
       AND NOT CMAKE_MATCH_1 STREQUAL "detail")
      list(APPEND failures "${file}:${n}: core includes an adapter's header: ${line}")
    endif()
    if(file IN_LIST metrics_files AND line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"]keel/store/")
      list(APPEND failures "${file}:${n}: keel::metrics includes a store header: ${line}")
    endif()
  endforeach()
endforeach()

if(failures)
  list(JOIN failures "\n  " text)
  message(FATAL_ERROR "keel::store's layering is broken:\n  ${text}")
endif()
list(LENGTH files count)
list(LENGTH programs program_count)
message(STATUS "${count} store files and ${program_count} program files: only db/ branches on the "
               "backend, includes point down")

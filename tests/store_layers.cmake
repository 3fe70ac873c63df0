# Checks the layering of the store's rooms (ARCHITECTURE.md), run as
# `cmake -DKEEL_SOURCE=... -P`. A room is a top-level folder of src/ (src/db/, src/queue/, ...;
# the receiving HTTP layer's two adapters are src/serve/httplib/ and src/serve/beast/) whose
# public headers are include/keel/store/<folder>/ (httplib's: include/keel/store/server/).
#
# 1. Only the database layer branches on the backend: outside src/db/ and
#    include/keel/store/db/, no store file names a Backend value (Backend::kSqlite ...) or
#    compares a backend(); it asks the connection's dialect (keel/store/db/dialect.hpp) instead.
#    The same holds for the programs over the store (tools/keel/, demo/): they ask the store
#    (database_exists, the dialect), so a new backend needs no change there either.
# 2. Includes point down: each room includes, of the store's rooms (public headers
#    keel/store/<folder>/ or private ones "<folder>/detail/"), only its own and those below it.
#    ProcessedMessages' public header is keel/store/queue/processed_messages.hpp (its old place),
#    which counts as the consumers room's.
cmake_minimum_required(VERSION 3.25)
if(NOT KEEL_SOURCE)
  message(FATAL_ERROR "usage: cmake -DKEEL_SOURCE=<keel's source tree> -P store_layers.cmake")
endif()

# Each folder and the store folders it may include: the arrows of ARCHITECTURE.md.
set(allowed_db db)
set(allowed_json json)
set(allowed_queue queue db json consumers)
set(allowed_consumers consumers db)
set(allowed_fleet fleet db)
set(allowed_idempotency idempotency db json)
set(allowed_server server idempotency db json)
set(allowed_beast beast idempotency db json)
set(allowed_handlers handlers queue db json)
set(folders db json queue consumers idempotency fleet server beast handlers)

set(failures "")
set(rooms db json queue consumers idempotency fleet serve handlers)
set(files "")
foreach(room IN LISTS rooms)
  file(GLOB_RECURSE room_files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/src/${room}/*.cpp
       ${KEEL_SOURCE}/src/${room}/*.hpp)
  list(APPEND files ${room_files})
endforeach()
file(GLOB_RECURSE header_files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/include/keel/store/*.hpp)
list(APPEND files ${header_files})
if(EXISTS ${KEEL_SOURCE}/src/store)
  list(APPEND failures "src/store/: the store's rooms are top-level folders of src/ now")
endif()
foreach(file IN LISTS files)
  if(file STREQUAL "include/keel/store/queue/processed_messages.hpp"
     OR file MATCHES "^src/consumers/")
    set(folder consumers)
  elseif(file MATCHES "^src/serve/httplib/")
    set(folder server)
  elseif(file MATCHES "^src/serve/beast/")
    set(folder beast)
  elseif(file MATCHES "^src/([a-z_]+)/")
    set(folder ${CMAKE_MATCH_1})
  elseif(file MATCHES "^include/keel/store/([a-z_]+)/")
    set(folder ${CMAKE_MATCH_1})
  else()
    list(APPEND failures "${file}: outside the store's folders (${folders})")
    continue()
  endif()
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
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"](keel/store/([a-z_]+)/|([a-z_]+)/detail/|serve/([a-z_]+)/detail/)")
      set(included ${CMAKE_MATCH_2}${CMAKE_MATCH_3}${CMAKE_MATCH_4})
      if(included STREQUAL "httplib")
        set(included server)
      elseif(line MATCHES "keel/store/queue/processed_messages.hpp")
        set(included consumers)
      endif()
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

# 4. No room of src/ holds more than a quarter of its lines: a concept that grows past that is
#    more than one concept.
file(GLOB room_dirs LIST_DIRECTORIES true RELATIVE ${KEEL_SOURCE}/src ${KEEL_SOURCE}/src/*)
set(total_lines 0)
foreach(room IN LISTS room_dirs)
  if(NOT IS_DIRECTORY ${KEEL_SOURCE}/src/${room})
    continue()
  endif()
  file(GLOB_RECURSE room_files ${KEEL_SOURCE}/src/${room}/*)
  set(lines_${room} 0)
  foreach(f IN LISTS room_files)
    file(READ ${f} content)  # lines as wc -l counts them
    string(REGEX MATCHALL "\n" newlines "${content}")
    list(LENGTH newlines count)
    math(EXPR lines_${room} "${lines_${room}} + ${count}")
  endforeach()
  math(EXPR total_lines "${total_lines} + ${lines_${room}}")
  list(APPEND counted_rooms ${room})
endforeach()
set(room_summary "")
foreach(room IN LISTS counted_rooms)
  math(EXPR share "${lines_${room}} * 100 / ${total_lines}")
  string(APPEND room_summary " ${room} ${share}%")
  if(lines_${room} GREATER 0 AND share GREATER_EQUAL 25)
    math(EXPR quarter "${total_lines} / 4")
    if(lines_${room} GREATER quarter)
      list(APPEND failures
           "src/${room}/ holds ${lines_${room}} of ${total_lines} lines under src/ (over 25%)")
    endif()
  endif()
endforeach()

if(failures)
  list(JOIN failures "\n  " text)
  message(FATAL_ERROR "the store's layering is broken:\n  ${text}")
endif()
list(LENGTH files count)
list(LENGTH programs program_count)
message(STATUS "${count} store files and ${program_count} program files: only db/ branches on the "
               "backend, includes point down; lines per room of src/:${room_summary}")

# Checks the layering of the store's rooms (ARCHITECTURE.md), run as
# `cmake -DKEEL_SOURCE=... -P`. A room is a folder of src/ (src/db/, src/queue/, ...; the
# receiving HTTP layer's two adapters are the rooms src/serve/httplib/ and src/serve/beast/)
# whose public headers are the same folder under include/keel/ (include/keel/db/,
# include/keel/serve/httplib/, ...): a file's room is the one whose folder holds it.
#
# 1. Only the database layer branches on the backend: outside src/db/ and include/keel/db/, no
#    store file names a Backend value (Backend::kSqlite ...) or compares a backend(); it asks
#    the connection's dialect (keel/db/dialect.hpp) instead. The same holds for the programs
#    over the store (tools/keel/, demo/): they ask the store (database_exists, the dialect), so
#    a new backend needs no change there either.
# 2. Includes point down: each room includes, of the store's rooms (public headers
#    keel/<room>/ or private ones "<room>/detail/"), only its own and those below it.
# 5. The headers' old paths only forward: include/keel/store/ and core's flat include/keel/*.hpp
#    each include their new path and nothing else, and no file of the tree includes an old path.
cmake_minimum_required(VERSION 3.25)
if(NOT KEEL_SOURCE)
  message(FATAL_ERROR "usage: cmake -DKEEL_SOURCE=<keel's source tree> -P store_layers.cmake")
endif()

# Each room and the rooms it may include: the arrows of ARCHITECTURE.md.
set(rooms db json queue consumers idempotency fleet serve/httplib serve/beast handlers)
set(allowed_db db)
set(allowed_json json)
set(allowed_queue queue db json consumers)
set(allowed_consumers consumers db)
set(allowed_fleet fleet db)
set(allowed_idempotency idempotency db json)
set(allowed_serve/httplib serve/httplib idempotency db json)
set(allowed_serve/beast serve/beast idempotency db json)
set(allowed_handlers handlers queue db json)

# The room whose folder holds `path` (a file, or an include's target), "" if none.
function(room_of path out)
  set(found "")
  foreach(room IN LISTS rooms)
    if(path MATCHES "^(src/|include/keel/|keel/)?${room}/")
      set(found ${room})
    endif()
  endforeach()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

set(failures "")
set(files "")
foreach(room IN LISTS rooms)
  file(GLOB_RECURSE room_files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/src/${room}/*.cpp
       ${KEEL_SOURCE}/src/${room}/*.hpp ${KEEL_SOURCE}/include/keel/${room}/*.hpp)
  list(APPEND files ${room_files})
endforeach()
if(EXISTS ${KEEL_SOURCE}/src/store)
  list(APPEND failures "src/store/: the store's rooms are top-level folders of src/ now")
endif()
foreach(file IN LISTS files)
  room_of(${file} folder)
  file(STRINGS ${KEEL_SOURCE}/${file} lines)
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(NOT folder STREQUAL "db" AND line MATCHES "Backend::k|backend\\(\\) *[!=]=")
      list(APPEND failures "${file}:${n}: branches on the backend (ask the dialect): ${line}")
    endif()
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"]([a-z_/]+)/")
      room_of("${CMAKE_MATCH_1}/" included)
      if(included AND NOT included IN_LIST allowed_${folder})
        list(APPEND failures
             "${file}:${n}: ${folder}/ includes ${included}/, which is not below it: ${line}")
      endif()
    endif()
  endforeach()
endforeach()

# 5. The old paths forward, and nothing includes them.
file(GLOB_RECURSE forwarding RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/include/keel/store/*.hpp)
file(GLOB core_forwarding RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/include/keel/*.hpp)
set(old_paths "")
foreach(file IN LISTS forwarding core_forwarding)
  string(REGEX REPLACE "^include/" "" old ${file})
  list(APPEND old_paths ${old})
  file(STRINGS ${KEEL_SOURCE}/${file} includes REGEX "^[ \t]*#[ \t]*include")
  list(LENGTH includes count)
  if(NOT count EQUAL 1 OR NOT includes MATCHES "\"keel/[a-z_/]+\\.hpp\"")
    list(APPEND failures "${file}: an old path includes its new one and nothing else")
  endif()
endforeach()
file(GLOB_RECURSE tree RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/src/*.[ch]pp
     ${KEEL_SOURCE}/include/keel/*.hpp ${KEEL_SOURCE}/tools/*.[ch]pp ${KEEL_SOURCE}/demo/*.[ch]pp
     ${KEEL_SOURCE}/tests/*.[ch]pp ${KEEL_SOURCE}/bench/*.[ch]pp ${KEEL_SOURCE}/examples/*.[ch]pp)
list(REMOVE_ITEM tree ${forwarding} ${core_forwarding})
foreach(file IN LISTS tree)
  file(STRINGS ${KEEL_SOURCE}/${file} includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]keel/")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]+)[>\"].*" "\\1" included "${line}")
    if(included IN_LIST old_paths)
      list(APPEND failures "${file}: includes the old path <${included}> (a forwarding header)")
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

# 3. Core includes nothing but core (keel/core/...), and keel::metrics nothing of the
#    store: the layers above a layer are not its dependencies.
file(GLOB core_files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/include/keel/core/*.hpp
     ${KEEL_SOURCE}/src/core/*.cpp ${KEEL_SOURCE}/src/core/*.hpp)
file(GLOB_RECURSE metrics_files RELATIVE ${KEEL_SOURCE} ${KEEL_SOURCE}/include/keel/metrics/*.hpp
     ${KEEL_SOURCE}/src/metrics/*.cpp ${KEEL_SOURCE}/src/metrics/*.hpp)
foreach(file IN LISTS core_files metrics_files)
  file(STRINGS ${KEEL_SOURCE}/${file} lines)
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(file IN_LIST core_files AND line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"]keel/([a-z_]+)/"
       AND NOT CMAKE_MATCH_1 MATCHES "^(core|detail)$")
      list(APPEND failures "${file}:${n}: core includes an adapter's header: ${line}")
    endif()
    if(file IN_LIST metrics_files AND line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"]keel/([a-z_/]+)/")
      room_of("keel/${CMAKE_MATCH_1}/" store_room)
    else()
      set(store_room "")
    endif()
    if(store_room)
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

# keel's store rooms: idempotency records, the job queue, consumer records, the fleet, handlers
# and the receiving HTTP layer, on SQLite and PostgreSQL. Each room is a top-level folder of
# src/ with its own CMake target, each depending only on the rooms below it (ARCHITECTURE.md;
# tests/store_layers.cmake checks the arrows):
#
#   src/handlers/        keel::store_handlers     CommandHandler, WebhookHandler, deferred requests
#   src/serve/httplib/   keel::store_http         the cpp-httplib adapters over the request flow
#   src/serve/beast/     keel::store_beast        the Boost.Beast adapter and server over it
#   src/fleet/           keel::store_fleet        SharedBreakers: breakers and rate limits a fleet
#                                                 shares through PostgreSQL
#   src/idempotency/     keel::store_idempotency  idempotency records and the receiver's flow
#   src/consumers/       keel::store_consumers    processed-message records at a consumer
#   src/queue/           keel::store_queue        JobQueue, Worker, dead letters
#   src/json/            keel::store_json         check_json, the limits on untrusted JSON bodies
#   src/db/              keel::store_db           connections, URLs, pool, transactions,
#                                                 migrations and each backend's SQL dialect
#
# The public headers are include/keel/<room>/ (as src/<room>/); the namespace is keel::store.
# keel::store is the umbrella of db, json, queue, consumers, idempotency and fleet. Private
# headers live in each room's detail/ and are included from src/ ("db/detail/commit.hpp"): a
# target includes its own and those of the targets it links, never a sibling's or a higher one's.
find_package(SQLite3 REQUIRED)
find_package(PostgreSQL REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(Threads REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
include(${PROJECT_SOURCE_DIR}/cmake/KeelLibrary.cmake)

# keel_store_library(<name> <source>...): the static library keel_store_<name>, exported as
# keel::store_<name>, with keel's include directories, C++20 and keel's warnings.
function(keel_store_library name)
  add_library(keel_store_${name} ${ARGN})
  add_library(keel::store_${name} ALIAS keel_store_${name})
  set_target_properties(keel_store_${name} PROPERTIES EXPORT_NAME store_${name}
                        OUTPUT_NAME keel_store_${name} POSITION_INDEPENDENT_CODE ON)
  target_include_directories(keel_store_${name}
    PUBLIC
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
      $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_features(keel_store_${name} PUBLIC cxx_std_20)
  target_link_libraries(keel_store_${name} PRIVATE $<BUILD_INTERFACE:keel_warnings>)
  keel_install_targets(keel_store_${name})
endfunction()

# keel_store_rooms(): adds the rooms in the order of their arrows, and the umbrella.
macro(keel_store_rooms)
  foreach(room db json queue consumers idempotency fleet)
    add_subdirectory(${PROJECT_SOURCE_DIR}/src/${room} ${PROJECT_BINARY_DIR}/src/${room})
  endforeach()

  # keel::store, the umbrella: what `target_link_libraries(... keel::store)` has always linked.
  add_library(keel_store INTERFACE)
  add_library(keel::store ALIAS keel_store)
  set_target_properties(keel_store PROPERTIES EXPORT_NAME store)
  target_link_libraries(keel_store
    INTERFACE keel::store_db keel::store_json keel::store_queue keel::store_consumers
              keel::store_idempotency keel::store_fleet)
  keel_install_targets(keel_store)

  # The receiving HTTP layer: the cpp-httplib adapters, and the Beast ones when Boost is found.
  add_subdirectory(${PROJECT_SOURCE_DIR}/src/serve ${PROJECT_BINARY_DIR}/src/serve)
  # handlers/ links keel::http; src/http is added before the store (the top-level CMakeLists.txt).
  if(TARGET keel::http)
    add_subdirectory(${PROJECT_SOURCE_DIR}/src/handlers ${PROJECT_BINARY_DIR}/src/handlers)
  endif()
endmacro()

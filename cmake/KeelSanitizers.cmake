# KEEL_SANITIZE: "address" (address + undefined behaviour) or "thread". Applied to every target
# built in this tree, third-party code excluded (it comes precompiled from Debian).
set(KEEL_SANITIZE "" CACHE STRING "Sanitizer build: address or thread")
if(KEEL_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(KEEL_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT KEEL_SANITIZE STREQUAL "")
  message(FATAL_ERROR "KEEL_SANITIZE must be empty, 'address' or 'thread' (got '${KEEL_SANITIZE}')")
endif()

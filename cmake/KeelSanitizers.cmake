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

# keel_sanitizer_hot(target): a target whose code the tests run millions of times (core's
# decisions, the simulator's engine) is optimised at -O1 in the address sanitizer's debug build,
# as AddressSanitizer's documentation advises for speed; the simulator's tests ran 3 to 5 times
# slower at -O0. The checks are the same at either level.
function(keel_sanitizer_hot target)
  if(KEEL_SANITIZE STREQUAL "address")
    target_compile_options(${target} PRIVATE $<$<CONFIG:Debug>:-O1>)
  endif()
endfunction()

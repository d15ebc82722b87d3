# The static libraries linked into the preload library must not reach for the
# heap, the environment, process state, termination or locks. Fails listing
# the offending undefined symbols of each archive. (snprintf and friends are
# allowed: glibc does not allocate for integer and string conversions.)
#   cmake -DNM=<nm> -DLIBS=<a;b> -P check_symbols.cmake
set(denied
  malloc calloc realloc free posix_memalign aligned_alloc memalign strdup
  _Znwm _Znam _ZdlPv _ZdaPv _ZnwmRKSt9nothrow_t
  getenv secure_getenv setenv putenv
  umask signal sigaction sigprocmask pthread_sigmask
  exit _exit abort __assert_fail
  pthread_mutex_lock pthread_rwlock_rdlock pthread_rwlock_wrlock sem_wait
  __cxa_throw __cxa_allocate_exception __cxa_guard_acquire
  strerror fopen
)
set(failed "")
foreach(lib ${LIBS})
  execute_process(COMMAND ${NM} -u --format=just-symbols ${lib} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${lib}")
  endif()
  string(REPLACE "\n" ";" symbols "${out}")
  foreach(sym ${symbols})
    string(REGEX REPLACE "@.*$" "" base "${sym}")
    list(FIND denied "${base}" found)
    if(NOT found EQUAL -1 OR base MATCHES "^_ZSt[0-9]+__throw_")
      list(APPEND failed "${lib}: ${sym}")
    endif()
  endforeach()
endforeach()
if(failed)
  string(REPLACE ";" "\n  " text "${failed}")
  message(FATAL_ERROR "forbidden symbols in the preload-linked libraries:\n  ${text}")
endif()
message(STATUS "symbol hygiene: ok")

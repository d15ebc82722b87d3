# The static libraries linked into the preload library, and the preload
# library's hot wrapper objects, must not reach for the heap, the environment,
# process state, termination or locks. Fails listing the offending undefined
# symbols of each archive or object. (snprintf and friends are allowed: glibc
# does not allocate for integer and string conversions.)
#   cmake -DNM=<nm> -DLIBS=<a;b> [-DONLY=<file-name;...>] -P check_symbols.cmake
# ONLY keeps the files of LIBS whose name is listed (e.g. memory.cc.o out of
# all of a target's objects).
set(denied
  malloc calloc realloc free posix_memalign aligned_alloc memalign strdup
  _Znwm _Znam _ZdlPv _ZdaPv _ZnwmRKSt9nothrow_t _ZnamRKSt9nothrow_t _ZdlPvm _ZdaPvm
  _ZnwmSt11align_val_t _ZdlPvSt11align_val_t _ZdlPvmSt11align_val_t
  getenv secure_getenv setenv putenv
  umask signal sigaction sigprocmask pthread_sigmask
  exit _exit abort __assert_fail
  pthread_mutex_lock pthread_mutex_trylock pthread_rwlock_rdlock pthread_rwlock_wrlock sem_wait
  pthread_cond_wait pthread_cond_timedwait
  __cxa_throw __cxa_allocate_exception __cxa_guard_acquire
  strerror fopen
)
set(failed "")
set(checked 0)
foreach(lib ${LIBS})
  if(DEFINED ONLY)
    get_filename_component(name "${lib}" NAME)
    list(FIND ONLY "${name}" wanted)
    if(wanted EQUAL -1)
      continue()
    endif()
  endif()
  math(EXPR checked "${checked} + 1")
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
if(DEFINED ONLY)
  list(LENGTH ONLY wanted_count)
  if(NOT checked EQUAL wanted_count)
    message(FATAL_ERROR "symbol check: found ${checked} of the ${wanted_count} files named in ONLY (${ONLY})")
  endif()
endif()
if(failed)
  string(REPLACE ";" "\n  " text "${failed}")
  message(FATAL_ERROR "forbidden symbols in the preload-linked code:\n  ${text}")
endif()
message(STATUS "symbol hygiene: ok (${checked} files)")

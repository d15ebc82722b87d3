# Two checks of what the preload library links against.
#
# Hygiene: the static libraries linked into the preload library, and the
# preload library's hot wrapper objects, must not reach for the heap, the
# environment, process state, termination or locks. Fails listing the
# offending undefined symbols of each archive or object. (snprintf and friends
# are allowed: glibc does not allocate for integer and string conversions.)
#   cmake -DNM=<nm> -DLIBS=<a;b> [-DONLY=<file-name;...>] [-DMARKED=<folder>]
#         [-DALLOW=<file-name:symbol;...>] -P check_symbols.cmake
# ONLY keeps the files of LIBS whose name is listed (e.g. memory.cc.o out of
# all of a target's objects). MARKED adds to ONLY the object of every .cc
# file of <folder> that carries the line
#   // gpuslice: hot path (no heap, no locks)
# (x.cc -> x.cc.o): a file on a hot path says so itself, and is checked from
# then on. ALLOW lets one object (an archive member or object file name) use
# one denied symbol, for a reason given where it is set.
#
# glibc floor (docs/deploy.md): the built shared library asks for no glibc
# symbol version newer than FLOOR and has nothing of libstdc++ (no NEEDED
# libstdc++/libgcc_s, no GLIBCXX_/CXXABI_ version, no C++ runtime symbol).
# Fails listing each offending version with the symbols that need it.
#   cmake -DOBJDUMP=<objdump> -DFLOOR_LIB=<lib.so> -DFLOOR=<2.17> -P check_symbols.cmake
if(DEFINED FLOOR_LIB)
  execute_process(COMMAND ${OBJDUMP} -p ${FLOOR_LIB} OUTPUT_VARIABLE headers RESULT_VARIABLE rc)
  execute_process(COMMAND ${OBJDUMP} -T ${FLOOR_LIB} OUTPUT_VARIABLE dynsyms RESULT_VARIABLE rc2)
  if(NOT rc EQUAL 0 OR NOT rc2 EQUAL 0)
    message(FATAL_ERROR "objdump failed on ${FLOOR_LIB}")
  endif()
  set(failed "")
  # NEEDED entries.
  string(REGEX MATCHALL "NEEDED +[^\n]+" needed_lines "${headers}")
  set(needed "")
  foreach(line ${needed_lines})
    string(REGEX REPLACE "NEEDED +" "" lib "${line}")
    list(APPEND needed "${lib}")
    if(lib MATCHES "^libstdc\\+\\+|^libgcc_s")
      list(APPEND failed "NEEDED ${lib}")
    endif()
  endforeach()
  # Every version the library requires (objdump -p's version references: the
  # verneed table ld.so checks before running anything), with the dynamic
  # symbols that ask for it.
  string(REGEX MATCHALL "[0-9a-fx]+ [0-9a-fx]+ [0-9]+ [A-Z_]+[0-9][0-9.]*" refs "${headers}")
  set(versions "")
  foreach(ref ${refs})
    string(REGEX REPLACE ".* " "" version "${ref}")
    list(APPEND versions "${version}")
  endforeach()
  list(REMOVE_DUPLICATES versions)
  if(NOT versions)
    message(FATAL_ERROR "no version references found in ${FLOOR_LIB} (objdump -p output not understood)")
  endif()
  set(highest "0")
  foreach(version ${versions})
    set(bad FALSE)
    if(version MATCHES "^GLIBC_([0-9.]+)$")
      set(number "${CMAKE_MATCH_1}")
      if(number VERSION_GREATER highest)
        set(highest "${number}")
      endif()
      if(number VERSION_GREATER FLOOR)
        set(bad TRUE)
      endif()
    elseif(version MATCHES "^(GLIBCXX|CXXABI)_")
      set(bad TRUE)
    endif()
    if(bad)
      string(REGEX MATCHALL "[^\n]*[ (]${version}[) ][^\n]*" users "${dynsyms}")
      set(names "")
      foreach(user ${users})
        string(REGEX REPLACE ".* " "" name "${user}")
        list(APPEND names "${name}")
      endforeach()
      string(REPLACE ";" " " names "${names}")
      list(APPEND failed "${version}: ${names}")
    endif()
  endforeach()
  # The C++ runtime by name, whatever version (libc itself provides
  # __cxa_atexit and __cxa_finalize).
  string(REGEX MATCHALL "\\*UND\\*[^\n]*" undefined "${dynsyms}")
  foreach(line ${undefined})
    string(REGEX REPLACE ".* " "" name "${line}")
    if(name MATCHES "^(_Z|__gxx_|_Unwind_|__cxa_)" AND NOT name MATCHES "^__cxa_(atexit|finalize)$")
      list(APPEND failed "C++ runtime symbol: ${name}")
    endif()
  endforeach()
  string(REPLACE ";" " " needed_text "${needed}")
  if(failed)
    string(REPLACE ";" "\n  " text "${failed}")
    message(FATAL_ERROR "${FLOOR_LIB} is above the glibc floor GLIBC_${FLOOR} or uses libstdc++ "
                        "(NEEDED: ${needed_text}):\n  ${text}")
  endif()
  message(STATUS "glibc floor: ok (${FLOOR_LIB}: highest GLIBC_${highest} <= GLIBC_${FLOOR}; NEEDED: ${needed_text})")
  return()
endif()

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
if(DEFINED MARKED)
  file(GLOB marked_sources "${MARKED}/*.cc")
  foreach(source ${marked_sources})
    file(STRINGS "${source}" marker REGEX "^// gpuslice: hot path \\(no heap, no locks\\)$" LIMIT_COUNT 1)
    if(marker)
      get_filename_component(name "${source}" NAME)
      list(APPEND ONLY "${name}.o")
    endif()
  endforeach()
  if(NOT ONLY)
    message(FATAL_ERROR "symbol check: no .cc file of ${MARKED} carries the hot-path marker")
  endif()
endif()
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
  # -A: each line names its file ("lib.a:member.o: U sym" for an archive).
  execute_process(COMMAND ${NM} -u -A ${lib} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${lib}")
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  foreach(line ${lines})
    if(NOT line MATCHES "^(.*):[ \t]+[A-Za-z][ \t]+([^ \t]+)$")
      continue()
    endif()
    set(sym "${CMAKE_MATCH_2}")
    string(REGEX REPLACE "^.*[:/]" "" member "${CMAKE_MATCH_1}")
    string(REGEX REPLACE "@.*$" "" base "${sym}")
    list(FIND denied "${base}" found)
    list(FIND ALLOW "${member}:${base}" allowed)
    if((NOT found EQUAL -1 OR base MATCHES "^_ZSt[0-9]+__throw_") AND allowed EQUAL -1)
      list(APPEND failed "${lib}: ${member}: ${sym}")
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

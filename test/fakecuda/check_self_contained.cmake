# CTest fakecuda.includes_nothing_of_gpuslice: the simulated driver is a
# project of its own (README.md, "Contract"). Fails naming every file under
# DIR (its libraries, its control tool, its tests) that includes a header of
# gpuslice's: the public ABI (gpuslice/...) or a layer (shm/, limiter/, hook/,
# platform/, tools/).
#   cmake -DDIR=test/fakecuda -P check_self_contained.cmake
if(NOT DIR)
  message(FATAL_ERROR "usage: cmake -DDIR=<test/fakecuda> -P check_self_contained.cmake")
endif()
file(GLOB_RECURSE files LIST_DIRECTORIES false ${DIR}/*.c ${DIR}/*.cc ${DIR}/*.h ${DIR}/*.inc)
list(LENGTH files count)
if(count LESS 20)
  message(FATAL_ERROR "${DIR}: only ${count} source files found; is DIR the simulator's folder?")
endif()
set(found "")
foreach(file IN LISTS files)
  file(STRINGS ${file} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"](gpuslice|shm|limiter|hook|platform|tools)/")
  foreach(line IN LISTS lines)
    file(RELATIVE_PATH name ${DIR} ${file})
    string(APPEND found "  ${name}: ${line}\n")
  endforeach()
endforeach()
if(found)
  message(FATAL_ERROR "the simulated driver includes gpuslice headers (it must declare what it needs itself):\n${found}")
endif()
message(STATUS "${count} files of ${DIR}: none includes a gpuslice header")

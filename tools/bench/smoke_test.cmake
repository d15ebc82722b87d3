# CTest smoke test of gpuslice-bench: `--quick --json` exits 0 and prints a
# JSON report that parses and says which driver it ran on.
#   cmake -DBENCH=<gpuslice-bench> -P smoke_test.cmake
execute_process(
  COMMAND ${BENCH} --quick --json --quiet --driver simulated
  RESULT_VARIABLE status
  OUTPUT_VARIABLE report
  ERROR_VARIABLE log
  TIMEOUT 50)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "gpuslice-bench --quick exited with ${status}\nstdout:\n${report}\nstderr:\n${log}")
endif()
string(JSON device ERROR_VARIABLE json_error GET "${report}" device)
if(json_error)
  message(FATAL_ERROR "gpuslice-bench --quick --json printed no valid JSON report (${json_error}):\n${report}")
endif()
if(NOT device STREQUAL "simulated")
  message(FATAL_ERROR "expected \"device\": \"simulated\", got \"${device}\"")
endif()
string(JSON errors LENGTH "${report}" errors)
if(NOT errors EQUAL 0)
  string(JSON list GET "${report}" errors)
  message(FATAL_ERROR "gpuslice-bench reported failed measurements: ${list}")
endif()
foreach(section launch memory quota compute_sweep tenants noisy_neighbour)
  string(JSON kind ERROR_VARIABLE missing TYPE "${report}" ${section})
  if(missing OR NOT kind STREQUAL "OBJECT")
    message(FATAL_ERROR "gpuslice-bench --quick report has no '${section}' section")
  endif()
endforeach()
message(STATUS "gpuslice-bench --quick: valid JSON report on the ${device} driver")

# CTest smoke test of gpuslice-bench: `--quick --json` exits 0 and prints a
# JSON report that parses and says which driver it ran on. With REPORT and
# PLOTS it also writes the report there and, when PYTHON (the Python --plots
# uses) has matplotlib, the SVG plots into PLOTS: gpuslice_bench_plots checks
# them (one bench run for both).
#   cmake -DBENCH=<gpuslice-bench> [-DREPORT=<file> -DPLOTS=<dir> -DPYTHON=<python>] -P smoke_test.cmake
set(extra)
if(REPORT)
  file(REMOVE ${REPORT})
  list(APPEND extra --json-file ${REPORT})
endif()
if(PLOTS)
  file(REMOVE_RECURSE ${PLOTS})
  execute_process(COMMAND ${PYTHON} -c "import matplotlib" RESULT_VARIABLE no_matplotlib OUTPUT_QUIET ERROR_QUIET)
  if(no_matplotlib EQUAL 0)
    list(APPEND extra --plots ${PLOTS})
  else()
    message(STATUS "no matplotlib for ${PYTHON}: running without --plots (gpuslice_bench_plots will skip)")
  endif()
endif()
execute_process(
  COMMAND ${BENCH} --quick --json --quiet --driver simulated ${extra}
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
# The priority section (docs/priority.md): every case measured, the timeline
# figures present next to a neighbour, and the gate doing something: on the
# simulated driver natively the bursts queue behind 16 ms of training work
# (p50 ~19 ms on the ideal profile), under gpuslice behind at most one
# training kernel (p50 ~4.5 ms). A 4x margin: no timing flake.
foreach(case alone_native alone_gpuslice neighbour_native neighbour_gpuslice)
  string(JSON p50 ERROR_VARIABLE missing GET "${report}" priority ${case} latency p50_ms)
  if(missing OR NOT p50 GREATER 0)
    message(FATAL_ERROR "gpuslice-bench --quick: priority case '${case}' has no burst latency (${missing})")
  endif()
  set(p50_${case} ${p50})
endforeach()
foreach(field harvest reaction release)
  string(JSON value ERROR_VARIABLE missing GET "${report}" priority neighbour_gpuslice ${field})
  if(missing)
    message(FATAL_ERROR "gpuslice-bench --quick: priority neighbour_gpuslice has no '${field}' (${missing})")
  endif()
endforeach()
string(JSON ratio ERROR_VARIABLE missing GET "${report}" priority p99_ratio_gpuslice)
if(missing)
  message(FATAL_ERROR "gpuslice-bench --quick: priority section has no p99_ratio_gpuslice")
endif()
if(NOT p50_neighbour_gpuslice LESS p50_neighbour_native)
  message(FATAL_ERROR "gpuslice-bench --quick: under gpuslice the high-priority bursts (p50 ${p50_neighbour_gpuslice} ms) "
                      "were not faster than natively next to training (${p50_neighbour_native} ms): the priority gate did nothing")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/oversub_checks.cmake)
message(STATUS "gpuslice-bench --quick: valid JSON report on the ${device} driver")

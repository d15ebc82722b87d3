# gpuslice_bench_spill_in_flight: the oversubscription section with each
# spill's window held open. The simulator holds a managed allocation on the
# device from cuMemAllocManaged until cuMemAdvise moves it to the host; chaos
# sleeps of up to 40 ms in those two calls (and only there) let the watcher
# (a sample every 5 ms) see the spill in flight, as a loaded machine once did
# in CI (ec3566a: the device one 64 MiB chunk over the allowance). The checks
# (oversub_checks.cmake) must hold all the same: what gpuslice admitted as
# resident within the allowance, the spill's managed memory one chunk at most.
#   cmake -DBENCH=<gpuslice-bench> -P spill_in_flight_test.cmake
set(ENV{FAKECUDA_CHAOS_SEED} 1)
set(ENV{FAKECUDA_CHAOS_CALLS} "cuMemAllocManaged,cuMemAdvise_v2")
set(ENV{FAKECUDA_CHAOS_YIELD_PCT} 0)
set(ENV{FAKECUDA_CHAOS_SLEEP_PCT} 100)
set(ENV{FAKECUDA_CHAOS_SLEEP_US} 40000)
execute_process(
  COMMAND ${BENCH} --quick --json --quiet --driver simulated --only oversub
  RESULT_VARIABLE status
  OUTPUT_VARIABLE report
  ERROR_VARIABLE log
  TIMEOUT 50)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "gpuslice-bench --quick --only oversub exited with ${status}\nstdout:\n${report}\nstderr:\n${log}")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/oversub_checks.cmake)
string(JSON raw GET "${report}" oversubscription spill max_device_bytes)
string(JSON managed GET "${report}" oversubscription spill max_device_managed_bytes)
message(STATUS "spill with its window held open: the device held at most ${raw} bytes, ${managed} of them managed")

# The oversubscription section's checks on a gpuslice-bench report in
# `report` (JSON text): included by smoke_test.cmake and
# spill_in_flight_test.cmake.
# The oversubscription section (docs/memory.md): past the resident allowance
# spill serves the grower from host memory and wait holds it until the other
# process frees; either way it gets every chunk (its quota has room), and the
# simulated device never holds more than the allowance besides a spill in
# flight: managed memory, which the simulator holds from the allocation to
# the advice to the host (a GPU holds nothing before a touch) — at most the
# grower's one chunk, and none under wait (the CI failure of ec3566a: one
# chunk over, a spill caught in flight on a loaded machine).
string(JSON allowance ERROR_VARIABLE missing GET "${report}" oversubscription resident_limit_bytes)
if(missing)
  message(FATAL_ERROR "gpuslice-bench --quick: no oversubscription section (${missing})")
endif()
string(JSON chunks GET "${report}" oversubscription grower_chunks)
foreach(policy spill wait)
  foreach(field grower_granted max_spilled_bytes waits max_device_resident_bytes max_device_managed_bytes)
    string(JSON ${field} ERROR_VARIABLE missing GET "${report}" oversubscription ${policy} ${field})
    if(missing)
      message(FATAL_ERROR "gpuslice-bench --quick: oversubscription ${policy} has no '${field}' (${missing})")
    endif()
  endforeach()
  if(NOT grower_granted EQUAL chunks)
    message(FATAL_ERROR "gpuslice-bench --quick: under ${policy} the grower got ${grower_granted} of ${chunks} chunks")
  endif()
  if(max_device_resident_bytes GREATER allowance)
    message(FATAL_ERROR "gpuslice-bench --quick: under ${policy} the device held ${max_device_resident_bytes} bytes "
                        "besides managed memory, over the ${allowance}-byte resident allowance")
  endif()
  string(JSON chunk GET "${report}" oversubscription chunk_bytes)
  if(policy STREQUAL "wait")
    set(managed_most 0)
  else()
    set(managed_most ${chunk})
  endif()
  if(max_device_managed_bytes GREATER managed_most)
    message(FATAL_ERROR "gpuslice-bench --quick: under ${policy} the device held ${max_device_managed_bytes} bytes of "
                        "managed memory at once, more than ${managed_most} (spills in flight: one chunk at most)")
  endif()
  set(${policy}_spilled ${max_spilled_bytes})
  set(${policy}_waits ${waits})
endforeach()
if(NOT spill_spilled GREATER 0 OR NOT wait_spilled EQUAL 0 OR NOT wait_waits GREATER 0)
  message(FATAL_ERROR "gpuslice-bench --quick: expected spill to spill (max ${spill_spilled} bytes) and wait to "
                      "wait (${wait_waits} waits) without spilling (${wait_spilled} bytes)")
endif()

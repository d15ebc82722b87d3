# CTest gpuslice_bench_plots_need_matplotlib: `gpuslice-bench --plots` with a
# Python that cannot import matplotlib (PYTHON run isolated, without
# site-packages) fails with a message naming matplotlib and how to get it;
# with no Python at all, one naming the path it tried.
#   cmake -DBENCH=<gpuslice-bench> -DPYTHON=<python3> -DDIR=<scratch dir> -P no_matplotlib_test.cmake
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
file(WRITE ${DIR}/report.json "{\"device\": \"simulated\"}\n")
file(WRITE ${DIR}/python "#!/bin/sh\nexec \"${PYTHON}\" -I -S \"$@\"\n")
file(CHMOD ${DIR}/python PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
execute_process(COMMAND ${CMAKE_COMMAND} -E env GPUSLICE_BENCH_PYTHON=${DIR}/python
                        ${BENCH} --plots-from ${DIR}/report.json --plots ${DIR}/plots
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 20)
if(status EQUAL 0 OR NOT err MATCHES "matplotlib is not installed for" OR NOT err MATCHES "--plots needs matplotlib: tools/setup.sh")
  message(FATAL_ERROR "expected a failure naming matplotlib, got exit ${status}\nstdout:\n${out}\nstderr:\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env GPUSLICE_BENCH_PYTHON=${DIR}/no-such-python
                        ${BENCH} --plots-from ${DIR}/report.json --plots ${DIR}/plots
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 20)
if(status EQUAL 0 OR NOT err MATCHES "no Python at .*no-such-python \\(GPUSLICE_BENCH_PYTHON\\)")
  message(FATAL_ERROR "expected a failure naming the missing Python, got exit ${status}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(EXISTS ${DIR}/plots/share_over_time.svg)
  message(FATAL_ERROR "a plot was written without matplotlib")
endif()
message(STATUS "gpuslice-bench --plots without matplotlib: clear errors")

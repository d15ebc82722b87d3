# One precompiled header for every GoogleTest program of the suite: GoogleTest
# and the standard headers most test files include, parsed once per build
# instead of once per test file (~0.5 s of CPU a file at -O3, ~110 files).
#
# gpuslice_test_pch owns the header; each test program reuses it
# (REUSE_FROM), which needs the same compiler flags as the owner: the programs
# found here are executables (-fPIE, as the owner) whose COMPILE_OPTIONS are
# the owner's (those of the tree, -Wall -Wextra -Werror and a sanitizer's). A definition a program adds (-DGPUSLICE_...) does not touch the
# header, so it does not matter. A program whose flags do differ fails to
# build, loudly: CMake compiles with -Winvalid-pch and the tree with -Werror.
# GPUSLICE_TEST_PCH=OFF turns it off (e.g. to check a test file's own
# #includes are complete).
option(GPUSLICE_TEST_PCH "Precompile GoogleTest and common std headers for the test programs" ON)

function(gpuslice_links_gtest target out)
  # Does `target` link GoogleTest, directly or through a static library's
  # interface (gpuslice_harness, gpuslice_unit_support)?
  set(found OFF)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "INTERFACE_LIBRARY")
    get_target_property(libs ${target} INTERFACE_LINK_LIBRARIES)
  else()
    get_target_property(libs ${target} LINK_LIBRARIES)
    get_target_property(ilibs ${target} INTERFACE_LINK_LIBRARIES)
    if(ilibs)
      list(APPEND libs ${ilibs})
    endif()
  endif()
  foreach(lib IN LISTS libs)
    if(lib MATCHES "^GTest::")
      set(found ON)
      break()
    endif()
    if(TARGET ${lib} AND lib MATCHES "^gpuslice_")
      gpuslice_links_gtest(${lib} sub)
      if(sub)
        set(found ON)
        break()
      endif()
    endif()
  endforeach()
  set(${out} ${found} PARENT_SCOPE)
endfunction()

function(gpuslice_targets_under dir out)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    gpuslice_targets_under(${sub} more)
    list(APPEND targets ${more})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

# Called once every test folder has been added.
function(gpuslice_use_test_pch)
  if(NOT GPUSLICE_TEST_PCH)
    return()
  endif()
  set(main ${CMAKE_CURRENT_BINARY_DIR}/gpuslice_test_pch.cc)
  file(CONFIGURE OUTPUT ${main} CONTENT "int main() { return 0; }\n")
  add_executable(gpuslice_test_pch EXCLUDE_FROM_ALL ${main})
  target_link_libraries(gpuslice_test_pch PRIVATE GTest::gtest)
  target_precompile_headers(gpuslice_test_pch PRIVATE
    <gtest/gtest.h>
    <algorithm>
    <atomic>
    <chrono>
    <cstdint>
    <cstdio>
    <cstdlib>
    <cstring>
    <fstream>
    <sstream>
    <string>
    <thread>
    <vector>)
  # The test programs' own code (GoogleTest cases, their helpers) at -O1 in
  # a Release build: it drives the library, the simulator and the programs
  # under test, which keep the tree's optimisation. Compiling it at -O3 cost
  # the cold build 16 s of 146 on 2 cores (130 s at -O1) for nothing a test
  # measures.
  # In a sanitizer build (CI's ASan+UBSan and TSan lanes) the same code at
  # -O0: the sanitizers are there for the library and the tools, which keep
  # the lane's -O1, and -O0 cuts a large test file's compile CPU by 40-45 %
  # (smi_test 13.1 -> 7.6 s, lease_test 10.0 -> 5.5 s under ASan+UBSan),
  # most of a lane's time on 2 cores.
  # Owner and programs alike, so that the header's flags still match.
  if(GPUSLICE_SANITIZE STREQUAL "")
    set(test_optimisation $<$<CONFIG:Release>:-O1>)
  else()
    set(test_optimisation -O0)
  endif()
  gpuslice_targets_under(${CMAKE_CURRENT_SOURCE_DIR} targets)
  # The simulator's own tests: test/fakecuda is added by the top level.
  if(EXISTS ${CMAKE_SOURCE_DIR}/test/fakecuda/tests/CMakeLists.txt)
    gpuslice_targets_under(${CMAKE_SOURCE_DIR}/test/fakecuda more)
    list(APPEND targets ${more})
  endif()
  # Every target starts with its folder's add_compile_options (the same in
  # every test folder); a program that adds its own differs from the owner's.
  get_target_property(owner_options gpuslice_test_pch COMPILE_OPTIONS)
  target_compile_options(gpuslice_test_pch PRIVATE ${test_optimisation})
  set(used 0)
  foreach(t IN LISTS targets)
    if(t STREQUAL "gpuslice_test_pch")
      continue()
    endif()
    get_target_property(type ${t} TYPE)
    get_target_property(options ${t} COMPILE_OPTIONS)
    get_target_property(skip ${t} DISABLE_PRECOMPILE_HEADERS)
    if(NOT type STREQUAL "EXECUTABLE" OR NOT "${options}" STREQUAL "${owner_options}" OR skip)
      continue()
    endif()
    gpuslice_links_gtest(${t} gtest)
    if(gtest)
      target_precompile_headers(${t} REUSE_FROM gpuslice_test_pch)
      target_compile_options(${t} PRIVATE ${test_optimisation})
      math(EXPR used "${used} + 1")
    endif()
  endforeach()
  # Files compiled without it: with the header precompiled, GCC 12 reports
  # -Warray-bounds and -Wstringop-overflow in libstdc++'s inlined string
  # copies in these files (a known class of false positives in GCC 12's
  # std::string), which it leaves unreported, as in a system header, when the
  # files include the headers themselves: the first two at -O3, the third
  # under TSan (seen at -O1; the test programs' -O0 now), the last two at the
  # test programs' -O1 of a
  # Release build (above). A new test file failing that way
  # ("error: ... char_traits.h ... [-Werror=array-bounds]", included from
  # cmake_pch.hxx) goes on this list.
  foreach(pair "agent_tests;test/agent/status_test.cc" "hami_tests;test/hami/cdi_spec_test.cc"
          "readme_options_test;test/unit/readme_options_test.cc"
          "fakecuda_fidelity_test;test/fakecuda/tests/fidelity_test.cc" "old_glibc_test;test/deploy/old_glibc_test.cc")
    list(GET pair 0 target)
    list(GET pair 1 file)
    if(TARGET ${target})
      set_source_files_properties(${CMAKE_SOURCE_DIR}/${file} TARGET_DIRECTORY ${target}
                                  PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
    endif()
  endforeach()
  message(STATUS "gpuslice: ${used} test programs share one precompiled header (GPUSLICE_TEST_PCH)")
endfunction()

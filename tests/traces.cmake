# tests/traces.cmake — tests of traces/, recorder/ and the record/inspect/export commands;
# included by tests/CMakeLists.txt.
function(lockstep_traces_test name)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE lockstep_traces GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE LOCKSTEP_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  gtest_discover_tests(${name} WORKING_DIRECTORY ${CMAKE_SOURCE_DIR} DISCOVERY_TIMEOUT 60)
endfunction()

lockstep_traces_test(trace_roundtrip_test traces/trace_roundtrip_test.cc)

# The acceptance test: h5py (Debian's /usr/bin/python3) reads traces of a seeded 3-request run
# in each KV format and compares them with hashes the driver took from the engine directly.
add_executable(trace_capture_driver traces/capture_driver.cc)
target_link_libraries(trace_capture_driver PRIVATE lockstep_recorder nlohmann_json::nlohmann_json)
add_test(NAME traces_h5py_check
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/traces/h5py_check.sh $<TARGET_FILE:trace_capture_driver>
                 ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/traces_h5py ${CMAKE_SOURCE_DIR})

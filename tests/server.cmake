# tests/server.cmake — `lockstep serve` (server/): HTTP end to end on loopback, in-process.
pkg_check_modules(HTTPLIB_TEST REQUIRED IMPORTED_TARGET cpp-httplib)
lockstep_test(server_test server/server_test.cc)
target_link_libraries(server_test PRIVATE lockstep_server lockstep_replayer lockstep_traces PkgConfig::HTTPLIB_TEST
                      nlohmann_json::nlohmann_json)
find_program(PROMTOOL promtool)
if(PROMTOOL)
  target_compile_definitions(server_test PRIVATE LOCKSTEP_PROMTOOL="${PROMTOOL}")
endif()

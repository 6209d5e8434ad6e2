# tests/server.cmake — `lockstep serve` (server/): HTTP end to end on loopback, in-process.
pkg_check_modules(HTTPLIB_TEST REQUIRED IMPORTED_TARGET cpp-httplib)
lockstep_test(server_test server/server_test.cc)
lockstep_test(chat_template_test server/chat_template_test.cc)
lockstep_test(openai_request_test server/openai_request_test.cc)
# The degeneration detector (diff/degeneration.h) on the embedded model's tokens: real greedy
# output, hand-built loops of real lines, natural text (tests/server/degeneration/).
lockstep_test(degeneration_test server/degeneration_test.cc)
target_link_libraries(degeneration_test PRIVATE lockstep_diff)
target_link_libraries(openai_request_test PRIVATE lockstep_server nlohmann_json::nlohmann_json)
# The request parser on arbitrary bytes (fuzz/fuzz_openai_request.cc; the seeds, *.req, begin
# with the byte that picks the endpoint and the capture header, then the JSON body).
lockstep_fuzz(fuzz_openai_request)
lockstep_fuzz_run(fuzz_openai_request 8)
target_link_libraries(fuzz_openai_request PRIVATE lockstep_server)
target_compile_definitions(fuzz_openai_request PRIVATE LOCKSTEP_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
if(NOT LOCKSTEP_FUZZ)
  file(GLOB _openai_seeds ${CMAKE_SOURCE_DIR}/tests/fuzz/seeds/openai/*.req)
  list(SORT _openai_seeds)
  add_test(NAME fuzz_openai_request_replay COMMAND fuzz_openai_request --mutations 50000 ${_openai_seeds})
endif()
target_link_libraries(chat_template_test PRIVATE lockstep_server nlohmann_json::nlohmann_json)
target_link_libraries(server_test PRIVATE lockstep_server lockstep_replayer lockstep_traces PkgConfig::HTTPLIB_TEST
                      nlohmann_json::nlohmann_json)
find_program(PROMTOOL promtool)
if(PROMTOOL)
  target_compile_definitions(server_test PRIVATE LOCKSTEP_PROMTOOL="${PROMTOOL}")
endif()

# The serve commands README.md, docs/server.md and `lockstep serve --help` print, run as printed
# (on free ports) in an empty directory: token file, serve, a completion, an admin capture.
add_test(NAME serve_docs_test
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/server/serve_docs_test.sh $<TARGET_FILE:lockstep> ${CMAKE_SOURCE_DIR})
set_tests_properties(serve_docs_test PROPERTIES LABELS "server" TIMEOUT 300 SKIP_REGULAR_EXPRESSION "SKIP:")

# The real `openai` npm client (tests/server/e2e/, pinned by package-lock.json) against a
# `lockstep serve` subprocess; SKIPs when Node 20+/npm or the npm registry are missing.
add_test(NAME server_e2e_openai
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/server/e2e/run.sh $<TARGET_FILE:lockstep> ${CMAKE_BINARY_DIR}/server_e2e)
set_tests_properties(server_e2e_openai PROPERTIES LABELS "server;e2e" TIMEOUT 600 SKIP_REGULAR_EXPRESSION "SKIP:")

# bench/load/load.mjs, small: 64 concurrent streaming clients × 128 requests × 16 tokens on
# loopback, with captures and a /metrics poller (docs/performance.md has the full-size run).
add_test(NAME server_load
         COMMAND bash ${CMAKE_SOURCE_DIR}/bench/load/run.sh $<TARGET_FILE:lockstep>
                 --clients 64 --requests 128 --max-tokens 16 --capture-every 32 --timeout-s 120)
set_tests_properties(server_load PROPERTIES LABELS "server;load" TIMEOUT 180 RUN_SERIAL TRUE SKIP_REGULAR_EXPRESSION "SKIP:")

# bench/load/load.py, the same small load test for machines without Node (the GPU runs): the
# port must keep passing where load.mjs does, or its figures stop being comparable.
find_program(PYTHON3 python3)
if(PYTHON3)
  add_test(NAME server_load_py
           COMMAND ${PYTHON3} ${CMAKE_SOURCE_DIR}/bench/load/load.py --bin $<TARGET_FILE:lockstep>
                   --clients 64 --requests 128 --max-tokens 16 --capture-every 32 --timeout-s 120)
  set_tests_properties(server_load_py PROPERTIES LABELS "server;load" TIMEOUT 180 RUN_SERIAL TRUE)
endif()

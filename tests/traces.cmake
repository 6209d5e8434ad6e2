# tests/traces.cmake — tests of traces/, recorder/ and the record/inspect/export commands;
# included by tests/CMakeLists.txt.
function(lockstep_traces_test name)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE lockstep_traces GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE LOCKSTEP_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  gtest_discover_tests(${name} WORKING_DIRECTORY ${CMAKE_SOURCE_DIR} DISCOVERY_TIMEOUT 60)
endfunction()

lockstep_traces_test(trace_roundtrip_test traces/trace_roundtrip_test.cc)
lockstep_traces_test(row_stats_test traces/row_stats_test.cc)
lockstep_traces_test(recorder_batch_test traces/recorder_batch_test.cc)
target_link_libraries(recorder_batch_test PRIVATE lockstep_recorder)
lockstep_traces_test(lent_rows_test traces/lent_rows_test.cc)
target_link_libraries(lent_rows_test PRIVATE lockstep_recorder)

# The acceptance test: h5py (Debian's /usr/bin/python3) reads traces of a seeded 3-request run
# in each KV format and compares them with hashes the driver took from the engine directly.
add_executable(trace_capture_driver traces/capture_driver.cc)
target_link_libraries(trace_capture_driver PRIVATE lockstep_recorder nlohmann_json::nlohmann_json)
add_test(NAME traces_h5py_check
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/traces/h5py_check.sh $<TARGET_FILE:trace_capture_driver>
                 ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/traces_h5py ${CMAKE_SOURCE_DIR})

# Crash safety: SIGKILL the recorder at 20 random moments; each trace must open with our
# reader and with h5py and hold every step up to the last flush.
add_test(NAME traces_sigkill
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/traces/crash_test.py $<TARGET_FILE:trace_capture_driver>
                 $<TARGET_FILE:lockstep> ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/traces_sigkill
                 ${CMAKE_SOURCE_DIR}/tests/fixtures/models/v32_sparse 20)

# Crash safety where random kills almost never land: kills aimed at the writes of a flush that
# restructures a chunk index (a table's first B-tree node, node splits), made exact by an
# LD_PRELOAD shim that SIGKILLs the recorder right before a chosen write to the trace.
add_library(kill_at_write MODULE traces/kill_at_write.c)
target_link_libraries(kill_at_write PRIVATE ${CMAKE_DL_LIBS})
add_test(NAME traces_sigkill_splits
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/traces/crash_test.py $<TARGET_FILE:trace_capture_driver>
                 $<TARGET_FILE:lockstep> ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/traces_sigkill_splits
                 ${CMAKE_SOURCE_DIR}/tests/fixtures/models/v32_sparse 20 --splits $<TARGET_FILE:kill_at_write>)

# Bad input: truncated, not HDF5, newer version, missing datasets, petabyte shapes → one
# line, non-zero exit (in-process and through `lockstep inspect`).
lockstep_traces_test(trace_bad_input_test traces/trace_bad_input_test.cc)
add_dependencies(trace_bad_input_test lockstep)
target_compile_definitions(trace_bad_input_test PRIVATE LOCKSTEP_BINARY="$<TARGET_FILE:lockstep>")

# Fuzz target for the reader, wired like lockstep_fuzz() in tests/CMakeLists.txt: libFuzzer
# with LOCKSTEP_FUZZ, else the replay driver over mutants of seed traces that a fixture test
# records first.
if(LOCKSTEP_FUZZ)
  add_executable(fuzz_trace_reader fuzz/fuzz_trace_reader.cc)
  target_compile_options(fuzz_trace_reader PRIVATE -fsanitize=fuzzer)
  target_link_options(fuzz_trace_reader PRIVATE -fsanitize=fuzzer)
  # Its bounded run tells crashes inside libhdf5 (known: tests/fuzz/regressions/hdf5-1.10/) from ours.
  add_test(NAME fuzz_trace_reader_bounded
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/bounded_trace_reader.sh $<TARGET_FILE:fuzz_trace_reader> 12
                   ${CMAKE_BINARY_DIR}/fuzz-corpus/fuzz_trace_reader ${CMAKE_SOURCE_DIR}/tests/fuzz/corpus/fuzz_trace_reader)
  set_tests_properties(fuzz_trace_reader_bounded PROPERTIES LABELS fuzz TIMEOUT 300
                       ENVIRONMENT "ASAN_OPTIONS=detect_leaks=1;LSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/fuzz/lsan.supp;UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1")
else()
  add_executable(fuzz_trace_reader fuzz/fuzz_trace_reader.cc fuzz/replay_main.cc)
  set(_trace_seeds ${CMAKE_CURRENT_BINARY_DIR}/fuzz_trace_seeds)
  add_test(NAME fuzz_trace_reader_seeds
           COMMAND bash -c "mkdir -p ${_trace_seeds} && $<TARGET_FILE:trace_capture_driver> --model ${CMAKE_SOURCE_DIR}/tests/fixtures/models/v32_sparse --capture summary --max-tokens 4 --out ${_trace_seeds}/summary.h5 && $<TARGET_FILE:trace_capture_driver> --model ${CMAKE_SOURCE_DIR}/tests/fixtures/models/v2_lite_like --kv bf16 --max-tokens 3 --requests 1 --out ${_trace_seeds}/full.h5")
  set_tests_properties(fuzz_trace_reader_seeds PROPERTIES FIXTURES_SETUP trace_seeds)
  add_test(NAME fuzz_trace_reader_replay
           COMMAND fuzz_trace_reader --mutations 400 ${_trace_seeds}/summary.h5 ${_trace_seeds}/full.h5)
  set_tests_properties(fuzz_trace_reader_replay PROPERTIES FIXTURES_REQUIRED trace_seeds)
endif()
target_link_libraries(fuzz_trace_reader PRIVATE lockstep_traces)

# The structure-aware trace fuzzer: inputs are edits applied through HDF5 to a valid trace it
# writes itself (valid HDF5, hostile values), then read, packed-checked and diffed. Without
# LOCKSTEP_FUZZ the replay driver runs its corpus and mutants of it.
if(LOCKSTEP_FUZZ)
  add_executable(fuzz_trace_edits fuzz/fuzz_trace_edits.cc)
  target_compile_options(fuzz_trace_edits PRIVATE -fsanitize=fuzzer)
  target_link_options(fuzz_trace_edits PRIVATE -fsanitize=fuzzer)
  lockstep_fuzz_run(fuzz_trace_edits 12)
else()
  add_executable(fuzz_trace_edits fuzz/fuzz_trace_edits.cc fuzz/replay_main.cc)
  file(GLOB _edit_seeds ${CMAKE_SOURCE_DIR}/tests/fuzz/corpus/fuzz_trace_edits/*)
  list(SORT _edit_seeds)
  add_test(NAME fuzz_trace_edits_replay COMMAND fuzz_trace_edits --mutations 6 ${_edit_seeds})
endif()
target_link_libraries(fuzz_trace_edits PRIVATE lockstep_traces lockstep_diff)

# Hostile input (issue 31): a real trace recorded here, damaged and crafted ~170 ways (rows
# moved, tensors renamed, frames of the wrong size, memory bombs, truncations, bit flips), each
# through inspect, --verify, replay (exact, forced), diff (with the original, with itself) and
# export: a one-line error or "different", never a crash, hang, "identical" for lost rows, or
# more memory than docs/trace-format.md allows.
add_test(NAME traces_hostile
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/traces/hostile_traces.py $<TARGET_FILE:lockstep>
                 ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/traces_hostile
                 ${CMAKE_SOURCE_DIR}/tests/fixtures/models/v32_sparse -j 2)
set_tests_properties(traces_hostile PROPERTIES TIMEOUT 600 PROCESSORS 2)

# Rank shards (emulated TP, `record --rank-shards`): per-rank shard files stitched by HDF5
# virtual datasets read as one trace (diff, h5py, the Python package, export, verify, pack); a
# missing, foreign, swapped or misnamed shard is refused by name; a killed run opens.
add_test(NAME traces_rank_shards
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/traces/rank_shards_test.py $<TARGET_FILE:lockstep>
                 ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/traces_rank_shards
                 ${CMAKE_SOURCE_DIR}/models/lockstep-tiny-v32)
set_tests_properties(traces_rank_shards PROPERTIES TIMEOUT 600)

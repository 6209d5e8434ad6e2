# tests/tokenizer.cmake — the tokenizer's test and fuzz targets, included by tests/CMakeLists.txt.
#
# Paths go through CMAKE_CURRENT_LIST_DIR, so this file also works when included from a
# scratch project (the tokenizer was developed before the engine library existed).
get_filename_component(LOCKSTEP_TOKENIZER_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)

find_package(GTest REQUIRED)
include(GoogleTest)

# libzstd: the real DeepSeek-V3 tokenizer.json fixture is stored compressed (7.8 MB → 1.5 MB).
find_package(PkgConfig REQUIRED)
pkg_check_modules(LOCKSTEP_TOKENIZER_ZSTD REQUIRED IMPORTED_TARGET libzstd)
add_executable(tokenizer_test ${CMAKE_CURRENT_LIST_DIR}/tokenizer_test.cc)
target_link_libraries(tokenizer_test PRIVATE lockstep_engine GTest::gtest_main PkgConfig::LOCKSTEP_TOKENIZER_ZSTD)
target_compile_definitions(tokenizer_test PRIVATE LOCKSTEP_SOURCE_DIR="${LOCKSTEP_TOKENIZER_ROOT}")
gtest_discover_tests(tokenizer_test WORKING_DIRECTORY ${LOCKSTEP_TOKENIZER_ROOT} DISCOVERY_TIMEOUT 60)

# Fuzz target: FromJson on arbitrary bytes, and Encode of arbitrary bytes on a fixture
# tokenizer. With LOCKSTEP_FUZZ (clang) it is a libFuzzer binary; the tokenizer source is
# compiled into it so that it carries the coverage instrumentation and sanitizers, which
# lockstep_engine does not:
#   cmake -B build-fuzz -DLOCKSTEP_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang
#   cmake --build build-fuzz --target fuzz_tokenizer
#   build-fuzz/tests/fuzz_tokenizer -max_total_time=60 tests/fixtures/tokenizers/*/tokenizer.json
# Without it, the deterministic replay driver (fuzz/replay_main.cc) runs mutants of the
# fixture tokenizer.json files as a CTest, so CI exercises the target too.
set(_tok_fuzz_seeds ${LOCKSTEP_TOKENIZER_ROOT}/tests/fixtures/tokenizers/deepseek_v3/tokenizer.json
                    ${LOCKSTEP_TOKENIZER_ROOT}/tests/fixtures/tokenizers/deepseek_llm/tokenizer.json
                    ${LOCKSTEP_TOKENIZER_ROOT}/tests/fixtures/tokenizers/gpt2/tokenizer.json)
if(LOCKSTEP_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "LOCKSTEP_FUZZ needs clang (libFuzzer); set CMAKE_CXX_COMPILER=clang++")
  endif()
  add_executable(fuzz_tokenizer ${CMAKE_CURRENT_LIST_DIR}/fuzz/fuzz_tokenizer.cc
                                ${LOCKSTEP_TOKENIZER_ROOT}/engine/tokenizer.cc
                                ${LOCKSTEP_TOKENIZER_ROOT}/engine/tokenizer_load.cc)
  target_include_directories(fuzz_tokenizer PRIVATE ${LOCKSTEP_TOKENIZER_ROOT})
  target_link_libraries(fuzz_tokenizer PRIVATE nlohmann_json::nlohmann_json PkgConfig::PCRE2)
  target_compile_options(fuzz_tokenizer PRIVATE -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
  target_link_options(fuzz_tokenizer PRIVATE -fsanitize=fuzzer,address,undefined)
  lockstep_fuzz_run(fuzz_tokenizer 8)
  target_compile_definitions(fuzz_tokenizer PRIVATE LOCKSTEP_SOURCE_DIR="${LOCKSTEP_TOKENIZER_ROOT}")
elseif(EXISTS ${CMAKE_CURRENT_LIST_DIR}/fuzz/replay_main.cc)
  add_executable(fuzz_tokenizer ${CMAKE_CURRENT_LIST_DIR}/fuzz/fuzz_tokenizer.cc
                                ${CMAKE_CURRENT_LIST_DIR}/fuzz/replay_main.cc)
  target_link_libraries(fuzz_tokenizer PRIVATE lockstep_engine)
  target_compile_definitions(fuzz_tokenizer PRIVATE LOCKSTEP_SOURCE_DIR="${LOCKSTEP_TOKENIZER_ROOT}")
  add_test(NAME fuzz_tokenizer_replay COMMAND fuzz_tokenizer --mutations 300 ${_tok_fuzz_seeds})
endif()

# tests/python.cmake — the Python package python/lockstep (Debian's /usr/bin/python3 with
# python3-h5py, python3-numpy, python3-xxhash); included by tests/CMakeLists.txt.

# Reader and writer against lockstep record/export/inspect/diff, incomplete and hostile traces.
add_test(NAME python_reader_test
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/python/reader_test.py $<TARGET_FILE:lockstep>
                 ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/python_reader ${CMAKE_SOURCE_DIR})
set_tests_properties(python_reader_test PROPERTIES TIMEOUT 300)

# `pip install ./python` offline (no index, no build isolation: Debian's setuptools), then the
# installed copy imports and opens a trace through plugin_path=.
add_test(NAME python_pip_install
         COMMAND bash -c "rm -rf '${CMAKE_CURRENT_BINARY_DIR}/python_pip' '${CMAKE_CURRENT_BINARY_DIR}/python_pip_src' && cp -r '${CMAKE_SOURCE_DIR}/python' '${CMAKE_CURRENT_BINARY_DIR}/python_pip_src' && /usr/bin/python3 -m pip install --quiet --no-deps --no-build-isolation --no-index --target '${CMAKE_CURRENT_BINARY_DIR}/python_pip' '${CMAKE_CURRENT_BINARY_DIR}/python_pip_src' && cd / && PYTHONPATH='${CMAKE_CURRENT_BINARY_DIR}/python_pip' /usr/bin/python3 -c 'import lockstep, sys; assert lockstep.__file__.startswith(sys.argv[1]), lockstep.__file__; print(lockstep.__version__)' '${CMAKE_CURRENT_BINARY_DIR}/python_pip'")

# python3 -m lockstep import openai: lockstep serve's logprobs imported and replayed forced (KL 0 up
# to the logsumexp's rounding, 100 % top-1; with an FP8 cache the KL a recording's replay gives),
# vLLM/sglang shapes made from transformers' logits of a fixture, malformed inputs.
add_test(NAME python_import_openai_test
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/python/import_openai_test.py $<TARGET_FILE:lockstep>
                 ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/python_import_openai ${CMAKE_SOURCE_DIR})
set_tests_properties(python_import_openai_test PROPERTIES TIMEOUT 300)

# python3 -m lockstep import sglang: recordings written as sglang dumper files by the test's own
# torch.save writer (old and current file naming, the non-intrusive dumper's module names, two
# batched requests), imported and replayed forced (every tap aligned, rel L2 ≤ 1e-6, KL ≤ 1e-6),
# a planted change named as the first divergence; hostile dumps refused with one line. Real
# torch.save files only where torch imports (else skipped with a message).
add_test(NAME python_import_sglang_test
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/python/import_sglang_test.py $<TARGET_FILE:lockstep>
                 ${LOCKSTEP_HDF5_PLUGIN_DIR} ${CMAKE_CURRENT_BINARY_DIR}/python_import_sglang ${CMAKE_SOURCE_DIR})
set_tests_properties(python_import_sglang_test PROPERTIES TIMEOUT 300)

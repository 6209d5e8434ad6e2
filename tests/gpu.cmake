# tests/gpu.cmake — the CUDA kernels' tests (tests/gpu/), labelled `gpu`.
#
# Each kernel is compared with its CPU twin on seeded random inputs. Without a CUDA device
# the tests skip (GTEST_SKIP), so `ctest` stays green on CI machines that have nvcc but no
# GPU; `ctest -L gpu` selects them on a GPU machine. One binary per kernel family, so a
# crash in one leaves the others' results standing.
if(NOT LOCKSTEP_HAVE_CUDA)
  return()
endif()

# lockstep_gpu_test(name [libs...]): libs default to lockstep_engine (the CPU twins).
function(lockstep_gpu_test name)
  set(_libs ${ARGN})
  if(NOT _libs)
    set(_libs lockstep_engine)
  endif()
  add_executable(${name} gpu/${name}.cc)
  target_link_libraries(${name} PRIVATE lockstep_cuda ${_libs} GTest::gtest_main)
  # Only what a binary uses.
  target_link_options(${name} PRIVATE -Wl,--as-needed)
  target_compile_definitions(${name} PRIVATE LOCKSTEP_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  gtest_discover_tests(${name} WORKING_DIRECTORY ${CMAKE_SOURCE_DIR} DISCOVERY_TIMEOUT 60
                       PROPERTIES LABELS gpu)
endfunction()

lockstep_gpu_test(gpu_norm_rope_test)
lockstep_gpu_test(gpu_latent_write_test)
lockstep_gpu_test(gpu_mla_decode_test)
lockstep_gpu_test(gpu_indexer_test)
lockstep_gpu_test(gpu_sampler_test)
lockstep_gpu_test(gpu_gemm_test)
lockstep_gpu_test(gpu_engine_test lockstep_engine lockstep_traces)
lockstep_gpu_test(gpu_engine_taps_test lockstep_engine lockstep_traces)
lockstep_gpu_test(gpu_summarize_test lockstep_traces)
# Twins in kernels/cpu only: this one builds while engine/ is being changed.
lockstep_gpu_test(gpu_model_ops_test)
lockstep_gpu_test(gpu_expert_gemm_test)
lockstep_gpu_test(gpu_variant_twin_test)
lockstep_gpu_test(gpu_tensor_parallel_test lockstep_engine lockstep_traces)
lockstep_gpu_test(gpu_tp_ranks_test lockstep_engine lockstep_traces)
lockstep_gpu_test(gpu_nccl_collective_test lockstep_engine)

# The CLI workflow on the GPU: record with --backend cuda, exact replay, replay on the CPU.
add_test(NAME gpu_record_replay COMMAND ${CMAKE_SOURCE_DIR}/tests/gpu/record_replay_gpu.sh $<TARGET_FILE:lockstep>)
set_tests_properties(gpu_record_replay PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300
                     ENVIRONMENT "LOCKSTEP_DEFAULT_MODEL=${CMAKE_SOURCE_DIR}/models/lockstep-tiny-v32;HDF5_PLUGIN_PATH=${LOCKSTEP_HDF5_PLUGIN_DIR}")

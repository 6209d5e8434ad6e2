#!/usr/bin/env bash
# tools/stage-gpu-bin.sh — builds the CUDA binaries here and stages them, stripped, in one flat
# folder that travels to a GPU machine with the working tree (the device tool's `carry`): the
# GPU tests, the benchmarks, `lockstep`, the HDF5 zstd plugin and the shared libraries a bare
# GPU image lacks. Then, on the GPU machine, from the repository root:
#
#   B=$PWD/.gpu-bin; export LD_LIBRARY_PATH=$(dirname $(find /usr/local -name 'libcublasLt.so.13*' | head -1)):$B
#   export LOCKSTEP_SOURCE_DIR=$PWD HDF5_PLUGIN_PATH=$B/plugins
#   tests/gpu/run_on_gpu.sh $B --bench           # every GPU test (and the MLA benchmark)
#   bash tests/gpu/record_replay_gpu.sh $B/lockstep
#
#   tools/stage-gpu-bin.sh [BUILD_DIR (build-gpu)] [OUT_DIR (.gpu-bin)] [TARGET ...]
#
# With no TARGETs it stages every GPU test, bench_gpu_decode, bench_gpu_sampler, bench_record, bench_mla_decode, bench_nccl,
# bench_expert_gemm, bench_recorder_host and lockstep (about 63 MB; the device tool carries at
# most 64 MiB with the tree: tools/gpu-pack.sh packs them into ~24 MB instead). Builds for
# sm_90 (the H200) when BUILD_DIR is new, with the lab/ experiments configured
# (-DLOCKSTEP_LAB=ON), so that one of them can be named as a TARGET.
set -euo pipefail
build=${1:-build-gpu}
out=${2:-.gpu-bin}
shift $(( $# > 2 ? 2 : $# ))
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(gpu_engine_test gpu_engine_taps_test gpu_expert_gemm_test gpu_gemm_test gpu_indexer_test gpu_latent_write_test gpu_mla_decode_test
           gpu_model_ops_test gpu_norm_rope_test gpu_sampler_test gpu_summarize_test gpu_variant_twin_test gpu_tensor_parallel_test gpu_tp_ranks_test
           bench_gpu_decode bench_gpu_sampler bench_record bench_mla_decode bench_expert_gemm bench_recorder_host bench_nccl lockstep)
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DLOCKSTEP_LAB=ON
fi
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" h5zstd_lockstep
mkdir -p "$out/plugins"
for t in "${targets[@]}"; do
  f=$(find "$build" -maxdepth 2 -type f -name "$t" -perm -u+x | head -1)
  if [ -z "$f" ]; then
    echo "stage-gpu-bin: $t: not found under $build" >&2
    exit 1
  fi
  cp "$f" "$out/" && strip "$out/$t"
done
plugin=$(find "$build" -name 'libh5zstd_lockstep.so' | head -1)
[ -n "$plugin" ] && cp "$plugin" "$out/plugins/"
for lib in libcpp-httplib.so.0.11; do
  p=$(find /usr/lib /usr/local/lib -name "$lib" 2>/dev/null | head -1)
  [ -n "$p" ] && cp "$p" "$out/"
done
# CUPTI for bench_gpu_decode --timeline (opened at run time; a bare GPU image may lack it).
p=$(find /usr/local/cuda/ /usr/local/cuda-*/ -name 'libcupti.so.1[0-9]' 2>/dev/null | head -1)
if [[ " ${targets[*]} " == *" bench_gpu_decode "* && -n "$p" ]]; then cp "$p" "$out/"; fi
du -sh "$out"

#!/usr/bin/env bash
# tools/gpu-unpack.sh (copied to .gpu-pack/ by tools/gpu-pack.sh) — on the GPU machine, from
# the repository root: unpacks .gpu-pack/bin.txz into /tmp/lockstep-bin, sets the environment
# the binaries and tests expect, and runs the command given (in which '$B' names the binaries;
# quote it so that it expands here). Writes the GPU's name, driver and clocks to $OUT/gpu.txt
# when $OUT is set.
set -u
export B=/tmp/lockstep-bin
mkdir -p "$B" && tar -C "$B" -xJf .gpu-pack/bin.txz
cublas=$(find /usr/local -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas"):}$B${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LOCKSTEP_SOURCE_DIR=$PWD LOCKSTEP_DEFAULT_MODEL=$PWD/models/lockstep-tiny-v32 HDF5_PLUGIN_PATH=$B/plugins
if [ -n "${OUT:-}" ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
fi
cmd=()
for a in "$@"; do cmd+=("${a//\$B/$B}"); done
"${cmd[@]}"

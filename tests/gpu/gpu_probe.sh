# tests/gpu/gpu_probe.sh — sourced by the GPU CLI tests: `gpu_probe LOCKSTEP MODEL` returns when
# `generate --backend cuda` runs, exits 77 (CTest's skip) when this machine has no CUDA device or
# this lockstep no CUDA, and exits 1 on any other failure.
gpu_probe() {
  local probe
  probe=$("$1" generate --backend cuda -m "$2" --prompt hi -n 1 --quiet 2>&1)
  if [ $? -ne 0 ]; then
    case $probe in
      *"without CUDA"*|*"no CUDA device"*|*"CUDA driver"*) echo "SKIP: $probe"; exit 77 ;;
    esac
    echo "FAIL: probe: $probe"
    exit 1
  fi
}

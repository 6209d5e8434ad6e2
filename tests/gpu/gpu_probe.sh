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

# `h5py_python MODULE...` prints the first interpreter (python3 on PATH — on the GPU machines
# torch's venv —, then Debian's /usr/bin/python3) that imports h5py and the modules named, and
# fails with a message naming them when none does.
h5py_python() {
  local p
  for p in python3 /usr/bin/python3; do
    if "$p" -c "import h5py${*:+, $(IFS=,; echo "$*")}" 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  echo "FAIL: no python3 here imports h5py $*" >&2
  return 1
}

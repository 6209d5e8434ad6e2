#!/usr/bin/env bash
# tools/install-deps.sh — installs, with apt-get, the Debian 12 packages lockstep builds and
# tests with; skips the install when they are all present already. Run as root.
set -euo pipefail
PKGS=(build-essential cmake ninja-build pkg-config git
      libeigen3-dev libcli11-dev nlohmann-json3-dev libpcre2-dev libgtest-dev libgmock-dev
      clang libclang-rt-14-dev
      libhdf5-dev hdf5-tools libzstd-dev libxxhash-dev python3-h5py python3-numpy python3-xxhash python3-jinja2
      chromium libcpp-httplib-dev prometheus curl)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

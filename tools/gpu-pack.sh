#!/usr/bin/env bash
# tools/gpu-pack.sh — stages the CUDA binaries (tools/stage-gpu-bin.sh) and packs them into one
# xz'd tar, .gpu-pack/bin.txz (git-ignored), with tools/gpu-unpack.sh beside it: every GPU
# test and benchmark plus `lockstep` come to over 100 MB staged and ~44 MB as gzip, over the
# device tool's 64 MiB transfer once the ~53 MB tree is counted; xz packs them far smaller. Extra files (an older binary to A/B against,
# say) go in with --add FILE (repeatable; they keep their base names).
#
#   tools/gpu-pack.sh [--add FILE]... [BUILD_DIR (build-gpu)] [TARGET ...]
#
# Then run with the device tool, carry [".gpu-pack"], from the repository root:
#
#   bash .gpu-pack/gpu-unpack.sh tests/gpu/run_on_gpu.sh '$B'     # $B: the unpacked binaries
#   bash .gpu-pack/gpu-unpack.sh bash -c '$B/bench_gpu_decode --model $PWD/models/shapes/deepseek-v2-lite ...'
set -euo pipefail
adds=()
while [ $# -gt 0 ] && [ "$1" = "--add" ]; do
  adds+=("$2")
  shift 2
done
build=${1:-build-gpu}
shift $(( $# > 0 ? 1 : 0 ))
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
tools/stage-gpu-bin.sh "$build" "$stage/bin" "$@"
for f in "${adds[@]}"; do cp "$f" "$stage/bin/"; done
mkdir -p .gpu-pack
rm -f .gpu-pack/bin.tgz
XZ_OPT="-9 -T2" tar -C "$stage/bin" -cJf .gpu-pack/bin.txz .
cp tools/gpu-unpack.sh .gpu-pack/
echo "gpu-pack: .gpu-pack/bin.txz $(du -h .gpu-pack/bin.txz | cut -f1) (carry [\".gpu-pack\"])"

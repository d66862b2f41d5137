#!/usr/bin/env bash
# Megatron-Core 0.19.2's Python sources, for the gloo suite on this project's Python 3.11 machines.
#
# megatron-core 0.16.1 is the newest release installable on Python 3.11 (the core dependency, for its indexed
# datasets); the megatron engine needs >= 0.19. 0.19.2's Python sources run on 3.11; its one compiled part,
# the dataset helpers, is not used by the gloo suite. So: download the cp312 wheel (no install), unpack its
# `megatron` package and dist-info into DEST, and put DEST first on PYTHONPATH for the gloo suite only.
#
#   bash .ci/megatron-core-0.19.sh [DEST]      # default .cache/megatron-core-0.19.2; prints DEST
set -euo pipefail
version=0.19.2
dest=${1:-.cache/megatron-core-$version}
if [[ ! -f $dest/megatron_core-$version.dist-info/METADATA ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp" "megatron-core==$version"
  python -m zipfile -e "$tmp"/megatron_core-"$version"-*.whl "$tmp/unpacked"
  mkdir -p "$dest.partial"
  mv "$tmp/unpacked/megatron" "$tmp/unpacked/megatron_core-$version.dist-info" "$dest.partial/"
  rm -rf "$dest" && mv "$dest.partial" "$dest"   # whole or absent: a cut download leaves no half folder
fi
echo "$dest"

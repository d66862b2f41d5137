#!/usr/bin/env bash
# Writes .device-wheels/site-slim.tar.xz: the stack bundle (site.tar.xz, ../shared/device/fetch-wheels.sh) less
# what a full-model round does not read (torchao and its metadata, a stray top-level test/ folder, TVM's C++
# sources and CUTLASS's tools inside TileLang: the kernels build from TileLang's own templates and CUTLASS's
# include/), 33.1 -> 31.0 MB, so that it fits beside Transformer Engine (.device-te, 23.4 MB, and .te-cache) and the
# tracked tree under the 64 MiB one run can take along. Take it along in place of site.tar.xz and start the
# command with `mv .device-wheels/site-slim.tar.xz .device-wheels/site.tar.xz` (install.sh reads that name).
# Not for float8 rounds (torchao is left out).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf .device-wheels/site.tar.xz
tar -C "$tmp" -cf - --exclude=./torchao --exclude='./torchao-*' --exclude=./test \
  --exclude=./tilelang/3rdparty/tvm/src --exclude=./tilelang/3rdparty/cutlass/tools . \
  | xz -6 -T0 > .device-wheels/site-slim.tar.xz
ls -la .device-wheels/site-slim.tar.xz

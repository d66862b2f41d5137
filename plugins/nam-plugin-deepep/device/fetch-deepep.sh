#!/bin/bash
# Packs DeepEP v1.2.1 for the GPU host into .device-deepep/ (git-ignored; ~0.3 MB): deepep-src.tar.xz (the
# tag's setup.py, csrc/ and deep_ep/ Python package, LICENSE), ninja for a parallel build, and
# install-deepep.sh, which builds the extension there. DeepEP has no wheel; its build needs nvcc and torch's
# headers, which this machine lacks, so only the source travels.
# Source, first found: DEEPEP_SRC (a .tar.gz/.tar.xz of the tag, or a git directory holding tag v1.2.1),
# else the mirror /work/.mirror/deepseek-ai+DeepEP/repo. Run from the project root. DEEPEP_OUT: another output
# folder (then nothing is added to git's exclude list); DEEPEP_NINJA=0: leave ninja out (the host then compiles
# the four files one after another).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
out=${DEEPEP_OUT:-$root/.device-deepep}
tag=v1.2.1
src=${DEEPEP_SRC:-/work/.mirror/deepseek-ai+DeepEP/repo}
wheels=${DEEPEP_WHEELS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/device-deepep-wheels}
if [[ -z ${DEEPEP_OUT:-} ]]; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for ignored in /.device-deepep/ /.deepep-cache/; do  # the second: builds carried back (gpu/deepep.sh)
    grep -qx "$ignored" "$exclude" 2>/dev/null || echo "$ignored" >> "$exclude"
  done
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/src" "$out"
if [[ -f $src ]]; then
  tar -C "$stage/src" --strip-components=1 -xf "$src"
elif git -C "$src" rev-parse -q --verify "refs/tags/$tag" >/dev/null; then
  git -C "$src" archive "$tag" setup.py LICENSE csrc deep_ep | tar -C "$stage/src" -xf -
else
  echo "DeepEP $tag source not found." >&2
  echo "  expected: DEEPEP_SRC=<tarball of the tag or git dir with tag $tag>, or the mirror $src" >&2
  echo "  found:    $src is neither a file nor a git directory with tag $tag" >&2
  echo "  next:     DEEPEP_SRC=/path/to/DeepEP-1.2.1.tar.gz bash $0" >&2
  exit 1
fi
# what install-deepep.sh relies on: the intranode-only source list and the version of the tag
for f in setup.py csrc/deep_ep.cpp csrc/kernels/runtime.cu csrc/kernels/layout.cu csrc/kernels/intranode.cu \
         deep_ep/__init__.py deep_ep/buffer.py deep_ep/utils.py; do
  [[ -f $stage/src/$f ]] || { echo "DeepEP source lacks $f (not the $tag layout)" >&2; exit 1; }
done
grep -q "version='1.2.1'" "$stage/src/setup.py" || { echo "DeepEP source is not 1.2.1 (setup.py)" >&2; exit 1; }
rm -rf "$stage/src/tests" "$stage/src/figures" "$stage/src/third-party"
mkdir -p "$stage/bin"
if [[ ${DEEPEP_NINJA:-1} != 0 ]]; then
  if ! ls "$wheels"/ninja-1.13.0-*.whl >/dev/null 2>&1; then
    mkdir -p "$wheels"
    python3 -m pip download -q --no-deps -d "$wheels" --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 ninja==1.13.0
  fi
  unzip -q -j "$wheels"/ninja-1.13.0-*.whl 'ninja-1.13.0.data/scripts/ninja' -d "$stage/bin"
  chmod +x "$stage/bin/ninja"
fi
tar -C "$stage" -cf - src bin | xz -T1 -9 > "$out/deepep-src.tar.xz"
cp "$here/install-deepep.sh" "$out/install-deepep.sh"
ls -la "$out"

#!/bin/bash
# On the GPU host, from the project root: bash .device-deepep/install-deepep.sh [CACHE_DIR]; then
# PYTHONPATH=/tmp/site. Unpacks DeepEP v1.2.1 (packed by plugins/nam-plugin-deepep/device/fetch-deepep.sh)
# and builds its extension deep_ep_cpp with the installed torch and nvcc, for sm_90 only and without NVSHMEM
# (intranode kernels only), into /tmp/site beside the deep_ep package and a deep_ep-1.2.1.dist-info (so
# importlib.metadata sees the version). With CACHE_DIR, a build for the same DeepEP, torch and Python is
# restored from there instead, and a new build is saved there (xz, one file whose name holds only letters,
# digits, '.', '_' and '-', so it can come back from a run's $OUT).
#
# The flags are those of the tag's setup.py for sm_90 with NVSHMEM absent, with two differences:
# - no -rdc=true: relocatable device code only serves the device link against NVSHMEM's device library; with
#   NVSHMEM off the tag's setup.py keeps -rdc=true but has no device-link step, and the module then fails to
#   import (undefined __cudaRegisterLinkedBinary_* symbols). No kernel of the intranode build calls device
#   code of another file, so whole-program compilation is correct.
# - setup.py turns NVSHMEM on whenever the nvidia.nvshmem wheel is importable (torch's cu13 wheels pull it
#   in); this script never looks for it, so the build is intranode-only on every host.
# --ptxas-options=--register-usage-level=10 is passed only when this nvcc's ptxas takes it (a trial compile).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${1:-}
site=${DEEPEP_SITE:-/tmp/site}
work=$(mktemp -d /tmp/deepep-build.XXXX)
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
mkdir -p "$site"
rm -rf "$site"/deep_ep "$site"/deep_ep-1.2.1.dist-info "$site"/deep_ep_cpp*.so
tar -C "$work" -xJf "$here/deepep-src.tar.xz"
cp -a "$work/src/deep_ep" "$site/deep_ep"
mkdir -p "$site/deep_ep-1.2.1.dist-info"
printf 'Metadata-Version: 2.1\nName: deep_ep\nVersion: 1.2.1\nSummary: DeepEP v1.2.1, intranode only (NVSHMEM off), sm_90, built on this host\n' \
  > "$site/deep_ep-1.2.1.dist-info/METADATA"
printf 'nam-plugin-deepep install-deepep.sh\n' > "$site/deep_ep-1.2.1.dist-info/INSTALLER"
: > "$site/deep_ep-1.2.1.dist-info/RECORD"
suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
torchv=$(python3 -c 'import torch; print(torch.__version__)')
key="deep_ep_cpp-1.2.1-nonvshmem-sm90-torch${torchv//+/_}${suffix//.so/}.so.xz"
key=${key//[^A-Za-z0-9._-]/_}
if [[ -n $cache && -f $cache/$key ]]; then
  xz -dc "$cache/$key" > "$site/deep_ep_cpp$suffix"
  echo "restored deep_ep_cpp from $cache/$key"
else
  if [[ -z ${CUDA_HOME:-} ]]; then
    if [[ -x /usr/local/cuda/bin/nvcc ]]; then CUDA_HOME=/usr/local/cuda
    else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
  fi
  export CUDA_HOME PATH=$work/bin:$CUDA_HOME/bin:$PATH MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0
  # a trial compile (a grep of `ptxas --help` under pipefail failed on the host: grep -q closes the pipe early)
  ptxas_level=0
  echo '__global__ void k() {}' > "$work/probe.cu"
  if "$CUDA_HOME/bin/nvcc" -c "$work/probe.cu" -o "$work/probe.o" -arch=sm_90 \
       --ptxas-options=--register-usage-level=10 >/dev/null 2>&1; then ptxas_level=1; fi
  b0=$(date +%s)
  (cd "$work/src" && PTXAS_LEVEL=$ptxas_level python3 - "$work/out" <<'PY'
# deep_ep_cpp from the four intranode sources, with the tag's compiler flags for sm_90 without NVSHMEM.
# deep_ep.cpp includes ATen/cuda/CUDAContext.h, which wants cuBLAS, cuSPARSE and cuSOLVER headers; a CUDA
# toolkit without them (a bare nvcc install; the GPU host's had them) gets them from torch's nvidia-* wheels.
import os, sys, sysconfig
from pathlib import Path
import setuptools
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
out = sys.argv[1]
toolkit = Path(CUDA_HOME or "/usr/local/cuda") / "include"
roots = {Path(p) / "nvidia" for p in sys.path + [sysconfig.get_paths()["purelib"]] if (Path(p) / "nvidia").is_dir()}
wheel_dirs = [d for r in sorted(roots) for d in sorted(r.glob("*/include"))]
include_dirs = ["csrc/"]
for h in ("cuda_runtime_api.h", "cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h"):
    if (toolkit / h).is_file() or any((Path(d) / h).is_file() for d in include_dirs[1:]):
        continue
    found = [str(d) for d in wheel_dirs if (d / h).is_file()]
    if not found:
        sys.exit(f"{h}: not in {toolkit} nor in torch's nvidia wheels {[str(d) for d in wheel_dirs]}")
    include_dirs.append(found[0])
print("deep_ep_cpp: CUDA_HOME", CUDA_HOME, "include dirs", include_dirs, flush=True)
common = ["-DDISABLE_NVSHMEM", "-DDISABLE_AGGRESSIVE_PTX_INSTRS"]
cxx = ["-O3", "-Wno-deprecated-declarations", "-Wno-unused-variable", "-Wno-sign-compare", "-Wno-reorder",
       "-Wno-attributes"] + common
nvcc = ["-O3", "-Xcompiler", "-O3"] + common
if os.environ["PTXAS_LEVEL"] == "1":
    nvcc.append("--ptxas-options=--register-usage-level=10")
sources = ["csrc/deep_ep.cpp", "csrc/kernels/runtime.cu", "csrc/kernels/layout.cu", "csrc/kernels/intranode.cu"]
print("deep_ep_cpp: sources", sources, "cxx", cxx, "nvcc", nvcc, "arch", os.environ["TORCH_CUDA_ARCH_LIST"],
      flush=True)
ext = CUDAExtension(name="deep_ep_cpp", sources=sources, include_dirs=include_dirs,
                    extra_compile_args={"cxx": cxx, "nvcc": nvcc})
setuptools.setup(name="deep_ep", version="1.2.1", ext_modules=[ext], cmdclass={"build_ext": BuildExtension},
                 script_args=["-q", "build_ext", "--build-lib", out, "--build-temp", out + "/tmp"])
PY
  )
  cp "$work"/out/deep_ep_cpp*.so "$site/"
  echo "built deep_ep_cpp in $(( $(date +%s) - b0 )) s (MAX_JOBS=$MAX_JOBS, ptxas register-usage-level:" \
    "$ptxas_level): $(du -h "$site"/deep_ep_cpp*.so | cut -f1)"
  if [[ -n $cache ]]; then
    mkdir -p "$cache"
    xz -T0 -6 -c "$site/deep_ep_cpp$suffix" > "$cache/$key"
    echo "saved it as $cache/$key ($(du -h "$cache/$key" | cut -f1))"
  fi
fi
echo "DeepEP 1.2.1 ready in $site after $(( $(date +%s) - t0 )) s; use PYTHONPATH=$site"

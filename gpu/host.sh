# source gpu/host.sh -- from the project root on the GPU host, at the start of a round:
#  - the stack bundle (.device-wheels, ../shared/device/README.md) unpacked into /tmp/site, on PYTHONPATH, with the
#    package metadata mamba-ssm's sources lack (the plugin's requirement check reads its version from it);
#  - Transformer Engine when .device-te is taken along, its torch extension restored from .te-cache (a copy of
#    ../shared/device/te-cache) or built there;
#  - nam and every plugin installed editable, no index;
#  - the kernel caches of earlier rounds: NAM_CACHE_DIR=$PWD/.kcache/nam (TileLang's and Triton's caches live
#    under it, nam_core/cache.py), restored from .kcache/kcache.tgz when taken along; `kcache_pack` writes the
#    caches back to $OUT/kcache.tgz for the next round;
#  - `python` on PATH (the host has python3 only).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site NAM_CACHE_DIR=$PWD/.kcache/nam
_t0=$SECONDS
bash .device-wheels/install.sh >/dev/null
_meta=/tmp/site/mamba_ssm-2.3.2.post1.dist-info
mkdir -p "$_meta" && printf 'Metadata-Version: 2.1\nName: mamba_ssm\nVersion: 2.3.2.post1\n' > "$_meta/METADATA"
if [[ -d .device-te ]]; then
  mkdir -p .te-cache && bash .device-te/install-te.sh "$PWD/.te-cache" >/dev/null
fi
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . $(ls -d plugins/nam-plugin-*) >/dev/null
mkdir -p /tmp/bin "$NAM_CACHE_DIR"
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/bin/python && chmod +x /tmp/bin/python
export PATH=/tmp/bin:$PATH
[[ -f .kcache/kcache.tgz ]] && tar -C .kcache -xf .kcache/kcache.tgz  # gzip or xz: tar reads either
kcache_pack() { tar -C .kcache -cf - nam | xz -3 -T0 > "$OUT/kcache.tgz" && ls -la "$OUT/kcache.tgz"; }
export -f kcache_pack  # callable from a round script run as `bash gpu/rN.sh`
# scripts that launch kernels without nam's run path (gpu/mimo_kernels.py, bench/*.py) compile into the same
# caches nam_core.cache.use_kernel_caches() would pick, so kcache_pack takes their builds along too (r29-r32's
# packs were empty: those scripts compiled into Triton's default folder)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$NAM_CACHE_DIR/triton} TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$NAM_CACHE_DIR/tilelang}
echo "== host ready in $((SECONDS - _t0)) s: $(python -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'), TE: $(python -c 'import transformer_engine as t; print(t.__version__)' 2>&1 | tail -1)"

#!/bin/bash
# GPU round for the deepep branch (issue 29 part 2). Needs .device-deepep/ carried along (made here by
# `bash plugins/nam-plugin-deepep/device/fetch-deepep.sh`); with .deepep-cache/ carried too (the
# deep_ep_cpp-*.so.xz that an earlier round left in $OUT), the build is restored instead of compiled.
# Steps: build (or restore) DeepEP v1.2.1 into /tmp/site, timed; import it; a one-rank NCCL buffer; two
# ranks on one GPU (gloo group) through the real 2-rank intranode kernels, then through Megatron's flex
# dispatcher; `nam preflight` with the plugin at EP 1 and EP 2 (plugins/nam-plugin-deepep/device/probe_deepep.py
# says what each probe checks against).
# Everything is bounded so the script ends within ~4 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/deepep-out}
mkdir -p "$OUT" .deepep-cache
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # left, limit, log, step
BUDGET=230 STEP_MIN=10 SUMMARY=summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' | tee -a "$OUT/gpu.txt"
nvcc --version | tail -2 | tee -a "$OUT/gpu.txt"
if [[ ! -f .device-deepep/deepep-src.tar.xz ]]; then
  log "FAIL: .device-deepep/ was not carried (make it with plugins/nam-plugin-deepep/device/fetch-deepep.sh)"
  exit 1
fi
cp plugins/nam-plugin-deepep/device/install-deepep.sh .device-deepep/  # the committed one, never a stale copy
log "build or restore DeepEP 1.2.1 (MAX_JOBS=16, limit 205 s)"
MAX_JOBS=16 timeout -k 5 205 bash .device-deepep/install-deepep.sh .deepep-cache > "$OUT/build.log" 2>&1
rc=$?
tail -5 "$OUT/build.log"
cp .deepep-cache/deep_ep_cpp-*.so.xz "$OUT/" 2>/dev/null
log "install rc=$rc; cache files: $(ls .deepep-cache)"
if [[ $rc -ne 0 ]]; then
  grep -n -i "error" "$OUT/build.log" | head -30
  exit 1
fi
P=plugins/nam-plugin-deepep/device/probe_deepep.py
run_probe() {  # name, limit, args...: like step, but the probe's JSON lines and its stderr in two files
  local name=$1 lim; lim=$(limit "$2"); shift 2
  if (( lim < STEP_MIN )); then log "$name: skipped, out of time (limit ${lim}s)"; return; fi
  timeout -k 5 "$lim" python3 "$P" "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
  local r=$?
  cat "$OUT/$name.jsonl"; tail -5 "$OUT/$name.err"
  log "$name rc=$r"
}
run_probe import 30 import
run_probe one-rank 40 one-rank
run_probe two-ranks-one-gpu 50 ranks-on-one-gpu 2
run_probe megatron-flex-two-ranks-one-gpu 90 megatron-flex 2
# both refused on one GPU: EP 1 by its row; EP 2 passes its rows and the extension's, and fails peer access
# (one GPU visible). nam56r-tiny: only the reference plugin besides deepep, so no other kernel builds here.
for args in "--ep 1" "--ep 2 --nproc 2"; do
  name=preflight-${args// /}
  if (( $(left) > 25 )); then
    timeout "$(left)" nam preflight --recipe nam56r-tiny --device cuda --engine megatron --plugins deepep $args \
      --json > "$OUT/$name.json" 2> "$OUT/$name.err"
    log "$name rc=$? (exit 3 expected)"
    python3 -c 'import json, sys
for c in json.load(open(sys.argv[1])).get("checks", []):
    if c["plugin"] == "deepep": print(" ", c["check"], c["status"], "|", c["found"], "|", c.get("hint") or "")' \
      "$OUT/$name.json" || tail -5 "$OUT/$name.err"
  fi
done
log "done"

# The time budget of a GPU round, one copy for every gpu/*.sh: source it, then set (before the first step)
#   BUDGET    the seconds the whole script may run (under the device's limit per command)
#   STEP_MIN  the fewest seconds a step is worth starting with; with less left it is skipped
#   STEP_EXT  the ending of a step's output file in $OUT (.log or .txt)
# and, optionally, STEP_TAIL (lines of a step's output shown after it) and SUMMARY (a file in $OUT that
# every log line is appended to as well). Time is bash's SECONDS: the seconds since the script started.

left() { echo $(( BUDGET - SECONDS )); }

limit() {  # limit SECONDS_WANTED: the smaller of what a step wants and what is left
  local t; t=$(left)
  (( $1 < t )) && t=$1
  echo "$t"
}

log() {  # log MESSAGE...: one line with the time since the start, on stdout and in $OUT/$SUMMARY when set
  if [[ -n ${SUMMARY:-} ]]; then
    echo "== $* (t=${SECONDS} s)" | tee -a "$OUT/$SUMMARY"
  else
    echo "== $* (t=${SECONDS} s)"
  fi
}

step() {  # step SECONDS_WANTED NAME CMD...: CMD under `limit SECONDS_WANTED`, its output in $OUT/NAME$STEP_EXT
  local name=$2 t; t=$(limit "$1"); shift 2
  if (( t < STEP_MIN )); then log "$name: skipped, out of time (limit ${t}s)"; return; fi
  log "$name (limit ${t}s)"
  timeout -k 5 "$t" "$@" > "$OUT/$name$STEP_EXT" 2>&1
  local r=$?
  (( ${STEP_TAIL:-0} > 0 )) && tail -n "$STEP_TAIL" "$OUT/$name$STEP_EXT"
  log "$name rc=$r"
}

startup() {  # startup RUN_DIR: a run's launch-to-first-step breakdown (summary.json), on stdout and in $OUT/$SUMMARY
  python -c 'import json,sys; s=json.load(open(sys.argv[1])); print({k: s.get(k) for k in ("launch_to_first_step_s", "startup_s", "self_tests_s", "first_step_s", "step_tokens_per_s")})' \
    "$1/summary.json" | if [[ -n ${SUMMARY:-} ]]; then tee -a "$OUT/$SUMMARY"; else cat; fi
}

collect_runs() {  # collect_runs SRC DEST: each run folder under SRC, its JSON, JSONL and log files, into DEST/<name>
  local d
  for d in "$1"/*; do
    [[ -d $d ]] || continue
    mkdir -p "$2/$(basename "$d")"
    cp "$d"/*.json "$d"/*.jsonl "$d"/*.log "$2/$(basename "$d")/" 2>/dev/null
  done
}

ncu_profile() {  # ncu_profile NAME KERNEL_REGEX LAUNCHES SECONDS CMD...: Nsight Compute over LAUNCHES launches of CMD's
  # profiled range (source counters, warp states, occupancy, launch, speed of light); keeps in $OUT the SASS page
  # (NAME.sass.csv.gz, for gpu/ncu_lines.py), the details page (NAME.details.log, its headline lines appended to
  # $SUMMARY) and the stall table (NAME.stalls.txt, gpu/ncu_stalls.py); the report itself is dropped (too large)
  local name=$1 regex=$2 count=$3 secs=$4 ncu; shift 4
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  step "$secs" "$name" "$ncu" --profile-from-start off --clock-control none --kernel-name regex:"$regex" \
    --launch-count "$count" --import-source yes --section SourceCounters --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SpeedOfLight -o "$OUT/$name" -f "$@"
  [[ -f $OUT/$name.ncu-rep ]] || return
  step 60 "$name.sass" bash -c "'$ncu' -i '$OUT/$name.ncu-rep' --page source --csv --print-source sass > '$OUT/$name.sass.csv'"
  step 30 "$name.details" "$ncu" -i "$OUT/$name.ncu-rep" --page details
  step 20 "$name.stalls" bash -c "python gpu/ncu_stalls.py '$OUT/$name.sass.csv' > '$OUT/$name.stalls.txt'"
  rm -f "$OUT/$name.ncu-rep" && gzip -f "$OUT/$name.sass.csv"
  grep -E "^  [a-z_]+kernel|Duration|Registers Per|Achieved Occupancy|Block Size|Grid Size" \
    "$OUT/$name.details$STEP_EXT" >> "$OUT/${SUMMARY:-/dev/null}"
}

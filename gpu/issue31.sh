# issue 31 on the GPU host: cold then warm `nam preflight --recipe nam56r` (MBS 2), then the checkpoint bench
set -x
nvidia-smi --query-gpu=name,memory.total --format=csv
cold=/tmp/coldcache; rm -rf $cold; mkdir -p $cold
s=$(date +%s)
NAM_CACHE_DIR=$cold timeout 230 nam preflight --recipe nam56r --set train.micro_batch_size=2 > $OUT/preflight_cold.txt 2>&1
echo "cold preflight rc=$? $(( $(date +%s) - s )) s"
tail -40 $OUT/preflight_cold.txt
cp -rn $cold/. $NAM_CACHE_DIR/ 2>/dev/null
df -h /tmp . | tail -2
timeout 290 python3 bench/checkpoint.py --steps 4 --every 2 --mbs 2 --modes async --numerics bf16 --work /tmp --keep --json $OUT/checkpoint_h200.json
echo "bench rc=$?"
for f in /tmp/nam-checkpoint-*/async/run.log; do tail -30 $f; cp $f $OUT/async_run.log; done
cat /tmp/nam-checkpoint-*/async/summary.json 2>/dev/null | head -60

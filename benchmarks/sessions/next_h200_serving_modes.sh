#!/bin/bash
# Prepared for the next H200 session (not yet run): server vs offline at 64 streams with the engine on a thread
# and in its own process (issue 5), and the engine on generate's prompts (issue 6). About 7 minutes.
# Run through the device tool with carry [".whl"] (bash ../shared/tools/device-wheels.sh makes it).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
log() { echo "$* t=$(el)s" | tee -a $OUT/times.txt; }
COMMON="--shape qwen3-0.6b --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 64 --async-scheduling"
timeout 200 python3 -m benchmarks.throughput $COMMON --workload nano-vllm --max-concurrency 64 --out $OUT/offline_c64.json > $OUT/offline_c64.log 2>&1
log "offline c64 rc=$?"; grep -E '"(output_tok_s|elapsed_s)"' $OUT/offline_c64.json
timeout 60 python3 -m benchmarks.throughput $COMMON --workload random --num-prompts 256 --input-len 128 --output-len 128 --out $OUT/engine_generate_prompts.json > $OUT/engine_generate_prompts.log 2>&1
log "engine on generate's prompts rc=$?"; grep -E '"(output_tok_s|elapsed_s)"' $OUT/engine_generate_prompts.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
for mode in --no-engine-process --engine-process; do
  PYTHONPATH=/tmp/site:$PWD python3 -m serving qwen3-0.6b --load-format dummy --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 64 --async-scheduling --uvicorn-log-level warning $mode > $OUT/server$mode.log 2>&1 &
  SP=$!
  for i in $(seq 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  log "server $mode up after $i"
  PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m benchmarks.serving --dataset nano-vllm --max-concurrency 64 --result-file $OUT/serving$mode.json > $OUT/serving$mode.log 2>&1
  log "serving $mode rc=$?"; grep -E "Output token throughput|Median TTFT|Median TPOT" $OUT/serving$mode.log
  kill $SP; wait $SP 2>/dev/null
done

#!/bin/bash
# Server vs offline at 64 streams (same engine config), then the generate() table.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
log() { echo "$* t=$(el)s" | tee -a $OUT/times.txt; }
COMMON="--shape qwen3-0.6b --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 64 --async-scheduling"
timeout 200 python3 -m benchmarks.throughput $COMMON --workload nano-vllm --max-concurrency 64 --out $OUT/offline_c64.json > $OUT/offline_c64.log 2>&1
log "offline c64 rc=$?"; grep -E '"(output_tok_s|elapsed_s|startup_to_first_token_s)"' $OUT/offline_c64.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
PYTHONPATH=/tmp/site:$PWD python3 -m serving qwen3-0.6b --load-format dummy --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 64 --async-scheduling --uvicorn-log-level warning > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break; sleep 1; done
log "server up after $i"
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m benchmarks.serving --dataset nano-vllm --max-concurrency 64 --result-file $OUT/serving_c64.json > $OUT/serving_c64.log 2>&1
log "serving rc=$?"; grep -E "throughput|TTFT|TPOT" $OUT/serving_c64.log
kill $SP; wait $SP 2>/dev/null
for shape in qwen3-0.6b llama-3.1-8b; do
  left=$(( 555 - $(el) )); [ $left -lt 30 ] && break
  timeout $left python3 -m benchmarks.generate --shapes $shape --repeats 3 --out $OUT/generate_$shape.json > $OUT/generate_$shape.log 2>&1
  log "generate $shape rc=$?"; grep '^{' $OUT/generate_$shape.log | cut -c1-330
done

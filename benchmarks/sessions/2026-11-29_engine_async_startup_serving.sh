#!/bin/bash
# Engine figures after the sampler / dispatch-thread changes; warm start-up; offline vs server at 64 streams.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
log() { echo "$* t=$(el)s" | tee -a $OUT/times.txt; }
COMMON="--shape qwen3-0.6b --workload nano-vllm --max-num-batched-tokens 2048 --max-model-len 4096"
timeout 260 python3 -m benchmarks.throughput $COMMON --async-scheduling --breakdown --out $OUT/nano_async.json > $OUT/nano_async.log 2>&1
log "nano async rc=$?"
grep -E '"(output_tok_s|elapsed_s|startup_to_first_token_s|fraction_of_floor|wait_s|dispatch_s|packing_s|steps)"' $OUT/nano_async.json
timeout 90 python3 -m benchmarks.throughput $COMMON --async-scheduling --startup-only --out $OUT/startup_warm.json > $OUT/startup_warm.log 2>&1
log "warm startup rc=$?"; grep startup_to $OUT/startup_warm.json
timeout 110 python3 -m benchmarks.throughput $COMMON --async-scheduling --max-concurrency 64 --out $OUT/nano_c64.json > $OUT/nano_c64.log 2>&1
log "offline c64 rc=$?"; grep -E '"(output_tok_s|elapsed_s)"' $OUT/nano_c64.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 -m serving qwen3-0.6b --load-format dummy --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 256 --async-scheduling --uvicorn-log-level warning > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 150); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break; sleep 1; done
log "server up? $i"
timeout $(( 540 - $(el) )) python3 -m benchmarks.serving --dataset nano-vllm --max-concurrency 64 --result-file $OUT/serving_c64.json > $OUT/serving_c64.log 2>&1
log "serving rc=$?"; tail -25 $OUT/serving_c64.log
kill $SP; wait $SP 2>/dev/null
if [ $(el) -lt 480 ]; then
  export PYTHONPATH=$PWD
  timeout $(( 570 - $(el) )) python3 -m benchmarks.step_profile --shape qwen3-0.6b --decode 1x1024 --prefill '' --repeats 5 --attention-impl reference --out $OUT/step_ref.json > $OUT/step_ref.log 2>&1
  log "step ref rc=$?"; grep '"kind"' $OUT/step_ref.log | cut -c1-400
fi

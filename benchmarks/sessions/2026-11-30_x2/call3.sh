#!/bin/bash
# Ran 2026-11-30 ~01:01 UTC (code c9bd633). Device kind nvidia-h200-x2, about 9 minutes: the engine after the searchsorted fix (no while loop per attention
# call). Two single-GPU tracks that never share a GPU:
#   A (GPU0): Qwen3-0.6B: nano-vllm (cold start + throughput), warm start, engine on generate's prompts at 256 seqs,
#      step profile, then offline vs server (engine process) at 64 streams.
#   B (GPU1): kernels (decode vs JAX's paged_attention, decode grid), Llama-3.1-8B vLLM-default (cold start +
#      throughput), warm start, batch-1 step profile.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
log() { echo "$* t=$(el)s" | tee -a $OUT/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > $OUT/times.txt 2>&1
KEYS='"(output_tok_s|total_tok_s|requests_per_s|elapsed_s|startup_to_first_token_s|fraction_of_floor|steps)"'

track_a() {
  export CUDA_VISIBLE_DEVICES=0
  Q="--shape qwen3-0.6b --max-num-batched-tokens 2048 --max-model-len 4096 --async-scheduling"
  timeout 200 python3 -m benchmarks.throughput $Q --workload nano-vllm --breakdown --out /tmp/a_nano.json > /tmp/a.log 2>&1
  log "A nano-vllm (cold) rc=$?"; grep -E "$KEYS" /tmp/a_nano.json | tee -a $OUT/times.txt
  timeout 60 python3 -m benchmarks.throughput $Q --workload nano-vllm --startup-only --out /tmp/a_warm.json >> /tmp/a.log 2>&1
  log "A warm startup rc=$?"; grep startup_to /tmp/a_warm.json | tee -a $OUT/times.txt
  timeout 60 python3 -m benchmarks.throughput $Q --workload random --num-prompts 256 --input-len 128 --output-len 128 --out /tmp/a_gen_prompts.json >> /tmp/a.log 2>&1
  log "A engine on generate's prompts (256 seqs) rc=$?"; grep -E "$KEYS" /tmp/a_gen_prompts.json | tee -a $OUT/times.txt
  timeout 120 python3 -m benchmarks.step_profile --shape qwen3-0.6b --repeats 5 --out /tmp/a_step.json > /tmp/a_step.log 2>&1
  log "A step profile rc=$?"; grep '^|' /tmp/a_step.log >> $OUT/times.txt
  C="$Q --max-num-seqs 64"
  timeout 150 python3 -m benchmarks.throughput $C --workload nano-vllm --max-concurrency 64 --out /tmp/a_c64.json >> /tmp/a.log 2>&1
  log "A offline c64 rc=$?"; grep -E "$KEYS" /tmp/a_c64.json | tee -a $OUT/times.txt
  PYTHONPATH=/tmp/site:$PWD python3 -m serving qwen3-0.6b --load-format dummy --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 64 --async-scheduling --uvicorn-log-level warning --engine-process > /tmp/server.log 2>&1 &
  SP=$!
  for i in $(seq 100); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  log "A server up after $i s"
  PYTHONPATH=/tmp/site:$PWD timeout $(( 560 - $(el) )) python3 -m benchmarks.serving --dataset nano-vllm --max-concurrency 64 --result-file /tmp/a_serving.json > /tmp/a_serving.log 2>&1
  log "A serving c64 rc=$?"; grep -E "Output token throughput|TTFT|TPOT" /tmp/a_serving.log | tee -a $OUT/times.txt
  kill $SP; wait $SP 2>/dev/null
  cat /tmp/a_step.log /tmp/a_serving.log /tmp/server.log >> /tmp/a.log
}

track_b() {
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/kernels.py --out /tmp/k --repeats 5 --budget-s 130 --sections ceiling,check,decode_compare,decode_grid > /tmp/k_stdout.log 2>&1
  log "B kernels rc=$?"
  L="--shape llama-3.1-8b --async-scheduling"
  timeout 280 python3 -m benchmarks.throughput $L --workload vllm-default --out /tmp/b_llama.json > /tmp/b.log 2>&1
  log "B llama vllm-default (cold) rc=$?"; grep -E "$KEYS" /tmp/b_llama.json | tee -a $OUT/times.txt
  timeout 60 python3 -m benchmarks.throughput $L --workload vllm-default --startup-only --out /tmp/b_llama_warm.json >> /tmp/b.log 2>&1
  log "B llama warm startup rc=$?"; grep startup_to /tmp/b_llama_warm.json | tee -a $OUT/times.txt
  timeout $(( 555 - $(el) )) python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode 1x1024,32x1024 --prefill '' --temperature 0 --repeats 5 --out /tmp/b_step.json > /tmp/b_step.log 2>&1
  log "B llama step profile rc=$?"; grep '^|' /tmp/b_step.log >> $OUT/times.txt
  cat /tmp/b_step.log >> /tmp/b.log
}

track_a & APID=$!
track_b & BPID=$!
wait $APID $BPID
python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]; bundle = {}
for p in sorted(glob.glob("/tmp/*.json") + glob.glob("/tmp/k/*.json")):
    try: bundle[p] = json.load(open(p))
    except Exception as e: bundle[p] = repr(e)
json.dump(bundle, open(f"{out}/results.json", "w"), indent=1)
PY
cp /tmp/k/kernels.log $OUT/kernels.log 2>/dev/null; tail -c 60000 /tmp/a.log > $OUT/engine_a.log; tail -c 30000 /tmp/b.log > $OUT/engine_b.log
log done

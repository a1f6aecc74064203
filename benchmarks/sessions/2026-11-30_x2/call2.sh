#!/bin/bash
# Ran 2026-11-30 ~00:51 UTC (code 8641a25). Device kind nvidia-h200-x2, about 9 minutes. Three tracks, arranged so that no two timed GPU phases share a GPU:
#   S (both GPUs, first ~2.5 min): benchmarks.sharding re-run (pipelined step time) for issue 9.
#   A (GPU0): Qwen3-0.6B engine. Its cold compile (CPU work, GPU idle) overlaps S; then offline at 64 streams,
#      the engine on generate's prompts (issue 6), and the server with the engine on a thread and in a process
#      (issue 5). Every A process gets the same XLA memory fraction, so the KV pool and the compile-cache keys match.
#   K (GPU1, after S): benchmarks/kernels.py: prefill variants, decode vs JAX's paged_attention, decode grid (issue 3).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
log() { echo "$* t=$(el)s" | tee -a $OUT/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > $OUT/times.txt 2>&1

track_s() {
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.55
  for spec in "tput --layouts tp1,tp2,dp2xtp1 --batch 64" "batch1 --layouts tp1,tp2 --batch 1"; do
    set -- $spec; name=$1; shift
    timeout 150 python3 -m benchmarks.sharding --shape llama-3.1-8b --dtype bfloat16 "$@" --prompt-len 512 \
      --decode-steps 64 --repeats 2 --out /tmp/sh_$name.json > /tmp/sh_$name.log 2>&1
    log "S sharding $name rc=$?"; cat /tmp/sh_$name.log >> $OUT/sharding.log
  done
}

track_a() {
  export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.35
  COMMON="--shape qwen3-0.6b --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 64 --async-scheduling"
  timeout 260 python3 -m benchmarks.throughput $COMMON --workload nano-vllm --startup-only --out /tmp/a_cold.json > /tmp/a.log 2>&1
  log "A cold startup-only rc=$?"; grep startup_to /tmp/a_cold.json | tee -a $OUT/times.txt
  while kill -0 $SPID 2>/dev/null; do sleep 1; done; log "A: S finished"
  timeout 120 python3 -m benchmarks.throughput $COMMON --workload nano-vllm --max-concurrency 64 --out /tmp/a_offline_c64.json >> /tmp/a.log 2>&1
  log "A offline c64 rc=$?"; grep -E '"(output_tok_s|elapsed_s|startup_to_first_token_s)"' /tmp/a_offline_c64.json | tee -a $OUT/times.txt
  timeout 90 python3 -m benchmarks.throughput $COMMON --workload random --num-prompts 256 --input-len 128 --output-len 128 --out /tmp/a_engine_generate_prompts.json >> /tmp/a.log 2>&1
  log "A engine on generate's prompts rc=$?"; grep -E '"(output_tok_s|elapsed_s)"' /tmp/a_engine_generate_prompts.json | tee -a $OUT/times.txt
  for mode in --engine-process --no-engine-process; do
    PYTHONPATH=/tmp/site:$PWD python3 -m serving qwen3-0.6b --load-format dummy --max-num-batched-tokens 2048 --max-model-len 4096 --max-num-seqs 64 --async-scheduling --uvicorn-log-level warning $mode > /tmp/server$mode.log 2>&1 &
    SP=$!
    for i in $(seq 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break; sleep 1; done
    log "A server $mode up after $i s"
    PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m benchmarks.serving --dataset nano-vllm --max-concurrency 64 --result-file /tmp/serving$mode.json > /tmp/serving$mode.log 2>&1
    log "A serving $mode rc=$?"; grep -E "Output token throughput|Median TTFT|P99 TTFT|Median TPOT|P99 TPOT" /tmp/serving$mode.log | tee -a $OUT/times.txt
    kill $SP; wait $SP 2>/dev/null
    cat /tmp/serving$mode.log /tmp/server$mode.log >> $OUT/serving.log
  done
}

track_k() {
  while kill -0 $SPID 2>/dev/null; do sleep 1; done; log "K: S finished"
  export CUDA_VISIBLE_DEVICES=1
  timeout $(( 555 - $(el) )) python3 benchmarks/kernels.py --out /tmp/k --repeats 5 --budget-s $(( 530 - $(el) )) \
    --sections ceiling,check,prefill_variants,decode_compare,decode_grid > /tmp/k_stdout.log 2>&1
  log "K kernels rc=$?"
}

track_s & SPID=$!
track_a & APID=$!
track_k & KPID=$!
wait $APID $KPID $SPID
# Collect (at most 8 files come back): JSON results bundled into one file.
python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]; bundle = {}
for p in sorted(glob.glob("/tmp/*.json") + glob.glob("/tmp/k/*.json")):
    try: bundle[p] = json.load(open(p))
    except Exception as e: bundle[p] = repr(e)
json.dump(bundle, open(f"{out}/results.json", "w"), indent=1)
PY
cp /tmp/k/kernels.log $OUT/kernels.log 2>/dev/null; tail -c 20000 /tmp/a.log > $OUT/engine.log; cat /tmp/k_stdout.log | tail -c 5000 >> $OUT/kernels.log
log done

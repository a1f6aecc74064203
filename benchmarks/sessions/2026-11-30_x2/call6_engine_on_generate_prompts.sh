#!/bin/bash
# Ran 2026-11-30 ~01:15 UTC, code b65b824: B=256 and 32 ran; B=1 failed (throughput.py warm-up bug, fixed after).
# Issue 6: the engine's offline throughput on generate's prompt shapes (B random prompts of 128 tokens, 128 new
# tokens, greedy, EOS ignored) for B = 256, 32, 1; Qwen3-0.6B on GPU0 and Llama-3.1-8B on GPU1 at the same time.
# Device kind nvidia-h200-x2. Engine defaults (max_num_seqs 256, max_num_batched_tokens 8192), async scheduling.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
track() {
  export CUDA_VISIBLE_DEVICES=$1; shape=$2
  for b in 256 32 1; do
    left=$(( 175 - $(el) )); [ $left -lt 5 ] && { echo "$shape B=$b skipped (time)"; continue; }
    timeout $left python3 -m benchmarks.throughput --shape $shape --workload random --num-prompts $b --input-len 128 \
      --output-len 128 --temperature 0 --async-scheduling --out $OUT/${shape}_b$b.json > /tmp/${shape}_b$b.log 2>&1
    echo "$shape B=$b rc=$? t=$(el)s $(grep -hE '"(output_tok_s|elapsed_s|startup_to_first_token_s)"' $OUT/${shape}_b$b.json 2>/dev/null | tr -d '\n ')"
  done
}
track 0 qwen3-0.6b & track 1 llama-3.1-8b & wait

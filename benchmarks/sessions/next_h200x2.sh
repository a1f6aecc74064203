#!/bin/bash
# Prepared for the next session (not yet run). Device kind nvidia-h200-x2, about 6 minutes, two single-GPU tracks.
#   GPU0: the engine at batch 1 on generate's prompt shape (issue 6's missing point), then generate's table again
#         after the searchsorted fix (benchmarks/generate.py uses the same kernel wrapper).
#   GPU1: the same for Llama-3.1-8B.
# Then (both GPUs) the Llama-3.1-8B sharding layouts again after the fix (issue 9's figures predate it).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
track() {
  export CUDA_VISIBLE_DEVICES=$1; shape=$2
  timeout 150 python3 -m benchmarks.throughput --shape $shape --workload random --num-prompts 1 --input-len 128 \
    --output-len 128 --temperature 0 --async-scheduling --out $OUT/${shape}_engine_b1.json > /tmp/${shape}_b1.log 2>&1
  echo "$shape engine B=1 rc=$? t=$(el)s"; grep -h output_tok_s $OUT/${shape}_engine_b1.json
  timeout 120 python3 -m benchmarks.generate --shapes $shape --repeats 3 --out $OUT/${shape}_generate.json \
    > /tmp/${shape}_gen.log 2>&1
  echo "$shape generate rc=$? t=$(el)s"; grep '^|' /tmp/${shape}_gen.log | tail -4
}
track 0 qwen3-0.6b & track 1 llama-3.1-8b & wait
timeout 150 python3 -m benchmarks.sharding --shape llama-3.1-8b --dtype bfloat16 --layouts tp1,tp2,dp2xtp1 --batch 64 \
  --prompt-len 512 --decode-steps 64 --repeats 2 --out $OUT/sharding_b64.json > /tmp/sh.log 2>&1
echo "sharding rc=$? t=$(el)s"; grep '^|' /tmp/sh.log

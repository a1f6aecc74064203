#!/bin/bash
# Prepared for the next session (not yet run). Device kind nvidia-h200-x2, about 6 minutes, two single-GPU tracks.
#   GPU0: the engine at batch 1 on generate's prompt shape (issue 6's missing point), then generate's table again
#         after the searchsorted fix (benchmarks/generate.py uses the same kernel wrapper).
#   GPU1: the same for Llama-3.1-8B.
# Then (GPU0 / GPU1 in parallel) the fused-projection A/B: step profile with and without --no-fuse-projections
# (prediction: Llama-3.1-8B batch-1 forward 5.19 ms -> ~4.4-4.6 ms if XLA's dot merger was concatenating the k/v
# (and q) weights at run time on every step; all_concatenates in forward_hlo shows it), and the nano-vllm bench.
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
ab() {
  export CUDA_VISIBLE_DEVICES=$1; shift
  for f in "" --no-fuse-projections; do
    timeout 100 python3 -m benchmarks.step_profile "$@" --repeats 5 $f --out /tmp/sp_${CUDA_VISIBLE_DEVICES}$f.json > /tmp/sp_$CUDA_VISIBLE_DEVICES.log 2>&1
    echo "step_profile $* $f rc=$?"; grep -E '"kind"|all_concatenates' /tmp/sp_$CUDA_VISIBLE_DEVICES.log | cut -c1-330
  done
}
ab 0 --shape llama-3.1-8b --decode 1x1024,32x1024 --prefill '' --temperature 0 --max-num-seqs 32 --max-num-batched-tokens 64 &
(ab 1 --shape qwen3-0.6b --decode 256x1024,1x1024 --prefill 1x2048
 CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m benchmarks.throughput --shape qwen3-0.6b --workload nano-vllm \
   --max-num-batched-tokens 2048 --max-model-len 4096 --async-scheduling --out $OUT/nano.json > /tmp/nano.log 2>&1
 echo "nano rc=$?"; grep -h output_tok_s $OUT/nano.json) & wait
timeout 150 python3 -m benchmarks.sharding --shape llama-3.1-8b --dtype bfloat16 --layouts tp1,tp2,dp2xtp1 --batch 64 \
  --prompt-len 512 --decode-steps 64 --repeats 2 --out $OUT/sharding_b64.json > /tmp/sh.log 2>&1
echo "sharding rc=$? t=$(el)s"; grep '^|' /tmp/sh.log

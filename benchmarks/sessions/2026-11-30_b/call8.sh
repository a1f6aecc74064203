#!/bin/bash
# Session 2026-11-30 (b), call 8. ~3 minutes. The final code end to end on the GPU:
#   GPU0: nano-vllm bench (the engine; default buckets keep the Triton kernel).
#   GPU1: generate, Llama-3.1-8B (B=256 x 128-token prompts = 32,768 prefill tokens: auto takes the Mosaic kernel),
#         then a Llama prefill step with the Mosaic kernel inside the engine's model runner (max_num_seqs 8).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /tmp/res
(CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m benchmarks.throughput --shape qwen3-0.6b --workload nano-vllm \
   --max-num-batched-tokens 2048 --max-model-len 4096 --async-scheduling --out /tmp/res/nano.json \
   > /tmp/res/nano.log 2>&1; echo "nano rc=$?"; grep -h '"output_tok_s"\|"fraction_of_floor"' /tmp/res/nano.json) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 100 python3 -m benchmarks.generate --shapes llama-3.1-8b --repeats 3 --out /tmp/res/gen_llama.json \
   > /tmp/res/gen_llama.log 2>&1; echo "generate rc=$?"; grep '^|' /tmp/res/gen_llama.log | tail -4
 timeout 90 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode '' --prefill 2x1000,1x4096 \
   --temperature 0 --max-num-seqs 8 --max-num-batched-tokens 4096 --max-model-len 8192 --repeats 5 \
   --out /tmp/res/sp_prefill.json > /tmp/res/sp_prefill.log 2>&1
 echo "prefill rc=$?"; grep -h '"kind"' /tmp/res/sp_prefill.log | cut -c1-200) &
wait
tar czf $OUT/results.tgz -C /tmp res

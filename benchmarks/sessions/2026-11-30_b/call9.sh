#!/bin/bash
# Session 2026-11-30 (b), call 9. ~2.5 minutes. The engine's new (1, 1) bucket, end to end.
# Prediction: Llama-3.1-8B batch-1 engine 226.5 -> ~235-240 output tok/s (forward 5.10 -> 4.82 ms in call 2);
# the step profile at the engine's default buckets now picks (1, 1) for one sequence.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /tmp/res
(CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m benchmarks.throughput --shape llama-3.1-8b --workload random \
   --num-prompts 1 --input-len 128 --output-len 128 --temperature 0 --async-scheduling \
   --out /tmp/res/llama_engine_b1.json > /tmp/res/llama_engine_b1.log 2>&1; echo "llama b1 rc=$?"
 grep -h '"output_tok_s"' /tmp/res/llama_engine_b1.json) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 100 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode 1x1024,1x128 --prefill '' \
   --temperature 0 --max-num-seqs 32 --max-num-batched-tokens 64 --repeats 7 --out /tmp/res/sp_b1.json \
   > /tmp/res/sp_b1.log 2>&1; echo "sp rc=$?"; grep -h '"kind"' /tmp/res/sp_b1.log | cut -c1-250
 timeout 100 python3 -m benchmarks.throughput --shape qwen3-0.6b --workload random --num-prompts 1 --input-len 128 \
   --output-len 128 --temperature 0 --async-scheduling --out /tmp/res/qwen_engine_b1.json \
   > /tmp/res/qwen_engine_b1.log 2>&1; echo "qwen b1 rc=$?"; grep -h '"output_tok_s"' /tmp/res/qwen_engine_b1.json) &
wait
tar czf $OUT/results.tgz -C /tmp res

#!/bin/bash
# Session 2026-11-30 (b), call 7. ~2 minutes. Issue 8's batch-1 gap: generate's decode step is 4.16 ms (1.11x the
# floor) while the engine's forward at its own 1-token bucket is 4.82 ms with the same model code and kernels.
# Kernel-by-kernel traces of both, side by side (GPU0: engine forward; GPU1: generate B=1, 128 new tokens).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /tmp/res
(CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode 1x128,1x1024 \
   --prefill '' --temperature 0 --max-num-seqs 32 --max-num-batched-tokens 64 --repeats 5 --exact-decode-buckets \
   --trace --trace-top 40 --out /tmp/res/engine_trace.json > /tmp/res/engine_trace.log 2>&1; echo "engine rc=$?") &
(CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m benchmarks.generate --shapes llama-3.1-8b --batch-sizes 1 \
   --repeats 3 --trace --trace-top 40 --out /tmp/res/generate_trace.json > /tmp/res/generate_trace.log 2>&1
 echo "generate rc=$?") &
wait
grep -v "^WARNING\|^I0\|^W0" /tmp/res/engine_trace.log | grep '"kind"\|us/step' | cut -c1-180
grep -v "^WARNING\|^I0\|^W0" /tmp/res/generate_trace.log | grep 'busy\|us/token\|decode_step' | cut -c1-180
tar czf $OUT/results.tgz -C /tmp res

#!/bin/bash
# Session 2026-11-30 (b), call 3. Device kind nvidia-h200-x2, ~4 minutes.
#   GPU0: the Mosaic GPU prefill kernel again, now lowered with Lane semantics (call 2: jax 0.11's default
#         Warpgroup semantics failed in layout inference): correctness first, then peers and variants.
#   GPU1: where the Llama-3.1-8B batch-1 decode forward spends its time (jax.profiler kernel breakdown), at its own
#         1-token bucket; then the model-level prefill 1x2048 with the Triton kernel vs auto (Mosaic).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
mkdir -p /tmp/res
(export CUDA_VISIBLE_DEVICES=0
 timeout 250 python3 benchmarks/kernels.py --out /tmp/res --repeats 5 --budget-s 220 \
   --section-budgets check_mosaic=70,prefill_variants=120 \
   --sections check_mosaic,ceiling,prefill_peers,prefill_variants --max-variants 1 --mosaic-variants 4 \
   > /tmp/res/kern_stdout.log 2>&1; echo "kernels rc=$? t=$(el)s") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 100 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode 1x1024 --prefill '' \
   --temperature 0 --max-num-seqs 32 --max-num-batched-tokens 64 --repeats 5 --exact-decode-buckets --trace \
   --trace-top 30 --out /tmp/res/sp_llama_b1_trace.json > /tmp/res/sp_llama_b1_trace.log 2>&1
 echo "trace rc=$? t=$(el)s"; grep -v "^WARNING\|^I0\|^W0" /tmp/res/sp_llama_b1_trace.log | grep -h '"kind"\|us/step' | cut -c1-200
 for impl in auto pallas; do
   timeout 100 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode '' --prefill 1x2048 \
     --temperature 0 --max-num-seqs 8 --max-num-batched-tokens 2048 --repeats 5 --attention-impl $impl \
     --out /tmp/res/sp_llama_prefill_$impl.json > /tmp/res/sp_llama_prefill_$impl.log 2>&1
   echo "prefill $impl rc=$? t=$(el)s"; grep -h '"kind"' /tmp/res/sp_llama_prefill_$impl.log | cut -c1-260
 done) &
wait
grep -v "^$" /tmp/res/kernels.log | tail -45
grep -m3 -B2 -A12 "Error\|error" /tmp/res/kern_stdout.log | grep -v "^  File.*site-packages/jax/_src/\(interpreters\|core\|api\|pjit\)" | tail -40
tar czf $OUT/results.tgz -C /tmp res
echo "total t=$(el)s"

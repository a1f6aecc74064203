#!/bin/bash
# Session 2026-11-30 (b), call 2. Device kind nvidia-h200-x2, ~5 minutes.
#   GPU0: the Mosaic GPU prefill kernel: correctness vs the reference first, then the 4k prefill beside the Triton
#         kernel, dense Triton / cuDNN / JAX's dense Mosaic FA3, and its tuning variants.
#         Prediction: ~300-360 TFLOP/s on 1x4096 (dense FA3 378; paging costs a little: 8 TMA boxes per K/V step).
#   GPU1: Llama-3.1-8B batch-1 decode step at its own bucket (1 token) vs the default (16 tokens x 8 seqs).
#         Prediction: forward 4.94 -> ~4.2 ms if the 16-row GEMMs are what costs (generate's M=1 step: 4.16 ms).
#         Then the model-level prefill 1x2048 (Llama-3.1-8B) with the Triton kernel vs auto (Mosaic).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
mkdir -p /tmp/res
(export CUDA_VISIBLE_DEVICES=0
 timeout 280 python3 benchmarks/kernels.py --out /tmp/res --repeats 5 --budget-s 250 \
   --section-budgets check_mosaic=60,prefill_variants=120 \
   --sections check_mosaic,ceiling,prefill_peers,prefill_variants --max-variants 2 --mosaic-variants 4 \
   > /tmp/res/kern_stdout.log 2>&1; echo "kernels rc=$? t=$(el)s") &
(export CUDA_VISIBLE_DEVICES=1
 for f in --exact-decode-buckets ""; do
   timeout 100 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode 1x1024,2x1024,8x1024 --prefill '' \
     --temperature 0 --max-num-seqs 32 --max-num-batched-tokens 64 --repeats 5 $f --out /tmp/res/sp_llama_b1$f.json \
     > /tmp/res/sp_llama_b1$f.log 2>&1
   echo "step_profile $f rc=$? t=$(el)s"; grep -h '"kind"' /tmp/res/sp_llama_b1$f.log | cut -c1-260
 done
 for impl in pallas auto; do
   timeout 100 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode '' --prefill 1x2048 \
     --temperature 0 --max-num-seqs 8 --max-num-batched-tokens 2048 --repeats 5 --attention-impl $impl \
     --out /tmp/res/sp_llama_prefill_$impl.json > /tmp/res/sp_llama_prefill_$impl.log 2>&1
   echo "prefill $impl rc=$? t=$(el)s"; grep -h '"kind"' /tmp/res/sp_llama_prefill_$impl.log | cut -c1-260
 done) &
wait
grep -v "^$" /tmp/res/kernels.log | grep -v "^  File\|^    " | tail -60
tar czf $OUT/results.tgz -C /tmp res
echo "total t=$(el)s"

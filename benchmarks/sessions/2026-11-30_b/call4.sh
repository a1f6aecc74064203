#!/bin/bash
# Session 2026-11-30 (b), call 4. Device kind nvidia-h200-x2, ~4 minutes. Final code of the Mosaic GPU kernel
# (one int32 metadata buffer: Mosaic GPU wants 256-byte-aligned inputs; token axis padded to a multiple of 8).
#   GPU0: correctness of every check_mosaic case, then peers and the prefill variants (Triton default vs Mosaic).
#   GPU1: the kernel inside the model: Llama-3.1-8B prefill 1x2048 step, auto (Mosaic) vs the Triton kernel;
#         then generate (prefill of B x 128-token prompts takes the Mosaic kernel: 128 tokens per sequence).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
mkdir -p /tmp/res
(export CUDA_VISIBLE_DEVICES=0
 timeout 250 python3 benchmarks/kernels.py --out /tmp/res --repeats 5 --budget-s 220 \
   --section-budgets check_mosaic=90,prefill_variants=100 \
   --sections check_mosaic,ceiling,prefill_peers,prefill_variants --max-variants 2 --mosaic-variants 1 \
   > /tmp/res/kern_stdout.log 2>&1; echo "kernels rc=$? t=$(el)s") &
(export CUDA_VISIBLE_DEVICES=1
 for impl in auto pallas; do
   timeout 100 python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode '' --prefill 1x2048,1x4096 \
     --temperature 0 --max-num-seqs 8 --max-num-batched-tokens 4096 --max-model-len 8192 --repeats 5 \
     --attention-impl $impl --out /tmp/res/sp_llama_prefill_$impl.json > /tmp/res/sp_llama_prefill_$impl.log 2>&1
   echo "prefill $impl rc=$? t=$(el)s"; grep -h '"kind"' /tmp/res/sp_llama_prefill_$impl.log | cut -c1-230
   grep -h "Error" /tmp/res/sp_llama_prefill_$impl.log | tail -2
 done
 timeout 120 python3 -m benchmarks.generate --shapes llama-3.1-8b --repeats 3 --out /tmp/res/gen_llama.json \
   > /tmp/res/gen_llama.log 2>&1; echo "generate rc=$? t=$(el)s"; grep '^|' /tmp/res/gen_llama.log | tail -4) &
wait
grep -v "^$" /tmp/res/kernels.log | tail -42
tar czf $OUT/results.tgz -C /tmp res
echo "total t=$(el)s"

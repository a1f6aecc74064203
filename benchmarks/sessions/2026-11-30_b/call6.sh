#!/bin/bash
# Session 2026-11-30 (b), call 6. ~3 minutes. Call 5 located the wrong rows: sequences whose first token is not on
# a multiple of 8 rows (rows 4-7 of every 8 wrong when the start is 4 mod 8): the TMA q box started mid-tile. Tiles
# now start on multiples of 8. GPU0: every check_mosaic case, then the prefill variants (final figures).
# GPU1: the kernel peers again on the final code.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /tmp/res /tmp/res1
(CUDA_VISIBLE_DEVICES=0 timeout 230 python3 benchmarks/kernels.py --out /tmp/res --repeats 5 --budget-s 210 \
   --section-budgets check_mosaic=120 --sections check_mosaic,ceiling,prefill_variants --max-variants 2 \
   --mosaic-variants 2 > /tmp/res/kern_stdout.log 2>&1; echo "rc0=$?") &
(CUDA_VISIBLE_DEVICES=1 timeout 150 python3 benchmarks/kernels.py --out /tmp/res1 --repeats 5 \
   --sections ceiling,prefill_peers > /tmp/res1/kern_stdout.log 2>&1; echo "rc1=$?") &
wait
grep -h "OK \|BAD\|ERR\|seq " /tmp/res/kernels.log
grep -v "^$" /tmp/res/kernels.log | grep -A30 "prefill variants (same-run" | head -12
grep -h "ours\|cudnn\|jax_mha\|mgpu_float16_bq64_bkv128_st2\|matmul:" /tmp/res1/kernels.log
cp -r /tmp/res1 /tmp/res/peers; tar czf $OUT/results.tgz -C /tmp res

#!/bin/bash
# Session 2026-11-30 (b), call 5. ~2 minutes. Call 4 found 3 of 8 Mosaic-kernel checks wrong on the GPU (right in
# the CPU interpreter): all have a fresh prefill with a short last tile. This run locates the wrong rows (per
# sequence) and tries the empty-warpgroup variants, on both GPUs in parallel (half of the cases each).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /tmp/res
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/kernels.py --out /tmp/res --repeats 3 --budget-s 180 \
   --sections check_mosaic > /tmp/res/kern_stdout.log 2>&1; echo "rc=$?"
grep -v "^$" /tmp/res/kernels.log | tail -60
tar czf $OUT/results.tgz -C /tmp res

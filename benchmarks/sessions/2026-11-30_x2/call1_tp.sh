#!/bin/bash
# Ran 2026-11-30 00:50 UTC on device kind nvidia-h200-x2 (issue 9). About 8 minutes.
# Greedy equality tp2 vs tp1 in fp32 (full-precision matmuls: no TF32) on both shapes, then Llama-3.1-8B bf16 throughput / latency per layout.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
log() { echo "$* t=$(el)s" | tee -a $OUT/times.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > $OUT/gpus.txt 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> $OUT/gpus.txt 2>&1
run() { name=$1; shift; timeout $(( 560 - $(el) )) python3 -m benchmarks.sharding "$@" --out $OUT/$name.json > /tmp/$name.log 2>&1; log "$name rc=$?"; cat /tmp/$name.log >> $OUT/all.log; grep '^|' /tmp/$name.log | tail -4; }
JAX_DEFAULT_MATMUL_PRECISION=highest run eq_qwen   --shape qwen3-0.6b   --dtype float32  --layouts tp1,tp2 --batch 8 --prompt-len 128 --decode-steps 32
JAX_DEFAULT_MATMUL_PRECISION=highest run eq_llama  --shape llama-3.1-8b --dtype float32  --layouts tp1,tp2 --batch 8 --prompt-len 128 --decode-steps 32
run tput      --shape llama-3.1-8b --dtype bfloat16 --layouts tp1,tp2,dp2xtp1 --batch 64 --prompt-len 512 --decode-steps 64
run batch1    --shape llama-3.1-8b --dtype bfloat16 --layouts tp1,tp2 --batch 1 --prompt-len 512 --decode-steps 64

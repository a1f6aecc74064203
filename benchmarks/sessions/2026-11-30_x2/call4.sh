#!/bin/bash
# Ran 2026-11-30 ~01:06 UTC on nvidia-h200-x2 right after call3.sh (same machine, compile cache warm), code c9bd633.
# GPU0: HF transformers continuous batching on the nano-vllm bench (issue 8's PyTorch peer, same run).
# GPU1: the engine on the same bench three times at max_num_seqs 256, then once at 512.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m benchmarks.compare_torch --shape qwen3-0.6b --workload nano-vllm \
   --engines hf-cb --out $OUT/torch.json > $OUT/torch.log 2>&1; echo "torch rc=$?" >> $OUT/t.txt) &
(export CUDA_VISIBLE_DEVICES=1
 Q="--shape qwen3-0.6b --max-num-batched-tokens 2048 --max-model-len 4096 --async-scheduling --workload nano-vllm"
 for i in 1 2 3; do timeout 150 python3 -m benchmarks.throughput $Q --out $OUT/nano$i.json > /tmp/n$i.log 2>&1
   echo "nano$i rc=$?" >> $OUT/t.txt; done
 XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 timeout 100 python3 -m benchmarks.throughput $Q --max-num-seqs 512 \
   --out $OUT/nano512.json > /tmp/n4.log 2>&1; echo "nano512 rc=$?" >> $OUT/t.txt) &
wait

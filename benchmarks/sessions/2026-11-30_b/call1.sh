#!/bin/bash
# Session 2026-11-30 (b), call 1. Device kind nvidia-h200-x2, about 7 minutes, two single-GPU tracks.
#   GPU0: the engine at batch 1 on generate's prompt shape (issue 6's missing point), then generate's table again
#         after the searchsorted fix (benchmarks/generate.py uses the same kernel wrapper).
#   GPU1: the same for Llama-3.1-8B.
# Then (GPU0 / GPU1 in parallel) the fused-projection A/B: step profile with and without --no-fuse-projections
# (prediction: Llama-3.1-8B batch-1 forward 5.19 ms -> ~4.4-4.6 ms if XLA's dot merger was concatenating the k/v
# (and q) weights at run time on every step; all_concatenates in forward_hlo shows it), and the nano-vllm bench.
# Then (both GPUs) the Llama-3.1-8B sharding layouts again after the fix (issue 9's figures predate it).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
track() {
  export CUDA_VISIBLE_DEVICES=$1; shape=$2
  timeout 150 python3 -m benchmarks.throughput --shape $shape --workload random --num-prompts 1 --input-len 128 \
    --output-len 128 --temperature 0 --async-scheduling --out $OUT/${shape}_engine_b1.json > /tmp/${shape}_b1.log 2>&1
  echo "$shape engine B=1 rc=$? t=$(el)s"; grep -h output_tok_s $OUT/${shape}_engine_b1.json
  timeout 120 python3 -m benchmarks.generate --shapes $shape --repeats 3 --out $OUT/${shape}_generate.json \
    > /tmp/${shape}_gen.log 2>&1
  echo "$shape generate rc=$? t=$(el)s"; grep '^|' /tmp/${shape}_gen.log | tail -4
}
track 0 qwen3-0.6b & track 1 llama-3.1-8b & wait
ab() {
  export CUDA_VISIBLE_DEVICES=$1; shift
  for f in "" --no-fuse-projections; do
    timeout 100 python3 -m benchmarks.step_profile "$@" --repeats 5 $f --out /tmp/sp_${CUDA_VISIBLE_DEVICES}$f.json > /tmp/sp_$CUDA_VISIBLE_DEVICES.log 2>&1
    echo "step_profile $* $f rc=$?"; grep -E '"kind"|all_concatenates' /tmp/sp_$CUDA_VISIBLE_DEVICES.log | cut -c1-330
  done
}
ab 0 --shape llama-3.1-8b --decode 1x1024,32x1024 --prefill '' --temperature 0 --max-num-seqs 32 --max-num-batched-tokens 64 &
(ab 1 --shape qwen3-0.6b --decode 256x1024,1x1024 --prefill 1x2048
 CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m benchmarks.throughput --shape qwen3-0.6b --workload nano-vllm \
   --max-num-batched-tokens 2048 --max-model-len 4096 --async-scheduling --out $OUT/nano.json > /tmp/nano.log 2>&1
 echo "nano rc=$?"; grep -h output_tok_s $OUT/nano.json) & wait
# Kernels (GPU0): what other attention kernels reach on the 4k prefill (dense Triton, cuDNN, Mosaic GPU FA3), and
# the prefill variants after the searchsorted fix. GPU1: nano-vllm again. The device's Mosaic GPU sources come back
# for reading (jax 0.11.2 is not on PyPI; the CPU machines have 0.10.2).
(export CUDA_VISIBLE_DEVICES=0; timeout 200 python3 benchmarks/kernels.py --out $OUT --repeats 5 --budget-s 170 \
   --sections ceiling,prefill_peers,prefill_variants --max-variants 4 > /tmp/kern.log 2>&1; echo "kernels rc=$? t=$(el)s") &
(CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m benchmarks.throughput --shape qwen3-0.6b --workload nano-vllm \
   --max-num-batched-tokens 2048 --max-model-len 4096 --async-scheduling --out $OUT/nano2.json > /tmp/nano2.log 2>&1
 echo "nano2 rc=$?"; grep -h output_tok_s $OUT/nano2.json) & wait
grep -v "^$" $OUT/kernels.log | tail -40
J=$(python3 -c "import jax,os;print(os.path.dirname(jax.__file__))")
tar czf $OUT/mgpu_src.tgz -C $J _src/pallas/mosaic_gpu experimental/pallas/ops/gpu/attention_mgpu.py experimental/pallas/mosaic_gpu.py experimental/mosaic/gpu 2>/dev/null
echo "total t=$(el)s"
# Everything in two files (the device tool returns few files safely).
mkdir -p /tmp/res && cp /tmp/*.log /tmp/sp_*.json /tmp/res/ 2>/dev/null; cp $OUT/*.json $OUT/*.log /tmp/res/
rm -f $OUT/*.json $OUT/*.log; tar czf $OUT/results.tgz -C /tmp res

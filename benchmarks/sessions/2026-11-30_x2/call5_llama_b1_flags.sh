#!/bin/bash
# Ran 2026-11-30 ~01:12 UTC, code 2d88287 (results: call5_all.log and benchmarks/RESULTS.md).
# Llama-3.1-8B decode at batch 1 (issue 8's 1.2x target) under XLA flag variants; one bucket (16 tokens, 1 seq)
# so each variant compiles in seconds. Device kind nvidia-h200, code after c9bd633.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
for v in "default|" "no_triton_gemm|--xla_gpu_enable_triton_gemm=false" "graph_min_1|--xla_gpu_graph_min_graph_size=1" \
         "no_command_buffer|--xla_gpu_enable_command_buffer=" "default_again|"; do
  name=${v%%|*}; flags=${v#*|}
  [ $(el) -gt 190 ] && { echo "skip $name (time)"; continue; }
  XLA_FLAGS="$flags" timeout $(( 255 - $(el) )) python3 -m benchmarks.step_profile --shape llama-3.1-8b --decode 1x1024 --prefill "" \
    --max-num-seqs 1 --max-num-batched-tokens 16 --max-model-len 2048 --temperature 0 --repeats 7 > /tmp/$name.log 2>&1
  echo "== $name [$flags] rc=$? t=$(el)s"; grep '"kind"' /tmp/$name.log | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); print({k:d[k] for k in ('bucket','step_ms','pipelined_ms','execute_ms','forward_ms','floor_ms') if k in d})"
  grep -E 'warm_up_s' /tmp/$name.log | cut -c1-200
  cat /tmp/$name.log >> $OUT/all.log
done

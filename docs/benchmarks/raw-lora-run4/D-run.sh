#!/usr/bin/env bash
# device call 1: step variants (before/after, per-projection launch variants, prefill), then GPU tests
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 | tee "$OUT/A-env.log"
timeout 140 python3 -m loraplex.bench.lora_kernels --step-variants --reps 30 --before-dir .lora_before \
    --out "$OUT/lora_step_sweep_variants_h200.json" > "$OUT/A-step-variants.log" 2>&1
echo "variants rc=$? at $(( $(date +%s) - start )) s" | tee -a "$OUT/A-env.log"
grep -E "^STEP|CHOSEN|PREFILL|Error|error|failed" "$OUT/A-step-variants.log" | cut -c1-400 | tail -40
timeout 95 python3 -m pytest tests/gpu/test_lora_kernels_gpu.py -q -p no:cacheprovider -o addopts="" \
    > "$OUT/A-gpu-tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - start )) s" | tee -a "$OUT/A-env.log"
tail -25 "$OUT/A-gpu-tests.log"
left=$(( 230 - ($(date +%s) - start) ))
if [ "$left" -gt 25 ]; then
  timeout "$left" python3 -m pytest tests/gpu/test_cuda_graphs.py -q -x -p no:cacheprovider -o addopts="" -k adapters \
      > "$OUT/A-gpu-graph-tests.log" 2>&1
  echo "graph tests rc=$? at $(( $(date +%s) - start )) s" | tee -a "$OUT/A-env.log"
  tail -5 "$OUT/A-gpu-graph-tests.log"
fi

#!/usr/bin/env bash
# device call 2: GPU tests of the final kernels (focused), then the default LoRA bench (decode steps before/after,
# prefill before/after, per-kernel table), then more tests with the time left
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader; git log --oneline -1 2>/dev/null; } > "$OUT/B-env.log" 2>&1
timeout 62 python3 -m pytest tests/gpu/test_lora_kernels_gpu.py -q -p no:cacheprovider -o addopts="" \
  -k "single_launch or programmatic or decode_grid or chained or llama3_decode_shapes or cuda_graph_replay or column_hint or manager or (against_twin and dtype0 and 133)" \
  > "$OUT/B-gpu-tests.log" 2>&1
echo "tests rc=$? at $(el) s" | tee -a "$OUT/B-env.log"; tail -4 "$OUT/B-gpu-tests.log"
timeout 85 python3 -m loraplex.bench.lora_kernels --reps 50 --before-dir .lora_before \
  --out "$OUT/lora_kernels_h200.json" > "$OUT/B-bench.log" 2>&1
echo "bench rc=$? at $(el) s" | tee -a "$OUT/B-env.log"
grep -E "^STEP|^PREFILL|Error|failed" "$OUT/B-bench.log" | cut -c1-330
left=$(( 168 - $(el) ))
if [ "$left" -gt 15 ]; then
  timeout "$left" python3 -m pytest tests/gpu/test_lora_kernels_gpu.py -q -p no:cacheprovider -o addopts="" \
    -k "(against_twin and dtype1 and 133) or (against_twin and dtype0 and 2048)" > "$OUT/B-gpu-tests2.log" 2>&1
  echo "tests2 rc=$? at $(el) s" | tee -a "$OUT/B-env.log"; tail -3 "$OUT/B-gpu-tests2.log"
fi

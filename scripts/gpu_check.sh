#!/usr/bin/env bash
# On a CUDA machine whose image already has torch/triton/transformers/peft (our H200 runs):
# install the carried platform wheels (.whl/, see docs/benchmarks/README.md), then run the GPU tests
# and the kernel microbenchmarks. Results land in ${OUT:-./gpu-out}.
set -uo pipefail
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
what="${1:-tests,lora,attention}"
if [[ "$what" == *tests* ]]; then
    python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" --timeout 300 \
        --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" | tail -40
fi
if [[ "$what" == *engine* ]]; then
    # a short Llama-3-8B-shaped engine run (writes the random model once under /tmp/loraplex-bench)
    python3 -m loraplex.cli bench offline --out-dir "$out" --num-requests 128 --input-len 256 --output-len 32 \
        --popularity base,distinct --step-batch 64 --step-count 16 2>&1 | tail -30
fi
if [[ "$what" == *lora* ]]; then
    python3 -m loraplex.bench.lora_kernels --out "$out/lora_kernels_h200.json" 2>&1 | tail -12
fi
if [[ "$what" == *attention* ]]; then
    python3 -m loraplex.cli bench attention --sweep --out-dir "$out" 2>&1 | tail -14
fi

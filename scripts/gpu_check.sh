#!/usr/bin/env bash
# On a CUDA machine whose image already has torch/triton/transformers/peft (our H200 runs): install the carried
# platform wheels (.whl/, see docs/benchmarks/README.md) unless the platform already imports, then run what
# the first argument names (comma-separated; default tests,lora,attention). Results land in ${OUT:-./gpu-out}.
#
#   tests      GPU tests                        lora       LoRA kernel microbenchmark
#   attention  paged attention vs SDPA (sweep)     engine     a short engine run (bench offline)
#   lorastep   the decode-step LoRA policies and the in-layer run at 64 tokens (lora_kernels --steps-only)
#   quant      INT8 / FP8 weight-only: GPU tests, quant_bench (vs cuBLAS bf16, tile sweep), bench offline with each
#              (QUANT_OFFLINE_VARIANTS: which of "none int8 fp8" run offline; empty: none)
#   speccost   speculative decoding: decode-step time with k draft tokens per sequence (bench spec_cost)
#              and the decode kernel over an fp8 KV cache (--fp8-kv)
#   report     the issue-9 report: bench all with the HF + PEFT peer and an online run through a launched
#              `loraplex serve` (embedded default: SQLite + in-process), cut short by SIGTERM at
#              ${REPORT_TIMEOUT_S:-560} s so a partial report is still written (rc 3)
#   profile    bench step-profile: one decode step, base and 64 distinct rank-16 adapters, with traces
#   overlap    A/B of lora_overlap_shrink: bench offline (1,000 requests; base, zipf, distinct; ${OVERLAP_REPEATS:-2}
#              rounds) with the shrinks after the GEMMs and on a forked stream alongside them
#   fastlaunch the opt-in fast launch path (loraplex/kernels/launch.py): the GPU tests with LORAPLEX_FAST_LAUNCH=1,
#              then the mixed-step profile (248 decodes + a 384-token prompt per step) with it off and on
#   piecewise  the mixed-step profile (248 decodes + a 384-token prompt per step, base and 64 adapters) with the
#              piecewise CUDA graphs off, then on, then on with the fast launch path (LORAPLEX_FAST_LAUNCH=1);
#              PIECEWISE_VARIANTS picks some of "off on on-fast"
#   pairs      online A/B below the knee: ONLINE_PAIR_RATE (20) req/s, the server settings of each variant in
#              ONLINE_VARIANTS (';'-separated, each a space-separated list of LORAPLEX_X=V; default: the attention
#              split off, then the default), ONLINE_ROUNDS (2) interleaved rounds, one server each
#   variants   offline A/B of engine settings: bench offline (1,000 requests, 256 in / 128 out, popularities
#              ${OFFLINE_POPULARITY:-base,zipf,distinct}, ${OFFLINE_REPEATS:-2} rounds) once per entry of OFFLINE_VARIANTS
#              (';'-separated lists of bench flags; default: the piecewise CUDA graphs off, then on)
#   inlayer    the LoRA work between the base GEMMs of the model's projections (32 layers, one CUDA graph each): a
#              decode step (64 tokens) and steps of ${INLAYER_TOKENS:-2048,8192} tokens, orders sequential / overlap /
#              expand-first (engine option lora_expand_first_min_tokens): which order costs least, per step size
#   gemmshrink the in-GEMM shrink over the first W slots (run 29): its GPU test, then bench offline (1,000 requests,
#              ${GEMM_SHRINK_POPULARITY:-base,uniform,zipf}) without and with --lora-gemm-shrink --lora-gemm-shrink-max-tokens 256,
#              interleaved over ${GEMM_SHRINK_ROUNDS:-2} rounds
#   siluprompt gate|up + SiLU in a 7,314-token prompt step: the default order against the delta inside SiLU
#              (bench lora_plan --silu-prompt; engine option lora_silu_mul_min_tokens)
#   fold       the down shrink inside SiLU-and-multiply (engine option lora_fold_shrink_max_tokens): its GPU tests and the
#              no-compile tests, then bench offline (1,000 requests, ${FOLD_POPULARITY:-base,zipf,uniform,distinct},
#              --merge-single-lora) without and with --lora-fold-shrink-max-tokens ${FOLD_MAX_TOKENS:-256}, ${FOLD_ROUNDS:-1} round(s)
#   ab         A/B of the experimental fuse_lora_silu_mul: its GPU test, then bench offline (1,000 requests, every
#              popularity) without and with --fuse-lora-silu-mul, and step-profile at 64 adapters with it
#
# Knobs (environment): ONLINE_RATE (30 req/s), ONLINE_REQUESTS (300), PEER_OUTPUT_LEN (64), BENCH_ARGS (more
# flags for `bench all`), PROFILE_ARGS (more flags for `bench step-profile`), SMOKE=1 (tiny shapes on the CPU:
# checks the harness, e.g. `SMOKE=1 PATH=.venv/bin:$PATH bash scripts/gpu_check.sh report,profile`).
set -uo pipefail
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if python3 -c 'import litestar, sqlalchemy, aiosqlite, alembic, uvicorn, sniffio' >/dev/null 2>&1; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
what="${1:-tests,lora,attention}"
smoke=()
[[ -n "${SMOKE:-}" ]] && smoke=(--smoke)
status=0

# the in-GEMM shrink's engine counters of each offline run in a bench output folder
shrink_counters() {
    python3 -c 'import glob, json, sys
for f in glob.glob(sys.argv[1] + "/offline-*.json"):
    for r in json.load(open(f))["throughput"]:
        d = r["diagnostics"]["engine"]
        print(r["popularity"], "steps with the in-GEMM shrink:", d.get("lora_gemm_shrink_steps"), "slot moves:",
              d.get("lora_slot_moves"), "of", d.get("num_decode_graph_steps"), "decode graph steps")' "$1"
}

if [[ "$what" == *tests* ]]; then
    # ${GPU_TEST_WORKERS:-4} pytest-xdist workers on the one GPU: 78 s instead of ~8 minutes (the image has xdist)
    python3 -m pytest tests/gpu -q -n "${GPU_TEST_WORKERS:-4}" -p no:cacheprovider -o addopts="" --timeout 300 \
        --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" | tail -40
fi
if [[ "$what" == *engine* ]]; then
    # a short Llama-3-8B-shaped engine run (writes the random model once under /tmp/loraplex-bench)
    python3 -m loraplex.cli bench offline --out-dir "$out" --num-requests 128 --input-len 256 --output-len 32 \
        --popularity base,distinct --step-batch 64 --step-count 16 ${smoke[@]+"${smoke[@]}"} 2>&1 | tail -30
fi
if [[ "$what" == *lora* && "$what" != *lorastep* ]]; then
    python3 -m loraplex.bench.lora_kernels --out "$out/lora_kernels_h200.json" 2>&1 | tail -12
fi
if [[ "$what" == *lorastep* ]]; then
    # the whole-step LoRA policies (CUDA graphs, 64 tokens; per-kernel profile) and the in-layer run at 64 tokens
    python3 -m loraplex.bench.lora_kernels --steps-only --reps "${LORASTEP_REPS:-50}" \
        --out "$out/lora_steps_h200.json" > "$out/lorastep.log" 2>&1
    echo "lorastep: exit $?"; grep -E "^\| " "$out/lora_steps_h200.md" | head -60
fi
if [[ "$what" == *quant* ]]; then
    # INT8 weight-only linear: its GPU tests, the kernel against cuBLAS bf16 at the 8B projections (with a tile
    # sweep), then bench offline with and without --quantization int8 (base and distinct, two rounds)
    python3 -m pytest tests/gpu/test_w8a16_gpu.py -q -p no:cacheprovider -o addopts="" 2>&1 | tail -5
    for method in int8 fp8; do
        python3 -m loraplex.bench.quant_bench --sweep --method "$method" --out "$out/quant_bench_$method.json" \
            > "$out/quant_bench_$method.log" 2>&1
        echo "quant_bench $method: exit $?"; grep -E "^\| " "$out/quant_bench_$method.md" | head -30
    done
    for variant in ${QUANT_OFFLINE_VARIANTS-none int8 fp8}; do
        flag=(); [[ "$variant" != none ]] && flag=(--quantization "$variant")
        python3 -m loraplex.cli bench offline --out-dir "$out/quant-$variant" --num-requests 1000 --input-len 256 \
            --output-len 128 --step-batch 64 --popularity base,distinct --repeats "${QUANT_REPEATS:-2}" "${flag[@]}" \
            ${smoke[@]+"${smoke[@]}"} > "$out/quant-$variant.log" 2>&1
        echo "offline quantization=$variant: exit $?"
        grep -E "offline [a-z]+: |decode step" "$out/quant-$variant.log" | cut -c1-300
    done
fi
if [[ "$what" == *speccost* ]]; then
    # speculative decoding: the decode step with k = 0, 1, 2, 4 draft tokens per sequence (batch 64, ctx ~1k)
    python3 -m loraplex.bench.spec_cost --out "$out/spec_cost.json" ${smoke[@]+"${smoke[@]}"} > "$out/spec_cost.log" 2>&1
    echo "spec_cost: exit $?"; grep -E "^\| " "$out/spec_cost.md"
fi
if [[ "$what" == *attention* ]]; then
    python3 -m loraplex.cli bench attention --sweep --fp8-kv --out-dir "$out" ${smoke[@]+"${smoke[@]}"} 2>&1 | tail -14
fi
if [[ "$what" == *report* ]]; then
    # the launched server needs the platform: fail now rather than after minutes of offline runs
    if ! python3 -c 'import loraplex.platform.app, loraplex.platform.cli_serve, uvicorn, aiosqlite, alembic'; then
        echo "report: the platform's packages do not import (carry .whl: docs/benchmarks/README.md)"; exit 1
    fi
    # SIGTERM makes bench all write the parts that finished; KILL 30 s later if it does not stop
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    timeout -k 30 "${REPORT_TIMEOUT_S:-560}" python3 -m loraplex.cli bench all --out-dir "$out" --peer hf-peft \
        --num-requests 1000 --input-len 256 --output-len 128 --peer-output-len "${PEER_OUTPUT_LEN:-64}" \
        --online-rate "${ONLINE_RATE:-30}" --online-requests "${ONLINE_REQUESTS:-300}" \
        --slo-ttft-ms 1000 --slo-tpot-ms 100 ${BENCH_ARGS:-} ${smoke[@]+"${smoke[@]}"} > "$out/report.log" 2>&1
    rc=$?
    grep -E "bench all: .* (took|in all)|online: |offline [a-z]+: |cut short" "$out/report.log"
    echo "report: bench all exited with $rc (3: cut short, partial report written)"; status=$((status | rc))
fi
if [[ "$what" == *ab* ]]; then
    python3 -m pytest tests/gpu/test_fused_silu_mul_gpu.py -q -p no:cacheprovider -o addopts="" 2>&1 | tail -3
    for variant in plain fused; do
        flag=(); [[ "$variant" == fused ]] && flag=(--fuse-lora-silu-mul)
        python3 -m loraplex.cli bench offline --out-dir "$out" --num-requests 1000 --input-len 256 --output-len 128 \
            --step-batch 64 ${flag[@]+"${flag[@]}"} ${smoke[@]+"${smoke[@]}"} > "$out/ab-$variant.log" 2>&1
        echo "ab $variant: exit $?"; grep -E "offline [a-z]+: .*HBM floor|decode steps in" "$out/ab-$variant.log"
    done
    python3 -m loraplex.cli bench step-profile --out-dir "$out" --adapters 64 --fuse-lora-silu-mul \
        ${smoke[@]+"${smoke[@]}"} > "$out/ab-profile.log" 2>&1
    grep -E "step-profile" "$out/ab-profile.log" | grep -v "^loraplex bench"
fi
if [[ "$what" == *gemmshrink* ]]; then
    python3 -m pytest tests/gpu/test_lora_gemm_shrink_gpu.py -q -p no:cacheprovider -o addopts="" 2>&1 | tail -2
    for round in $(seq "${GEMM_SHRINK_ROUNDS:-2}"); do
        for variant in plain gemm; do
            flag=(); [[ "$variant" == gemm ]] && flag=(--lora-gemm-shrink --lora-gemm-shrink-max-tokens 256)
            python3 -m loraplex.cli bench offline --out-dir "$out/gemmshrink-$variant-$round" --num-requests 1000 \
                --input-len 256 --output-len 128 --step-batch 0 --popularity "${GEMM_SHRINK_POPULARITY:-base,uniform,zipf}" \
                ${flag[@]+"${flag[@]}"} ${smoke[@]+"${smoke[@]}"} > "$out/gemmshrink-$variant-$round.log" 2>&1
            echo "gemmshrink $variant round $round: exit $?"
            grep -E "offline [a-z]+: .*HBM floor|decode steps in|gemm_shrink:" "$out/gemmshrink-$variant-$round.log" \
                | cut -c1-240
            shrink_counters "$out/gemmshrink-$variant-$round"
        done
    done
fi
if [[ "$what" == *siluprompt* ]]; then
    prompt=(--silu-prompt 7314); [[ -n "${SMOKE:-}" ]] && prompt=(--silu-prompt 40 --prompt-len 16)
    python3 -m loraplex.bench.lora_plan --tokens 64 --plans "" --no-profile --reps 30 "${prompt[@]}" \
        --out "$out/lora_plan_silu_prompt.json" ${smoke[@]+"${smoke[@]}"} > "$out/siluprompt.log" 2>&1
    echo "siluprompt: exit $?"; grep -A 14 "in a prompt step" "$out/lora_plan_silu_prompt.md"
fi
if [[ "$what" == *fastlaunch* ]]; then
    LORAPLEX_FAST_LAUNCH=1 python3 -m pytest tests/gpu -q -n "${GPU_TEST_WORKERS:-4}" -p no:cacheprovider -o addopts="" \
        --timeout 300 > "$out/gpu-tests-fast-launch.log" 2>&1
    rc=$?; tail -3 "$out/gpu-tests-fast-launch.log"; echo "fastlaunch: GPU tests exited with $rc"; status=$((status | rc))
    for fast in 0 1; do
        LORAPLEX_FAST_LAUNCH=$fast python3 -m loraplex.cli bench step-profile --out-dir "$out/fast-launch-$fast" \
            --batch 248 --context 256 --step-prompt-tokens 384 --adapters 0,64 --steps 24 \
            ${smoke[@]+"${smoke[@]}"} > "$out/fast-launch-$fast.log" 2>&1
        echo "fastlaunch=$fast: step-profile exited with $?"; grep -E "step-profile (base|[0-9]+ distinct)" "$out/fast-launch-$fast.log"
    done
fi
if [[ "$what" == *piecewise* ]]; then
    for variant in ${PIECEWISE_VARIANTS:-off on on-fast}; do
        flag=(--piecewise-cuda-graphs); [[ "$variant" == off ]] && flag=(--no-piecewise-cuda-graphs)
        fast=0; [[ "$variant" == on-fast ]] && fast=1
        LORAPLEX_FAST_LAUNCH=$fast timeout -k 10 "${PROFILE_TIMEOUT_S:-170}" python3 -m loraplex.cli bench step-profile --out-dir "$out/piecewise-$variant" \
            --batch 248 --context 256 --step-prompt-tokens 384 --adapters 0,64 --steps 24 "${flag[@]}" \
            ${smoke[@]+"${smoke[@]}"} > "$out/piecewise-$variant.log" 2>&1
        echo "piecewise $variant: step-profile exited with $?"
        grep -E "captured|step-profile (base|[0-9]+ distinct)" "$out/piecewise-$variant.log" | cut -c1-300
    done
fi
if [[ "$what" == *pairs* ]]; then
    IFS=';' read -r -a variants <<< "${ONLINE_VARIANTS:-LORAPLEX_ATTENTION_DECODE_SPLIT=false;LORAPLEX_ATTENTION_DECODE_SPLIT=true}"
    for round in $(seq 1 "${ONLINE_ROUNDS:-2}"); do
        for i in "${!variants[@]}"; do
            env_flags=()
            for setting in ${variants[$i]}; do env_flags+=(--serve-env "$setting"); done
            timeout -s TERM -k 15 "${ONLINE_TIMEOUT_S:-150}" python3 -m loraplex.cli bench online --launch \
                --popularity uniform --rate "${ONLINE_PAIR_RATE:-20}" --num-requests "${ONLINE_REQUESTS:-300}" \
                --input-len 256 --output-len 128 --slo-ttft-ms 1000 --slo-tpot-ms 100 ${env_flags[@]+"${env_flags[@]}"} \
                --out-dir "$out/pairs-$round-$i" ${smoke[@]+"${smoke[@]}"} > "$out/pairs-$round-$i.log" 2>&1
            echo "pairs round $round variant '${variants[$i]}': exit $?"
            grep -E "completed in|sequences per step" "$out/pairs-$round-$i.log" | sed 's/.*bench.online: //' | cut -c1-400
        done
    done
fi
if [[ "$what" == *inlayer* ]]; then
    python3 -m loraplex.bench.lora_kernels --in-layer-only --in-layer-tokens "${INLAYER_TOKENS:-2048,8192}" \
        --reps "${INLAYER_REPS:-50}" --out "$out/lora_in_layer.json" ${smoke[@]+"${smoke[@]}"} > "$out/inlayer.log" 2>&1
    echo "inlayer: exit $?"; grep -E "^\| (base only|sequential|overlap|expand-first) " "$out/lora_in_layer.md"
fi
if [[ "$what" == *variants* ]]; then
    IFS=';' read -r -a offline_variants <<< "${OFFLINE_VARIANTS:---no-piecewise-cuda-graphs;--piecewise-cuda-graphs}"
    for i in "${!offline_variants[@]}"; do
        # shellcheck disable=SC2086  # each variant is a list of flags
        python3 -m loraplex.cli bench offline --out-dir "$out/variant-$i" --num-requests 1000 --input-len 256 \
            --output-len 128 --step-batch 0 --popularity "${OFFLINE_POPULARITY:-base,zipf,distinct}" \
            --repeats "${OFFLINE_REPEATS:-2}" ${offline_variants[$i]} ${smoke[@]+"${smoke[@]}"} > "$out/variant-$i.log" 2>&1
        echo "variant $i '${offline_variants[$i]}': exit $?"
        grep -E "offline [a-z]+: |decode steps in|rounds|warmed up the eager" "$out/variant-$i.log" | cut -c1-300
        shrink_counters "$out/variant-$i"
    done
fi
if [[ "$what" == *fold* ]]; then
    python3 -m pytest tests/gpu/test_lora_fold_gpu.py tests/gpu/test_bench_counters_gpu.py -q -p no:cacheprovider \
        -o addopts="" 2>&1 | tail -4
    for round in $(seq "${FOLD_ROUNDS:-1}"); do
        for variant in plain fold; do
            flag=(); [[ "$variant" == fold ]] && flag=(--lora-fold-shrink-max-tokens "${FOLD_MAX_TOKENS:-256}")
            python3 -m loraplex.cli bench offline --out-dir "$out/fold-$variant-$round" --num-requests 1000 \
                --input-len 256 --output-len 128 --step-batch 0 --popularity "${FOLD_POPULARITY:-base,zipf,uniform,distinct}" \
                --merge-single-lora ${flag[@]+"${flag[@]}"} ${smoke[@]+"${smoke[@]}"} > "$out/fold-$variant-$round.log" 2>&1
            echo "fold $variant round $round: exit $?"
            grep -E "offline [a-z]+: |decode steps in|warmed up the eager" "$out/fold-$variant-$round.log" | cut -c1-300
        done
    done
fi
if [[ "$what" == *overlap* ]]; then
    for variant in sequential overlap; do
        flag=(--no-lora-overlap-shrink); [[ "$variant" == overlap ]] && flag=(--lora-overlap-shrink)
        python3 -m loraplex.cli bench offline --out-dir "$out" --num-requests 1000 --input-len 256 --output-len 128 \
            --step-batch 0 --popularity base,zipf,distinct --repeats "${OVERLAP_REPEATS:-2}" "${flag[@]}" \
            ${smoke[@]+"${smoke[@]}"} > "$out/overlap-$variant.log" 2>&1
        echo "overlap $variant: exit $?"; grep -E "offline [a-z]+: |decode steps in|rounds" "$out/overlap-$variant.log"
    done
fi
if [[ "$what" == *profile* ]]; then
    # shellcheck disable=SC2086  # PROFILE_ARGS is a list of flags
    python3 -m loraplex.cli bench step-profile --out-dir "$out" --adapters 0,64 --trace-dir "$out" \
        ${PROFILE_ARGS:-} ${smoke[@]+"${smoke[@]}"} > "$out/profile.log" 2>&1
    rc=$?
    grep -E "step-profile" "$out/profile.log" | grep -v "^loraplex bench"
    sed -n '/^## Host time per phase/,/^## Top kernels/p' "$out/profile.log" | head -60
    echo "profile: bench step-profile exited with $rc"; status=$((status | rc))
fi
exit "$status"

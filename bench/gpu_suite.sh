#!/usr/bin/env bash
# The GPU tests and benchmarks of the project on one CUDA machine, section by section, each bounded in
# time; logs and JSON go to OUT (default bench/results/gpu_suite). Sections run in the order given:
#
#   bash bench/gpu_suite.sh tests packing profile deltanet hybrid one_gpu one_gpu_inprocess one_gpu_compile one_gpu_sac one_gpu_flash one_gpu_keepkv one_gpu_mps vllm_one_gpu vllm_lora packing_tune packing_flash engine decode
#
#   tests        pytest -m gpu of everything that needs neither a running vLLM nor fla-core
#   packing      bench/packing.py: default and shared-prompt workloads, 0.6B and 1.7B, step variants (with sac)
#   profile      bench/profile_step.py: where a step's time goes (0.6B, shared-prompt workload)
#   deltanet     the fla-core kernel tests and bench/delta_rule.py (one layer, Qwen3.5-2B shape); fla-core
#                compiles and autotunes on first use, so run it before hybrid on a fresh machine
#   hybrid       bench/packing.py on the Qwen3.5-2B shape, fla-core's kernel against the PyTorch delta rule
#   one_gpu      bench/one_gpu.py: trainer and embedded server on this GPU, async vs on-policy (0.6B)
#   one_gpu_inprocess  the same with the embedded server inside the trainer's process (ServerThread)
#   one_gpu_compile    in-process with the trainer's torch_compile=True (compiled layers, fused log-prob head)
#   one_gpu_sac        the same with activation_memory_budget=0.5 (selective recomputation)
#   one_gpu_flash      the same with activation_memory_budget=0.75 and flex_attention_backend="flash" (FlashAttention-4)
#   one_gpu_keepkv     the same (two processes) with syncs that keep the KV of rollouts in flight
#   one_gpu_mps  the same under an MPS daemon
#   vllm_one_gpu  bench/one_gpu.py against vLLM 0.33 started here on the same GPU with its ipc backend
#   vllm_lora     vLLM 0.33 serving LoRA adapters at run time (1.7B shape): tests/gpu/test_vllm_lora_sync.py,
#                then bench/lora_sync.py against it and the embedded server
#   packing_tune  bench/packing.py, 0.6B shared-prompt: the compiled layers with inductor's autotuning against
#                without (FlexAttention block sizes, matmul templates)
#   packing_flash  bench/packing.py, 0.6B and 1.7B, both workloads, tree rows: FlexAttention's FlashAttention-4
#                backend (needs the flash-attn-4 package and its CuTe DSL on PYTHONPATH) against its Triton kernels,
#                and with selective recomputation (budget 0.75)
#   engine       bench/engine_phases.py: the server's steps for the group and multi-turn shapes (0.6B),
#                synchronous and asynchronous scheduling, packed and padded prompt chunks side by side, and the
#                turn shape with 2,048 prompt tokens a step on graphs (`--max-prompt-rows 2048`)
#   decode       bench/decode_step.py: one decode step and one layer's attention, plain and with a window
#                and soft-cap, Triton kernel against the gather path (0.6B, B = 256)
#
# SECTION_TIMEOUT (seconds, default 540) bounds each section; a section that fails or times out does
# not stop the next one. PYTHONPATH gets src/ in front. ONE_GPU_SHAPE (default 0.6b) is the one_gpu*
# sections' model shape. The vllm_* sections start `python -m vllm.entrypoints.openai.api_server` on port
# VLLM_PORT (default 8001) with VLLM_PYTHONPATH (default: PYTHONPATH) and stop it at the end; its log
# goes to OUT too. With STACK_SAMPLES=1 its processes' main threads are sampled every 50 ms
# (bench/stack_sampler) and bench/stack_report.py writes where they were busy to OUT/<server log>_stacks.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_suite}
LIMIT=${SECTION_TIMEOUT:-540}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

section() {  # name, command...
    local name=$1; shift
    local start=$SECONDS
    echo "== $name: $*"
    timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s (log $OUT/$name.log)"
    tail -n 15 "$OUT/$name.log"
}

SHAPE=${ONE_GPU_SHAPE:-0.6b}
VLLM_PORT=${VLLM_PORT:-8001}
VLLM_PID=
STACKS=  # where the running vLLM's stack samples go (STACK_SAMPLES=1)

start_vllm() {  # log name, model dir, vLLM flags...: in the background, until /health answers
    local name=$1 log=$OUT/$1.log model=$2 path=${VLLM_PYTHONPATH:-$PYTHONPATH}; shift 2
    echo "== starting vLLM on :$VLLM_PORT ($model $*; log $log)"
    STACKS=
    if [[ -n ${STACK_SAMPLES:-} ]]; then  # its processes' main-thread stacks, for bench/stack_report.py
        path=$PWD/bench/stack_sampler:$path
        STACKS=$OUT/${name}_stacks
    fi
    ASYNCGRPO_STACK_SAMPLES=$STACKS PYTHONPATH=$path VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_NO_USAGE_STATS=1 \
        setsid python -m vllm.entrypoints.openai.api_server --model "$model" --port "$VLLM_PORT" "$@" > "$log" 2>&1 < /dev/null &
    VLLM_PID=$!
    local start=$SECONDS
    while (( SECONDS - start < LIMIT )); do
        curl -sf "http://127.0.0.1:$VLLM_PORT/health" > /dev/null 2>&1 && { echo "== vLLM up after $((SECONDS - start)) s"; return 0; }
        kill -0 "$VLLM_PID" 2> /dev/null || break
        sleep 2
    done
    echo "== vLLM did not come up:"; tail -n 30 "$log"; stop_vllm; return 1
}

stop_vllm() {  # the server's whole process group (its engine core is a child process)
    [[ -n $VLLM_PID ]] || return 0
    if [[ -n ${STACKS:-} ]] && mkdir -p "$STACKS"; then  # which cores each of its processes may run on (a shared core starves one)
        for pid in $(pgrep -g "$VLLM_PID"); do echo "$(taskset -cp "$pid" 2>&1) $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-80)"; done \
            > "$STACKS/affinity.txt" 2>&1
    fi
    kill -- "-$VLLM_PID" 2> /dev/null
    for _ in $(seq 60); do kill -0 "$VLLM_PID" 2> /dev/null || break; sleep 1; done
    kill -9 -- "-$VLLM_PID" 2> /dev/null
    VLLM_PID=
    if [[ -n ${STACKS:-} ]]; then
        python bench/stack_report.py "$STACKS" --out "$STACKS.json" > "$STACKS.txt" 2>&1 && head -n 40 "$STACKS.txt"
        STACKS=
    fi
}
trap stop_vllm EXIT

SECTIONS=" tests packing profile deltanet hybrid one_gpu one_gpu_inprocess one_gpu_compile one_gpu_sac one_gpu_flash one_gpu_keepkv one_gpu_mps vllm_one_gpu vllm_lora packing_tune packing_flash engine decode "
for name in "$@"; do  # every name is checked before any section runs
    [[ $SECTIONS == *" $name "* ]] || { echo "unknown section $name (see the top of $0)"; exit 2; }
done

for name in "$@"; do
    case $name in
    tests)
        section tests python -m pytest -q -m gpu -p no:cacheprovider --durations=30 tests/gpu \
            --ignore=tests/gpu/test_vllm_push.py --ignore=tests/gpu/test_vllm_lora_sync.py \
            --ignore=tests/gpu/test_deltanet_kernels.py ;;
    packing)
        section packing python bench/packing.py --device cuda --workloads default shared-prompt \
            --variants base compile+head compile+head+nockpt compile+head+sac --layouts padfree --warmup 2 --steps 3 \
            --out "$OUT/packing_cuda_workloads.json" ;;
    profile)
        section profile python bench/profile_step.py --device cuda --models qwen3-0.6b --workload shared-prompt \
            --variants base compile+head --out-dir "$OUT" ;;
    deltanet)
        section deltanet_tests python -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/gpu/test_deltanet_kernels.py
        section delta_rule python bench/delta_rule.py --device cuda --out "$OUT/delta_rule_cuda.json" ;;
    hybrid)
        section hybrid python bench/packing.py --device cuda --models qwen3.5-2b --warmup 2 --steps 3 \
            --out "$OUT/packing_hybrid_cuda.json" ;;
    one_gpu)
        section one_gpu python bench/one_gpu.py --shape "$SHAPE" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
            --output "$OUT/one_gpu_$SHAPE.json" ;;
    one_gpu_inprocess)
        section one_gpu_inprocess python bench/one_gpu.py --shape "$SHAPE" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
            --sharing in-process --output "$OUT/one_gpu_inprocess_$SHAPE.json" ;;
    one_gpu_compile)
        section one_gpu_compile python bench/one_gpu.py --shape "$SHAPE" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
            --sharing in-process --torch-compile --output "$OUT/one_gpu_inprocess_compile_$SHAPE.json" ;;
    one_gpu_sac)
        section one_gpu_sac python bench/one_gpu.py --shape "$SHAPE" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
            --sharing in-process --torch-compile --activation-memory-budget 0.5 \
            --output "$OUT/one_gpu_inprocess_sac_$SHAPE.json" ;;
    one_gpu_flash)
        section one_gpu_flash python bench/one_gpu.py --shape "$SHAPE" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
            --sharing in-process --torch-compile --activation-memory-budget 0.75 --flex-attention-backend flash \
            --output "$OUT/one_gpu_inprocess_flash_$SHAPE.json" ;;
    one_gpu_keepkv)
        section one_gpu_keepkv python bench/one_gpu.py --shape "$SHAPE" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
            --keep-kv-across-syncs --output "$OUT/one_gpu_keepkv_$SHAPE.json" ;;
    one_gpu_mps)
        section one_gpu_mps python bench/one_gpu.py --shape "$SHAPE" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
            --sharing mps --output "$OUT/one_gpu_mps_$SHAPE.json" ;;
    vllm_one_gpu)
        model=/tmp/asyncgrpo-one-gpu/qwen3-$SHAPE-chat
        python bench/one_gpu.py --shape "$SHAPE" --model-dir "$model" --build-only > /dev/null
        if start_vllm vllm_one_gpu_server "$model" --weight-transfer-config '{"backend": "ipc"}' --enable-scale-out \
                --logprobs-mode processed_logprobs --gpu-memory-utilization 0.35 --max-model-len 2048; then
            section vllm_one_gpu python bench/one_gpu.py --shape "$SHAPE" --model-dir "$model" --server vllm \
                --vllm-url "http://127.0.0.1:$VLLM_PORT" --max-seconds 60 --deadline-s $((LIMIT - 20)) \
                --output "$OUT/one_gpu_vllm_$SHAPE.json"
            stop_vllm
        fi ;;
    vllm_lora)
        model=/tmp/qwen3-1.7b
        python bench/serve_throughput.py --random-qwen3 1.7b --model-dir "$model" --build-only > /dev/null
        if start_vllm vllm_lora_server "$model" --enable-lora --max-lora-rank 32 --max-loras 4 --enable-scale-out \
                --logprobs-mode processed_logprobs --max-model-len 1024 --gpu-memory-utilization 0.45 \
                --weight-transfer-config '{"backend": "ipc"}'; then
            ASYNCGRPO_TEST_VLLM_URL=http://127.0.0.1:$VLLM_PORT ASYNCGRPO_TEST_VLLM_MODEL=$model \
                section vllm_lora_tests python -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_vllm_lora_sync.py
            section vllm_lora_bench python bench/lora_sync.py --shape 1.7b --device cuda --model-dir "$model" \
                --vllm-url "http://127.0.0.1:$VLLM_PORT" --phase-timeout-s 90 --output "$OUT/lora_sync_cuda.json"
            stop_vllm
        fi ;;
    packing_tune)
        section packing_tune python bench/packing.py --device cuda --models qwen3-0.6b --workloads shared-prompt \
            --variants base compile+head compile+head+tune --layouts padfree --warmup 2 --steps 3 \
            --out "$OUT/packing_tune.json" ;;
    packing_flash)
        section packing_flash python bench/packing.py --device cuda --workloads shared-prompt default \
            --variants compile+head compile+head+flash compile+head+sac+flash --sac-budget 0.75 --variant-layouts tree \
            --layouts tree_torch --warmup 2 --steps 3 --out "$OUT/packing_flash.json" ;;
    engine)
        python bench/serve_throughput.py --random-qwen3 0.6b --build-only --model-dir /tmp/asyncgrpo-m06 > /dev/null 2>&1
        section engine_group python bench/engine_phases.py --random-qwen3 0.6b --model-dir /tmp/asyncgrpo-m06 \
            --shape group --concurrency 256 --prompt-len 2048 --group-size 8 --max-tokens 256 --shared-prefix on --profile \
            --prompt-attention flash_varlen,padded --output "$OUT/engine_phases_group.json"
        section engine_turns python bench/engine_phases.py --random-qwen3 0.6b --model-dir /tmp/asyncgrpo-m06 \
            --shape turns --concurrency 64 --prompt-len 512 --max-tokens 128 --turns 4 --turn-tokens 64 \
            --shared-prefix on --prompt-attention flash_varlen,padded --profile --output "$OUT/engine_phases_turns.json"
        # the turn waves' 1,200-1,280-token steps on graphs (rows of the decode attention) instead of eager
        section engine_turns_rows2048 python bench/engine_phases.py --random-qwen3 0.6b --model-dir /tmp/asyncgrpo-m06 \
            --shape turns --concurrency 64 --prompt-len 512 --max-tokens 128 --turns 4 --turn-tokens 64 \
            --shared-prefix on --max-prompt-rows 2048 --output "$OUT/engine_phases_turns_rows2048.json" ;;
    decode)
        section decode python bench/decode_step.py --random-qwen3 0.6b --device cuda --batch 256 --prompt-len 128 \
            --max-tokens 256 --implementations triton,gather --window 256 --softcap 50 --output "$OUT/decode_step.json" ;;
    *)
        echo "unknown section $name (see the top of $0)"; exit 2 ;;
    esac
done

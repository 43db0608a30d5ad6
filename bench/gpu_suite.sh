#!/usr/bin/env bash
# The GPU results recorded in bench/results: run from the repository root on a CUDA machine,
# with the project importable (installed, or PYTHONPATH=.). OUT is where records go.
#   bench/gpu_suite.sh [benchmarks|fp8|speculative|peers|vllm|matrix|serve|gateway|fleet|offload|
#                       quant|structured|tests|allreduce|tp|tp_vllm|data_parallel|routing|moe|moe_more|
#                       moe_throughput|moe_latency|moe_fp8|matrix_profile|matrix_moe|matrix_moe_profile|
#                       decode_splits|prefill_sdpa|prefill_rows|
#                       matrix_budget|first_process|gemv_table|cascade|moe_mixtral|tp4]...
# (default: all but vllm, matrix, matrix_profile, prefill_sdpa, prefill_rows, matrix_budget,
# first_process, gemv_table, cascade, allreduce, tp, tp_vllm, data_parallel, routing and the moe steps (moe_mixtral:
# two GPUs), and tp4 (four GPUs),
# which need vLLM, two GPUs or a call of their own)
# vllm, matrix, matrix_profile, prefill_rows, matrix_budget, cascade, tp_vllm and
# moe_throughput/moe_latency/moe_fp8/matrix_moe/matrix_moe_profile need vLLM importable (on the lent GPU:
# shared/peers/vllm-0.26's recipe, then PYTHONPATH=$PWD:/tmp/vsite
# VLLM_USE_FLASHINFER_SAMPLER=0); structured compares with vLLM when it is importable.
# MATRIX_ARGS picks a part of the matrix (e.g. "--models llama3-8b --workloads long-context");
# rerun to finish what is missing.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PS=(python -m commands)
log() { echo "== $(date +%T) $*" >&2; }

benchmarks() {
    log kernels
    "${PS[@]}" bench kernels --batch-sizes 1,8,64 --context-lens 1024,4096,16384,32768 \
        --output-json "$OUT/kernels-h200.json"
    log throughput qwen3-0.6b
    "${PS[@]}" bench throughput --model dummy:qwen3-0.6b --no-progress \
        --output-json "$OUT/throughput-qwen3-0.6b.json"
    log throughput llama3-8b
    "${PS[@]}" bench throughput --model dummy:llama3-8b --no-progress \
        --output-json "$OUT/throughput-llama3-8b.json"
    log latency llama3-8b
    "${PS[@]}" bench latency --model dummy:llama3-8b --batch-sizes 1,8,32,64 --no-progress \
        --max-model-len 4096 --output-json "$OUT/latency-llama3-8b.json"
}

fp8() {
    log fp8 cache: quality against bf16, and throughput
    "${PS[@]}" bench kv-quality --model dummy:qwen3-0.6b --output-json "$OUT/kv-quality-qwen3-0.6b.json"
    "${PS[@]}" bench throughput --model dummy:qwen3-0.6b --no-progress --pa-cache-type fp8_e4m3 \
        --output-json "$OUT/throughput-qwen3-0.6b-fp8.json"
}

speculative() {  # with and without drafts, on the same greedy requests, at batch 1 and 8
    log speculative smollm2-135m: prompt lookup on copy-a-passage prompts
    "${PS[@]}" bench speculative --model smollm2-135m --batch-sizes 1,8 --no-progress \
        --output-json "$OUT/speculative-ngram-smollm2-135m.json"
    log speculative llama3-8b: random weights copy nothing, so this is the cost of failed drafts
    "${PS[@]}" bench speculative --model dummy:llama3-8b --batch-sizes 1,8 --max-model-len 4096 \
        --no-progress --output-json "$OUT/speculative-ngram-llama3-8b-random.json"
    log speculative draft model: the bundled model as its own draft, its overhead
    "${PS[@]}" bench speculative --model smollm2-135m --quantization none --max-model-len 4096 \
        --speculative-model smollm2-135m --batch-sizes 1,8 --no-progress \
        --output-json "$OUT/speculative-draft-smollm2-135m.json"
    log speculative draft model: an 8B-sized target grown around the bundled model
    local grown=${GROWN_DIR:-/tmp/spec-pair-grown}
    python -m bench.spec_pair smollm2-135m "$grown" --noise 0.6
    "${PS[@]}" bench speculative --model "$grown" --speculative-model smollm2-135m \
        --max-model-len 4096 --batch-sizes 1,8 --no-progress \
        --output-json "$OUT/speculative-draft-grown-llama3-8b-size.json"
    rm -rf "$grown"
}

peers() {  # transformers in the same process: minutes each
    log throughput qwen3-0.6b against hf and paged-off
    "${PS[@]}" bench throughput --model dummy:qwen3-0.6b --no-progress --compare hf,paged-off \
        --output-json "$OUT/throughput-qwen3-0.6b-vs-hf.json"
}

serve() {  # the service: 256 streams through an embedded Redis and a worker subprocess
    log serve qwen3-0.6b
    "${PS[@]}" bench serve --spawn-worker --model dummy:qwen3-0.6b --concurrency 256 \
        --num-prompts 512 --input-len 100-1024 --output-len 100-1024 --warmup-runs 1 \
        --output-json "$OUT/serve-qwen3-0.6b-256.json"
}

gateway() {  # the same load through the OpenAI gateway (4 processes), against the Redis client
    log serve through the gateway qwen3-0.6b
    "${PS[@]}" bench serve --spawn-worker --model dummy:qwen3-0.6b --concurrency 256 \
        --num-prompts 512 --input-len 100-1024 --output-len 100-1024 --warmup-runs 1 \
        --through gateway --gateway-workers 4 \
        --output-json "$OUT/serve-gateway-qwen3-0.6b-256.json"
}

fleet() {  # 1, then 2 workers sharing one GPU (0.9 of it split by --pa-memory-fraction), one stream
    log gpu test, two workers on one GPU
    python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_bench_fleet.py || return 1
    log serve fleet qwen3-0.6b, 256 streams and 512 prompts per worker
    "${PS[@]}" bench serve --model dummy:qwen3-0.6b --workers 1,2 --concurrency 256 \
        --num-prompts 512 --input-len 100-1024 --output-len 100-1024 --no-offline \
        --vocab-size 151936 --output-json "$OUT/serve-fleet-qwen3-0.6b.json"
}

vllm() {  # vLLM 0.26 in a subprocess, on the same prompts, in the same run
    log sweep qwen3-0.6b against vllm
    "${PS[@]}" bench throughput --model dummy:qwen3-0.6b --num-prompts 64,256,1024,4096 \
        --compare vllm --no-progress --output-json "$OUT/sweep-qwen3-0.6b-vs-vllm.json"
    log throughput llama3-8b against vllm
    "${PS[@]}" bench throughput --model dummy:llama3-8b --compare vllm --no-progress \
        --output-json "$OUT/throughput-llama3-8b-vs-vllm.json"
    log latency llama3-8b against vllm
    "${PS[@]}" bench latency --model dummy:llama3-8b --batch-sizes 1,64 --max-model-len 4096 \
        --compare vllm --no-progress --output-json "$OUT/latency-llama3-8b-vs-vllm.json"
    log speculative draft model against vllm: an 8B-sized target grown around the bundled model
    local grown=${GROWN_DIR:-/tmp/spec-pair-grown} draft
    draft=$(python -c "from engine.loader import resolve_model_dir as r; print(r('smollm2-135m'))")
    python -m bench.spec_pair smollm2-135m "$grown" --noise 0.6
    "${PS[@]}" bench speculative --model "$grown" --speculative-model "$draft" \
        --batch-sizes 1,8 --max-model-len 4096 --max-seqs 8 --compare vllm --no-progress \
        --output-json "$OUT/speculative-draft-grown-vs-vllm.json"
    rm -rf "$grown"
}

matrix() {  # every workload on qwen3-0.6b and llama3-8b against vLLM 0.26: $OUT/matrix-CARD.json
    log matrix against vllm ${MATRIX_ARGS:-}
    # shellcheck disable=SC2086  # MATRIX_ARGS is a list of flags
    "${PS[@]}" bench matrix --compare vllm --resume --no-progress --output-json "$OUT" \
        ${MATRIX_ARGS:-}
}

matrix_profile() {  # where the rows below target spend their time, both sides, and the ceiling
    # vLLM's GEMM and attention kernels leave (kernel_ceiling): matrix-profile-rows-CARD.json.
    # The rows below 1.10 on either card (2026-11-28); about 20 minutes on an H200, so split
    # it with MATRIX_ARGS (--models M) over calls on one machine
    log profiled matrix against vllm
    # shellcheck disable=SC2086  # MATRIX_ARGS is a list of flags
    "${PS[@]}" bench matrix --compare vllm --resume --no-progress --profile-every 4 \
        --workloads standard-64,standard-256,standard-1024,prefill-heavy,decode-heavy,long-context \
        --output-json "$OUT/matrix-profile-rows-$(card).json" ${MATRIX_ARGS:-}
}

matrix_moe_profile() {  # qwen3-30b-a3b's rows below 1.10 in matrix-moe-CARD.json (2026-11-28:
    # standard 64 / 256, prefill-heavy, long context), profiled on both sides as matrix_profile
    # does, into matrix-profile-rows-CARD.json (vLLM's MoE extension unpacked)
    moe_tuned
    log profiled matrix qwen3-30b-a3b against vllm
    # shellcheck disable=SC2086  # MATRIX_ARGS is a list of flags
    "${PS[@]}" bench matrix --models qwen3-30b-a3b --compare vllm --resume --no-progress \
        --profile-every 4 --workloads standard-64,standard-256,prefill-heavy,long-context \
        --output-json "$OUT/matrix-profile-rows-$(card).json" ${MATRIX_ARGS:-}
}

decode_splits() {  # the decode split-KV rule end to end, engine alone, on qwen3-0.6b's rows it
    # moves most: programs per SM 2 (the default) / 8 / 16, even or balanced splits
    # (PAGESTREAM_DECODE_SPLITS), the default again last (the pairs' noise); about 6 minutes
    # on an H200 (MATRIX_ARGS adds or replaces flags)
    local run=0 variant
    for variant in 2:even 8:even 16:even 8:balanced 16:balanced 2:even; do
        run=$((run + 1))
        log matrix rows, programs per SM and splits ${variant}
        # shellcheck disable=SC2086  # MATRIX_ARGS is a list of flags
        PAGESTREAM_DECODE_PROGRAMS_PER_SM=${variant%%:*} PAGESTREAM_DECODE_SPLITS=${variant##*:} \
            "${PS[@]}" bench matrix --models qwen3-0.6b \
            --workloads standard-64,standard-256,tpot-b64 --no-progress \
            --output-json "$OUT/matrix-decode-splits-$run-${variant/:/-}-$(card).json" ${MATRIX_ARGS:-}
    done
}

matrix_moe() {  # the matrix on qwen3-30b-a3b against vLLM (its MoE extension unpacked: the
    # peer's third call): matrix-moe-CARD.json; split it over calls with MATRIX_ARGS
    # (--workloads ...) and --resume finishes what is missing
    moe_tuned
    log matrix qwen3-30b-a3b against vllm ${MATRIX_ARGS:-}
    # shellcheck disable=SC2086  # MATRIX_ARGS is a list of flags
    "${PS[@]}" bench matrix --models qwen3-30b-a3b --compare vllm --resume --no-progress \
        --output-json "$OUT/matrix-moe-$(card).json" ${MATRIX_ARGS:-}
}

prefill_sdpa() {  # the cuDNN prefill path: its GPU tests, then per shape against the Triton kernel
    log prefill sdpa path
    python -m pytest -q -x -p no:cacheprovider tests/test_prefill_sdpa.py \
        tests/test_gpu.py -k "cudnn or chunk or merge or bucket or which" || return 1
    # the current Triton config only (the sweep's table is already measured) beside the path
    python -m bench.prefill_attention --candidates m128n128w8s3 --top 1 \
        --out "$OUT/prefill-attention-sdpa-path-$(card).json"
}

prefill_rows() {  # the prefill-bound matrix rows: vLLM and the default path (cuDNN on Hopper),
    # then the Triton kernel alone in the same session (prefill-sdpa-matrix-rows-h200.json's A/B)
    log prefill-bound rows against vllm, then on the triton kernel
    "${PS[@]}" bench matrix --compare vllm --resume --no-progress \
        --workloads prefill-heavy,long-context --output-json "$OUT/matrix-prefill-rows-$(card).json"
    PAGESTREAM_PREFILL_ATTN=triton "${PS[@]}" bench matrix --resume --no-progress \
        --workloads prefill-heavy,long-context \
        --output-json "$OUT/matrix-prefill-rows-triton-$(card).json"
}

matrix_budget() {  # the whole matrix against vLLM with its token budget (16,384; chunks of 8,192),
    # beside the default matrix of the same session: decides the engine's default budget
    # (prefill-chunk-long-context-h200.json: long context 4% faster at 16k)
    log matrix against vllm, token budget 16384
    # shellcheck disable=SC2086  # MATRIX_ARGS is a list of flags
    "${PS[@]}" bench matrix --compare vllm --resume --no-progress --max-batched-tokens 16384 \
        --prefill-chunk 8192 --output-json "$OUT/matrix-budget16k-$(card).json" ${MATRIX_ARGS:-}
}

gemv_table() {  # a new GPU model's rows of the decode linears' table (kernels/linear/gemv_configs.json):
    # the batch-1 linears of the matrix's models swept and installed, then batch-1 TPOT with the
    # table off and on (without rows the card runs the kernels' defaults: 3-5% on an H100)
    for model in llama3-8b qwen3-0.6b; do
        log gemv sweep "$model"
        python -m bench.gemv --model "$model" --rows 1 --install \
            --out "$OUT/gemv-$model-tp1-$(card).json"
    done
    cp kernels/linear/gemv_configs.json "$OUT/"
    for table in off on; do
        log latency llama3-8b, gemv table "$table"
        PAGESTREAM_GEMV_TABLE=$([ "$table" = off ] && echo off) "${PS[@]}" bench latency \
            --model dummy:llama3-8b --batch-sizes 1 --max-model-len 4096 --no-progress \
            --output-json "$OUT/latency-llama3-8b-gemv-table-$table-$(card).json"
    done
}
cascade() {  # cascade decode (--cascade-attention): its GPU tests, one layer's attention plain
    # against cascade, then the shared-prefix rows (one system prompt, and four) against vLLM
    # with it off and on
    log cascade decode
    python -m pytest -q -x -p no:cacheprovider tests/test_triton_paged_attention.py \
        tests/test_gpu.py -k "cascade or several_prefixes or spare_prefix or reference or capturable" \
        || return 1
    python -m bench.cascade_decode --output-json "$OUT/cascade-decode-$(card).json"
    for cascade in off on; do
        log shared-prefix rows against vllm, cascade "$cascade"
        "${PS[@]}" bench matrix --compare vllm --resume --no-progress \
            --workloads shared-prefix,shared-prefixes --cascade-attention "$cascade" \
            --output-json "$OUT/matrix-shared-prefix-cascade-$cascade-$(card).json"
    done
}
first_process() {  # long context in a fresh machine's first process (Triton's cache empty):
    # run before anything else in the machine session, then once more
    log long context, first process then second
    for run in first second; do
        "${PS[@]}" bench matrix --no-progress --models dummy:qwen3-0.6b --workloads long-context \
            --output-json "$OUT/matrix-long-context-$run-process-$(card).json"
    done
}

offload() {  # multi-turn chat whose sessions' histories outgrow the GPU pool: host tier off/on
    log multiturn qwen3-0.6b
    "${PS[@]}" bench multiturn --model dummy:qwen3-0.6b --num-sessions 64 --num-turns 4 \
        --system-len 1024 --user-len 32-128 --output-len 64 --concurrency 8 \
        --max-model-len 2048 --pa-memory-mb 2048 --kv-offload-mb 8192 --no-progress \
        --output-json "$OUT/multiturn-qwen3-0.6b.json"
    log multiturn llama3-8b
    "${PS[@]}" bench multiturn --model dummy:llama3-8b --num-sessions 128 --num-turns 4 \
        --system-len 1024 --user-len 32-128 --output-len 64 --concurrency 16 \
        --max-model-len 2048 --pa-memory-mb 6144 --kv-offload-mb 16384 --no-progress \
        --output-json "$OUT/multiturn-llama3-8b.json"
}

quant() {  # quantized weights against bf16: the bundled GGUF's blocks, llama3-8b quantized at load
    log quant kernels llama3-8b
    python -m bench.quant_kernels --model llama3-8b --rows 1,8,144,4096 \
        --output-json "$OUT/quant-kernels-llama3-8b.json"
    log quant kernels llama3-8b, the launch shapes that ship
    python -m bench.quant_kernels --defaults-only --model llama3-8b --formats q4_0,q4_1,q8_0 \
        --rows 1,4,8,16,32,64,128,144,256,4096 \
        --output-json "$OUT/quant-kernels-defaults-llama3-8b.json"
    log quant smollm2-135m
    "${PS[@]}" bench quant --model smollm2-135m --formats gguf \
        --output-json "$OUT/quant-smollm2-135m.json"
    log quant llama3-8b
    "${PS[@]}" bench quant --model dummy:llama3-8b --formats q8_0,q4_0,q4_1,fp8 \
        --output-json "$OUT/quant-llama3-8b.json"
    log the int8 decode paths against what they replaced, engines side by side
    python -m bench.int8_paths --formats q4_0,q4_1 --off producers --batches 1,2,4 --rounds 6 \
        --max-seqs 8 --output-json "$OUT/int8-paths-producers-llama3-8b.json"
    python -m bench.int8_paths --formats q8_0 --off int8-mma --batches 8,16,32 --rounds 4 \
        --bf16 --pa-memory-mb 6144 --output-json "$OUT/int8-paths-q8_0-mma-llama3-8b.json"
}

card() { python -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())"; }

allreduce() {  # two GPUs: NCCL against the peer-buffer sums, by message size
    log all-reduce paths by size: allreduce-CARD.json
    python -m bench.allreduce --world-size 2 --output-json "$OUT/allreduce-$(card).json"
    log the sum + residual add + RMSNorm, unfused against fused: allreduce-norm-CARD.json
    python -m bench.allreduce_norm --world-size 2 --output-json "$OUT/allreduce-norm-$(card).json"
}

tp() {  # two GPUs: tensor parallelism (tests first: TP2 gives TP1's tokens)
    log gpu tests, tensor parallel
    # each two-GPU engine runs in a fresh process (about 20-30 s a test). A stuck rank prints
    # its stacks on SIGUSR1, which a watcher sends to any rank alive past 100 s: the
    # watchdog thread of pytest-timeout never ran while the main thread held the GIL inside
    # torch's symmetric-memory rendezvous (the hang of issue 28, two sessions)
    ( while sleep 20; do for pid in $(pgrep -f engine.distributed.rank_main); do
        [ "$(ps -o etimes= -p "$pid" | tr -d ' ')" -gt 100 ] 2>/dev/null && kill -USR1 "$pid"
      done; done ) &
    local watcher=$!
    python -m pytest -q -s -p no:cacheprovider --timeout 240 --timeout-method thread \
        tests/test_gpu_tensor_parallel.py
    local status=$?
    kill "$watcher"
    [ "$status" = 0 ] || { pkill -9 -f engine.distributed.rank_main; return 1; }
    log latency llama3-8b on one GPU, on two with NCCL only, on two, unfused norm: tp-scaling-CARD.json
    local latency=("${PS[@]}" bench latency --batch-sizes 1,8,64 --max-model-len 4096 --no-progress)
    "${latency[@]}" --model dummy:llama3-8b --output-json "$OUT/latency-llama3-8b-tp1.json"
    PAGESTREAM_TP_ALLREDUCE=nccl "${latency[@]}" --model dummy:llama3-8b --tensor-parallel-size 2 \
        --output-json "$OUT/latency-llama3-8b-tp2-nccl.json"
    "${latency[@]}" --model dummy:llama3-8b --tensor-parallel-size 2 \
        --output-json "$OUT/latency-llama3-8b-tp2.json"
    PAGESTREAM_TP_FUSED_NORM=0 "${latency[@]}" --model dummy:llama3-8b --tensor-parallel-size 2 \
        --output-json "$OUT/latency-llama3-8b-tp2-unfused-norm.json"
    "${latency[@]}" --model dummy:llama3-70b --tensor-parallel-size 2 \
        --output-json "$OUT/latency-llama3-70b-tp2.json"
    python -m bench.tp_scaling "$OUT/tp-scaling-$(card).json" "$OUT/latency-llama3-8b-tp1.json" \
        "$OUT/latency-llama3-8b-tp2.json" "$OUT/latency-llama3-70b-tp2.json"
    log throughput llama3-70b on two GPUs
    "${PS[@]}" bench throughput --model dummy:llama3-70b --tensor-parallel-size 2 \
        --max-model-len 4096 --no-progress --output-json "$OUT/throughput-llama3-70b-tp2.json"
}

tp_vllm() {  # two GPUs, vLLM importable: vLLM 0.26 TP2 in the same run
    log llama3-8b TP2 latency and throughput against vLLM TP2
    "${PS[@]}" bench latency --model dummy:llama3-8b --tensor-parallel-size 2 --compare vllm \
        --batch-sizes 1,64 --max-model-len 4096 --no-progress \
        --output-json "$OUT/latency-llama3-8b-tp2-vs-vllm.json"
    "${PS[@]}" bench throughput --model dummy:llama3-8b --tensor-parallel-size 2 --compare vllm \
        --max-model-len 4096 --no-progress --output-json "$OUT/throughput-llama3-8b-tp2-vs-vllm.json"
}

tp4() {  # four GPUs: TP4 beside TP1 and TP2 (tp-scaling-CARD-4gpu.json), then two TP2 workers
    # on one stream against one (each worker a group on two GPUs of its own)
    log latency llama3-8b TP1, TP2, TP4 and llama3-70b TP2, TP4: tp-scaling-CARD-4gpu.json
    local latency=("${PS[@]}" bench latency --batch-sizes 1,8,64 --max-model-len 4096 --no-progress)
    local tp
    for tp in 1 2 4; do
        "${latency[@]}" --model dummy:llama3-8b --tensor-parallel-size "$tp" \
            --output-json "$OUT/latency-llama3-8b-tp$tp-4gpu.json"
    done
    for tp in 2 4; do
        "${latency[@]}" --model dummy:llama3-70b --tensor-parallel-size "$tp" \
            --output-json "$OUT/latency-llama3-70b-tp$tp-4gpu.json"
    done
    python -m bench.tp_scaling "$OUT/tp-scaling-$(card)-4gpu.json" "$OUT"/latency-llama3-*-4gpu.json
    log serve llama3-8b, 1 then 2 TP2 workers: serve-fleet-tp2-CARD.json
    "${PS[@]}" bench serve --model dummy:llama3-8b --tensor-parallel-size 2 --workers 1,2 \
        --num-prompts 256 --max-model-len 4096 --no-offline --vocab-size 128256 \
        --output-json "$OUT/serve-fleet-tp2-$(card).json"
}
data_parallel() {  # two GPUs: one worker per GPU on one stream, against one worker
    log serve qwen3-0.6b, 1 then 2 workers, one per GPU: serve-fleet-dp-CARD.json
    "${PS[@]}" bench serve --model dummy:qwen3-0.6b --workers 1,2 --worker-devices spread \
        --num-prompts 256 --no-offline --vocab-size 151936 \
        --output-json "$OUT/serve-fleet-dp-$(card).json"
}

routing() {  # prefix-aware routing against the shared group, 2 workers (one per GPU with two)
    log multiturn fleet llama3-8b, history-heavy: fleet-routing-llama3-8b-CARD.json
    "${PS[@]}" bench multiturn --model dummy:llama3-8b --workers 2 --num-sessions 96 \
        --num-turns 4 --system-len 256 --user-len 256-512 --output-len 64 --concurrency 16 \
        --max-model-len 8192 --no-progress --output-json "$OUT/fleet-routing-llama3-8b-$(card).json"
}

structured() {  # constrained decoding: tests first (CUDA defaults), then the workload with and
    # without a JSON schema; with vLLM importable, vLLM's structured outputs on the same prompts
    log gpu tests, structured outputs
    python -m pytest -q -x -p no:cacheprovider tests/test_gpu_structured.py \
        tests/test_token_bitmask.py tests/test_gc_frozen.py || return 1
    log structured outputs qwen3-0.6b
    local compare=()
    python -c "import vllm" 2>/dev/null && compare=(--compare-vllm)
    python -m bench.structured --model dummy:qwen3-0.6b "${compare[@]}" --repeat 3 --profile-steps 20 \
        --out "$OUT/structured-qwen3-0.6b.json"
}

moe() {  # mixtures of experts: GPU tests, then the block-size table measured on this card
    # (records kept in /tmp too: later calls on the same machine name them in
    # PAGESTREAM_MOE_CONFIGS, since each call brings a fresh copy of the tree)
    log gpu tests, moe: every kernel test on the GPU, and the gpu-marked model tests
    python -m pytest -q -x -p no:cacheprovider tests/test_moe_kernels.py || return 1
    python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_moe_models.py || return 1
    log moe sweep qwen3-30b-a3b, bf16
    python -m bench.moe_sweep --models qwen3-30b-a3b --output-json /tmp/moe-sweep-qwen3.json \
        && cp /tmp/moe-sweep-qwen3.json "$OUT/"
}

moe_more() {  # the block-size table for fp8 experts and for mixtral-8x7b
    log moe sweep qwen3-30b-a3b, fp8 weights
    python -m bench.moe_sweep --models qwen3-30b-a3b --fp8 \
        --output-json /tmp/moe-sweep-qwen3-fp8.json && cp /tmp/moe-sweep-qwen3-fp8.json "$OUT/"
    log moe sweep mixtral-8x7b, bf16
    python -m bench.moe_sweep --models mixtral-8x7b --output-json /tmp/moe-sweep-mixtral.json \
        && cp /tmp/moe-sweep-mixtral.json "$OUT/"
}

moe_tuned() {  # the table the moe step measured on this machine (each call brings a fresh tree)
    if [ -f /tmp/moe-sweep-qwen3.json ]; then export PAGESTREAM_MOE_CONFIGS=/tmp/moe-sweep-qwen3.json; fi
}

moe_throughput() {  # qwen3-30b-a3b against vLLM (its MoE extension unpacked: the peer's third call)
    moe_tuned
    log throughput qwen3-30b-a3b against vllm
    "${PS[@]}" bench throughput --model dummy:qwen3-30b-a3b --max-model-len 4096 --compare vllm \
        --no-progress --output-json "$OUT/throughput-qwen3-30b-a3b-vs-vllm.json"
}

moe_latency() {  # batch 1 and 64 against vLLM
    moe_tuned
    log latency qwen3-30b-a3b against vllm
    "${PS[@]}" bench latency --model dummy:qwen3-30b-a3b --batch-sizes 1,64 --max-model-len 4096 \
        --compare vllm --no-progress --output-json "$OUT/latency-qwen3-30b-a3b-vs-vllm.json"
}

moe_fp8() {  # fp8 experts (--quantization fp8) against vLLM's fp8, batch 1/8/64 and 256 prompts
    log latency and throughput qwen3-30b-a3b fp8 against vllm
    "${PS[@]}" bench latency --model dummy:qwen3-30b-a3b --quantization fp8 --batch-sizes 1,8,64 \
        --max-model-len 4096 --compare vllm --no-progress \
        --output-json "$OUT/latency-qwen3-30b-a3b-fp8-vs-vllm-$(card).json"
    "${PS[@]}" bench throughput --model dummy:qwen3-30b-a3b --quantization fp8 --max-model-len 4096 \
        --compare vllm --no-progress --output-json "$OUT/throughput-qwen3-30b-a3b-fp8-vs-vllm-$(card).json"
}

moe_mixtral() {  # two GPUs, vLLM with its MoE extension: mixtral-8x7b TP2, the table's large
    # steps swept (1-512 tokens ship, measured 2026-11-27), then against vLLM TP2
    log moe sweep mixtral-8x7b TP2, 1024-8192 tokens
    local large=/tmp/moe-sweep-mixtral-tp2-large.json
    python -m bench.moe_sweep --models mixtral-8x7b --tp 2 --tokens 1024,2048,4096,8192 \
        --output-json "$large" \
        && cp "$large" "$OUT/moe-sweep-mixtral-8x7b-tp2-large-$(card).json" \
        && export PAGESTREAM_MOE_CONFIGS="$large"
    log latency and throughput mixtral-8x7b TP2 against vllm
    "${PS[@]}" bench latency --model dummy:mixtral-8x7b --tensor-parallel-size 2 \
        --batch-sizes 1,64 --max-model-len 4096 --compare vllm --no-progress \
        --output-json "$OUT/latency-mixtral-8x7b-tp2-vs-vllm-$(card).json"
    "${PS[@]}" bench throughput --model dummy:mixtral-8x7b --tensor-parallel-size 2 \
        --max-model-len 4096 --compare vllm --no-progress \
        --output-json "$OUT/throughput-mixtral-8x7b-tp2-vs-vllm-$(card).json"
}
tests() {
    log gpu tests
    python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_triton_kernels.py \
        tests/test_triton_paged_attention.py tests/test_kv_offload.py tests/test_quant_kernels.py \
        tests/test_quant_model.py tests/test_quant_dequant.py tests/test_gpu_speculative.py \
        tests/test_quant_mma_int8.py tests/test_quant_gemv_int8.py tests/test_int8_producers.py \
        tests/test_rotary_kv_write.py tests/test_gemv.py tests/test_pdl.py tests/test_prefill_sdpa.py \
        tests/test_jit_compiles.py
}

for part in "${@:-benchmarks fp8 speculative peers serve gateway fleet offload quant structured tests}"; do
    for step in $part; do "$step"; done
done

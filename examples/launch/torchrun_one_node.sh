#!/usr/bin/env bash
# One node with several GPUs: vLLM on GPUs 0..K-1, the rollout server (no GPU), and the trainer on the
# other GPUs, one torchrun rank each, sharded with FSDP2.
#
#   MODEL=Qwen/Qwen3-8B DATASET=my-org/harbor-tasks GPUS=8 VLLM_GPUS=4 \
#       examples/launch/torchrun_one_node.sh --harness opencode --split train --max-steps 200
#
# Arguments go to the trainer launcher (`harness-trainer train`'s flags). Settings, from the environment:
#   MODEL, DATASET      required: the policy, and the task folder or Hub dataset for `serve`
#   GPUS                GPUs on this node (default: nvidia-smi's count)
#   VLLM_GPUS           K, vLLM's GPUs (default 1); the trainer gets the other GPUS - K
#   VLLM_PARALLEL       tensor (one model across K GPUs; K must divide its attention heads) or data
#                       (K copies), vLLM's --tensor-parallel-size / --data-parallel-size
#   SHARDING            fsdp2 (default) or ddp: the trainer refuses LoRA (--lora) under FSDP, use ddp
#   CONCURRENCY         the trainer's --max-concurrent-rollouts (default 8); serve holds one session more
#   SANDBOX             the trainer's --sandbox (default local: agents run on this node)
#   OUTPUT_DIR          default outputs/torchrun-one-node (capture journals in OUTPUT_DIR/capture)
#   TOOL_CALL_PARSER    vLLM's tool-call parser (default hermes)
#   DRY_RUN=1           print each command (its name, then the shell-quoted command) and start nothing
#
# The vLLM flags, the FSDP2 environment and the trainer module are those of harness_trainer.jobs (plan.py,
# gpus.py); tests/jobs/test_multi_gpu.py renders this script with DRY_RUN=1 and checks each argument
# against them. It has not been run on GPUs.
set -euo pipefail

MODEL=${MODEL:?set MODEL, the policy to train}
DATASET=${DATASET:?set DATASET, the tasks for the rollout server}
GPUS=${GPUS:-$(nvidia-smi --list-gpus | wc -l)}
VLLM_GPUS=${VLLM_GPUS:-1}
VLLM_PARALLEL=${VLLM_PARALLEL:-tensor}
SHARDING=${SHARDING:-fsdp2}
CONCURRENCY=${CONCURRENCY:-8}
SANDBOX=${SANDBOX:-local}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/torchrun-one-node}
TOOL_CALL_PARSER=${TOOL_CALL_PARSER:-hermes}
PYTHON=${PYTHON:-python3}
VLLM_PORT=8000
SERVER_PORT=8200
CAPTURE_PORT=8300
# harness_trainer.jobs.plan.VLLM_FLAGS: docs/gpu-checks.md's flags, and automatic tool choice for the agents.
VLLM_FLAGS=(--logprobs-mode processed_logprobs --return-tokens-as-token-ids
    --weight-transfer-config '{"backend": "nccl"}' --enable-auto-tool-choice)
# harness_trainer.jobs.gpus.FSDP2_ENV: what `accelerate launch --use_fsdp --fsdp_version 2
# --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP` sets, and Accelerator() reads, under torchrun.
FSDP2_ENV=(ACCELERATE_USE_FSDP=true FSDP_VERSION=2 FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP)

fail() { echo "error: $*" >&2; exit 2; }
((GPUS >= 2)) || fail "GPUS=$GPUS: vLLM and the trainer need a GPU each"
((VLLM_GPUS >= 1 && VLLM_GPUS < GPUS)) || fail "VLLM_GPUS=$VLLM_GPUS: 1 to $((GPUS - 1)) of the $GPUS GPUs"
case $VLLM_PARALLEL in
    tensor) PARALLEL_FLAG=--tensor-parallel-size ;;
    data) PARALLEL_FLAG=--data-parallel-size ;;
    *) fail "VLLM_PARALLEL=$VLLM_PARALLEL: tensor or data" ;;
esac
case $SHARDING in
    fsdp2) SHARDING_ENV=("${FSDP2_ENV[@]}") ;;
    ddp) SHARDING_ENV=() ;;  # torchrun's ranks without ACCELERATE_USE_FSDP: accelerate uses DDP
    *) fail "SHARDING=$SHARDING: fsdp2 or ddp" ;;
esac
VLLM_DEVICES=$(seq -s, 0 $((VLLM_GPUS - 1)))
TRAINER_DEVICES=$(seq -s, "$VLLM_GPUS" $((GPUS - 1)))
TRAINER_RANKS=$((GPUS - VLLM_GPUS))
PARALLEL=()
((VLLM_GPUS == 1)) || PARALLEL=("$PARALLEL_FLAG" "$VLLM_GPUS")

PIDS=()
# Stop every background process when this script ends, however it ends.
trap 'for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done' EXIT

# start NAME VAR=VALUE... -- COMMAND...: run COMMAND in the background with those variables set.
start() {
    local name=$1 env=()
    shift
    while [[ $1 != -- ]]; do env+=("$1"); shift; done
    shift
    if [[ -n ${DRY_RUN:-} ]]; then
        printf '%s:' "$name"; printf ' %q' env "${env[@]}" "$@"; printf '\n'
        return
    fi
    env "${env[@]}" "$@" &
    PIDS+=($!)
}

# wait_up URL: until it answers 200 (vLLM loading a large model takes minutes), while every process
# started so far lives.
wait_up() {
    [[ -n ${DRY_RUN:-} ]] && return
    until curl -sf -o /dev/null "$1"; do
        for pid in "${PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || fail "a process exited before $1 answered (its output is above)"
        done
        sleep 2
    done
    echo "up: $1" >&2
}

start vllm CUDA_VISIBLE_DEVICES="$VLLM_DEVICES" VLLM_SERVER_DEV_MODE=1 -- \
    "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$VLLM_PORT" \
    "${VLLM_FLAGS[@]}" --tool-call-parser "$TOOL_CALL_PARSER" "${PARALLEL[@]}"
wait_up "http://127.0.0.1:$VLLM_PORT/health"

start serve CUDA_VISIBLE_DEVICES= MAX_CONCURRENT_ENVS=$((CONCURRENCY + 1)) -- \
    "$PYTHON" -m harness_trainer.cli serve --dataset "$DATASET" --upstream "http://127.0.0.1:$VLLM_PORT" \
    --host 127.0.0.1 --port "$SERVER_PORT" --capture-host 127.0.0.1 --capture-port "$CAPTURE_PORT" \
    --data-dir "$OUTPUT_DIR/capture"
wait_up "http://127.0.0.1:$SERVER_PORT/health"
wait_up "http://127.0.0.1:$CAPTURE_PORT/health"

TRAINER=(torchrun --standalone --nproc_per_node "$TRAINER_RANKS" -m harness_trainer.jobs.trainer_entry
    --model "$MODEL" --sandbox "$SANDBOX" --max-concurrent-rollouts "$CONCURRENCY" --output-dir "$OUTPUT_DIR"
    "$@" --server "http://127.0.0.1:$SERVER_PORT" --vllm-url "http://127.0.0.1:$VLLM_PORT")
if [[ -n ${DRY_RUN:-} ]]; then
    start trainer CUDA_VISIBLE_DEVICES="$TRAINER_DEVICES" "${SHARDING_ENV[@]}" -- "${TRAINER[@]}"
    exit 0
fi
# In the foreground: the script's exit status is the trainer's.
env CUDA_VISIBLE_DEVICES="$TRAINER_DEVICES" "${SHARDING_ENV[@]}" "${TRAINER[@]}"

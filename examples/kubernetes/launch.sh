#!/bin/bash
# The container command of a Kubernetes training job: one `accelerate launch` per pod, from the variables the
# operator sets, each pod starting one process per GPU (docs/multi_node.md).
#   Kubeflow Trainer TrainJob (torch runtime): PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR,
#                                              PET_MASTER_PORT
#   Kubeflow PyTorchJob (training-operator v1): WORLD_SIZE (the pods), RANK (this pod), MASTER_ADDR, MASTER_PORT
#   bash examples/kubernetes/launch.sh recipes/data_parallel.py --output_dir /output/run --checkpointing_steps 50
# CONFIG: the launch config (multi_node.yaml, or fsdp.yaml ...); MAX_RESTARTS=N: elastic restarts, as the sbatch
# (verified on one machine only: docs/multi_node.md).
# tests/test_engines.py runs it as 2 "pods" of 1 process on 127.0.0.1, with the TrainJob's own command and args.
set -euo pipefail
cd "$(dirname "$0")/../.."

NNODES=${PET_NNODES:-${WORLD_SIZE:-1}}
NODE_RANK=${PET_NODE_RANK:-${RANK:-0}}
MAIN_IP=${PET_MASTER_ADDR:-${MASTER_ADDR:-127.0.0.1}}
MAIN_PORT=${PET_MASTER_PORT:-${MASTER_PORT:-29500}}
PER_NODE=${PET_NPROC_PER_NODE:-auto}
if [ "$PER_NODE" = auto ] || [ "$PER_NODE" = gpu ]; then  # the GPUs this pod sees
    PER_NODE=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
# torchrun reads PET_* as its own defaults and the pod's RANK/WORLD_SIZE would reach the processes: the flags below
# say it all, and torchrun gives every process its own rank.
unset PET_NNODES PET_NPROC_PER_NODE PET_NODE_RANK PET_MASTER_ADDR PET_MASTER_PORT RANK WORLD_SIZE
ELASTIC=()
if [ "${MAX_RESTARTS:-0}" -gt 0 ]; then
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # c10d on MAIN_IP:MAIN_PORT, a store of its own per attempt
    ELASTIC=(--rdzv_backend c10d --max_restarts "$MAX_RESTARTS" --monitor_interval 1)
fi
exec accelerate launch --config_file "${CONFIG:-accelerate_configs/multi_node.yaml}" \
    --num_machines "$NNODES" --num_processes $((NNODES * PER_NODE)) --machine_rank "$NODE_RANK" \
    --main_process_ip "$MAIN_IP" --main_process_port "$MAIN_PORT" --rdzv_conf timeout=300 "${ELASTIC[@]}" "$@"

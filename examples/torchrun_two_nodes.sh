#!/usr/bin/env bash
# Two nodes x 8 GPUs, ResNet-50 on ImageNet streamed from Swift, checkpoints to Swift.
# Run this same script on both nodes; HEAD is the first node's address (reachable from both).
#
#   HEAD=10.0.0.11 bash examples/torchrun_two_nodes.sh
#
# On a lease's end, send SIGUSR1 (or SIGTERM) to torchrun: it forwards the signal to every
# worker, the workers checkpoint together at the next step and exit with code 75, and the
# same command later resumes where they stopped (--resume auto). --shutdown-timeout is how
# long torchrun waits for that checkpoint before it kills the workers. torchrun itself then
# exits 1 (its own SignalException), not 75: a wrapper that requeues tells a stop for a signal
# from a failure by the workers' log line "stopped at step N for SIGUSR1", or by the signal it
# sent, not by torchrun's exit code. (Under srun, each rank's 75 is the step's exit code.)
set -euo pipefail
: "${HEAD:?set HEAD to the address of the first node}"
source "${OPENRC:-$HOME/openrc.sh}"   # OS_* (Keystone) or ST_* (tempauth) credentials

# Nodes with several network interfaces: name the one the ranks should use, e.g.
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=eth0   (gloo carries the trainer's control messages)
export OMP_NUM_THREADS=4
# For an elastic run that goes on without a lost node (--nnodes 1:2 --max-restarts 1), also:
# export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   (a restart then gets a store of its own)

torchrun \
    --nnodes 2 --nproc-per-node 8 \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id "resnet50-$(date +%Y%m%d)" \
    --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --shutdown-timeout 300 \
    -m dlstore train swift://imagenet/train --val-url swift://imagenet/val \
        --model resnet50 --batch-size 256 --workers 12 --epochs 40 \
        --base-lr 0.5 --warmup-epochs 5 --label-smoothing 0.1 \
        --image-size 192 --eval-image-size 256 \
        --resize-min 160 --resize-start-epoch 10 --resize-end-epoch 32 \
        --cache-dir /mnt/local-ssd/dlstore --cache-limit 150GB \
        --checkpoint-url swift://checkpoints/resnet50-run1 \
        --checkpoint-every-minutes 20 --keep-checkpoints 3 --resume auto \
        --output-dir runs/resnet50-run1

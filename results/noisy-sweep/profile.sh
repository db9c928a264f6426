#!/usr/bin/env bash
# noisy: a busy process on core 1 (rank 1's); default compare model; profile steps 18-20.
# usage: results/noisy-sweep/profile.sh migrate none; then python scripts/sync_waits.py /tmp/noisyprof/<policy>
set -uo pipefail
cd "$(dirname "$0")/../.."
model="--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --lr 1e-4 --mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
for policy in "$@"; do
  rm -rf /tmp/noisyprof/$policy; mkdir -p /tmp/noisyprof/$policy
  .venv/bin/python scripts/noisy_neighbor.py --cpu 1 --duration 600 > /dev/null 2>&1 &
  nb=$!
  sleep 1
  for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 OMP_NUM_THREADS=1 \
    taskset -c $r .venv/bin/python pretrain_gpt.py $model --tensor-model-parallel-size 2 --global-batch-size 4 \
      --train-iters 24 --log-interval 24 --het-tp-interval 4 --seed 1234 --het-tp-policy $policy --het-tp-timer wall \
      --profile --use-pytorch-profiler --profile-step-start 18 --profile-step-end 20 --profile-ranks 0 1 \
      --tensorboard-dir /tmp/noisyprof/$policy --metrics-file /tmp/noisyprof/$policy.jsonl > /tmp/noisyprof/$policy.$r.log 2>&1 &
  done
  wait %2 %3
  kill $nb
  echo "$policy done"
done

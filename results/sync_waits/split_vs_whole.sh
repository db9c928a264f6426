#!/usr/bin/env bash
# docs/measurements.md, "What a split group costs on the slow rank": the head-units benchmark's model at TP=2, rank 0
# emulated 3.5x slower, two fixed plans with the same MLP split (312 : 1096 neurons a layer):
# rank 0 holding one query head of group 0 with its K/V replica (head units, `split`), and
# rank 0 holding no attention (group units, `whole`). 16 iterations, steps 12-14 profiled.
# Then: python scripts/sync_waits.py /tmp/prof_split (and /tmp/prof_whole).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'scripts'); import bench_head_units as b; print(' '.join(b.model(2, 512)))")
run() {
  local name=$1
  shift
  rm -rf "/tmp/prof_$name" "/tmp/prof_$name.jsonl"
  # shellcheck disable=SC2086  # $model is a flag list
  OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py \
    $model --tensor-model-parallel-size 2 --global-batch-size 4 --train-iters 16 \
    --log-interval 16 --het-tp-interval 4 --seed 1234 --het-tp-policy static "$@" \
    --het-tp-emulate persistent:rank=0,factor=3.5 \
    --profile --use-pytorch-profiler --profile-step-start 12 --profile-step-end 14 \
    --profile-ranks 0 1 --tensorboard-dir "/tmp/prof_$name" \
    --metrics-file "/tmp/prof_$name.jsonl" > "/tmp/prof_$name.log" 2>&1
  echo "$name: /tmp/prof_$name"
}
run split --het-tp-attn-granularity 1 --het-tp-plan 'attn=1,7;mlp=312,1096'
run whole --het-tp-plan 'attn=0,2;mlp=312,1096'

#!/usr/bin/env bash
# The two profiled runs of docs/measurements.md "Small imbalances that persist, and where the TP=2 gap goes":
# the head-units benchmark's model at TP=2, rank 1 emulated 2.5x slower, 16 iterations, steps
# 12-14 profiled on both ranks; migrate with head units, and the even split (policy none).
# Then: python scripts/sync_waits.py /tmp/prof_migrate (and /tmp/prof_none).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'scripts'); import bench_head_units as b; print(' '.join(b.model(2, 512)))")
for policy in migrate none; do
  rm -rf "/tmp/prof_$policy" "/tmp/prof_$policy.jsonl"
  # shellcheck disable=SC2086  # $model is a flag list
  OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py \
    $model --tensor-model-parallel-size 2 --global-batch-size 4 --train-iters 16 \
    --log-interval 16 --het-tp-interval 4 --seed 1234 --het-tp-policy "$policy" \
    --het-tp-attn-granularity 1 --het-tp-emulate persistent:rank=1,factor=2.5 \
    --profile --use-pytorch-profiler --profile-step-start 12 --profile-step-end 14 \
    --profile-ranks 0 1 --tensorboard-dir "/tmp/prof_$policy" \
    --metrics-file "/tmp/prof_$policy.jsonl" > "/tmp/prof_$policy.log" 2>&1
  echo "$policy: /tmp/prof_$policy"
done

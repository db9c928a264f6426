#!/usr/bin/env bash
# TP=4 dilated, the head-units benchmark model: no straggler (even), rank 2 at 2.2x on the even split (slow),
# and migrate with head units (migrate) and with query groups (migrate-groups); steps 14-16 profiled on
# every rank. Then: python scripts/sync_waits.py /tmp/prof4/<name> (results/sync_waits/tp4-2.2x-rank2-*.txt)
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'scripts'); import bench_head_units as b; print(' '.join(b.model(4, 512)))")
run() {
  name=$1; shift
  rm -rf "/tmp/prof4/$name" "/tmp/prof4/$name.jsonl"
  OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 pretrain_gpt.py \
    $model --tensor-model-parallel-size 4 --global-batch-size 4 --train-iters 18 \
    --log-interval 18 --het-tp-interval 4 --seed 1234 --het-tp-attn-granularity 1 \
    --het-tp-emulate-dilation 3 "$@" \
    --profile --use-pytorch-profiler --profile-step-start 14 --profile-step-end 16 \
    --profile-ranks 0 1 2 3 --tensorboard-dir "/tmp/prof4/$name" \
    --metrics-file "/tmp/prof4/$name.jsonl" > "/tmp/prof4/$name.log" 2>&1
  echo "$name: /tmp/prof4/$name"
}
run even --het-tp-policy none
run slow --het-tp-policy none --het-tp-emulate persistent:rank=2,factor=2.2
run migrate --het-tp-policy migrate --het-tp-emulate persistent:rank=2,factor=2.2
run migrate-groups --het-tp-policy migrate --het-tp-emulate persistent:rank=2,factor=2.2 --het-tp-attn-granularity 0

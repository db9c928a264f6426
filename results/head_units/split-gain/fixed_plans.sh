#!/usr/bin/env bash
# Whole groups against a split group, as fixed plans: the head-units benchmark's model at TP=2
# (one query group of 4 heads per rank), head units, MLP 312 : 1096 neurons a layer in both;
# rank 0 holding no attention (attn=0,8) or one head of group 0 with its K/V (attn=1,7), with
# rank 0 emulated 3.5x slower and unslowed, three interleaved rounds of 20 iterations. The
# policy is resize with an onset no run reaches, so every run is timed and none decides.
# Then: python results/head_units/split-gain/fixed_plans.py OUT
set -euo pipefail
out=${1:-/tmp/split_gain}
cd "$(dirname "$0")/../../.."
mkdir -p "$out"
model=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'scripts'); import bench_head_units as b; print(' '.join(b.model(2, 512)))")
for round in 1 2 3; do
  for factor in 3.5 1.0; do
    for attn in 0,8 1,7; do
      name=f${factor}_attn${attn/,/_}.$round
      emulate=()
      [ "$factor" != 1.0 ] && emulate=(--het-tp-emulate "persistent:rank=0,factor=$factor")
      # shellcheck disable=SC2086  # $model is a flag list
      OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 \
        pretrain_gpt.py $model --tensor-model-parallel-size 2 --global-batch-size 4 \
        --train-iters 20 --log-interval 20 --het-tp-interval 2 --seed 1234 \
        --het-tp-policy resize --het-tp-onset 50 --het-tp-onset-at-once 60 \
        --het-tp-attn-granularity 1 --het-tp-plan "attn=$attn;mlp=312,1096" "${emulate[@]}" \
        --metrics-file "$out/$name.jsonl" > "$out/$name.log" 2>&1
    done
  done
done
echo "runs in $out"

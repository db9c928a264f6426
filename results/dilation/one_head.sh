#!/usr/bin/env bash
# Fixed plans on the dilated TP=4 emulation (stretch before the collective): the head-units benchmark model
# (4 groups of 4 heads, hidden 512), rank 1 slowed by F, with one head on the slowed rank (attn 5/1/5/5)
# against none (6/0/5/5), the MLP split by speed (MLP=...), 4 interleaved rounds of 32 iterations.
#   MLP=423,141,422,422 F=3 bash results/dilation/one_head.sh; MLP=407,185,408,408 F=2.2 bash ...
set -uo pipefail
F=${F:-3}; out=${OUT:-/tmp/one_head}_$F; mkdir -p $out
cd "$(dirname "$0")/../.."
model=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'scripts'); import bench_head_units as b; print(' '.join(b.model(4, 512)))")
run() { name=$1; plan=$2; r=$3
  rm -f $out/$name-$r.jsonl  # pretrain_gpt.py appends to a metrics file
  OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 4 pretrain_gpt.py $model \
    --tensor-model-parallel-size 4 --global-batch-size 4 --train-iters 32 --log-interval 32 \
    --het-tp-interval 4 --seed 1234 --het-tp-attn-granularity 1 --het-tp-emulate-dilation 3 \
    --het-tp-policy static --het-tp-plan "$plan" --het-tp-emulate persistent:rank=1,factor=$F \
    --metrics-file $out/$name-$r.jsonl > $out/$name-$r.log 2>&1 || echo "FAILED $name $r"
  echo "$name $r $(date +%T)"; }
for r in 0 1 2 3; do
  if [ $((r % 2)) = 0 ]; then a=one; b=none; else a=none; b=one; fi
  for n in $a $b; do
    if [ $n = one ]; then run one "attn=5,1,5,5;mlp=${MLP}" $r; else run none "attn=6,0,5,5;mlp=${MLP}" $r; fi
  done
done
# per run, the median step of its second half (ms), pairs of one round side by side
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
for r in range(4):
    row = []
    for name in ("none", "one"):
        steps = [x["elapsed_ms"] for x in map(json.loads, open(f"{sys.argv[1]}/{name}-{r}.jsonl")) if x.get("kind") == "train"]
        row.append(statistics.median(steps[len(steps) // 2 :]))  # iterations 17-32
    print(f"round {r}: none {row[0]:.1f} one {row[1]:.1f} one/none {row[1] / row[0]:.3f}")
PY

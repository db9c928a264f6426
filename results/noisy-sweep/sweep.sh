#!/usr/bin/env bash
# static plans under the noisy neighbour on core 1; prints the median step of iterations 13-24
# usage: results/noisy-sweep/sweep.sh ROUNDS "policy|plan" ... (plan empty for a deciding policy), e.g.
#   results/noisy-sweep/sweep.sh 2 "migrate|" "static|attn=6,2;mlp=1384,664"
set -uo pipefail
cd "$(dirname "$0")/../.."
model="--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --lr 1e-4 --mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
rounds=$1; shift
for round in $(seq 1 $rounds); do
for plan in "$@"; do
  .venv/bin/python scripts/noisy_neighbor.py --cpu 1 --duration 600 > /dev/null 2>&1 &
  nb=$!
  sleep 0.5
  out=/tmp/noisy-sweep-sweep.cur.jsonl
  pol=${plan%%|*}; pl=${plan#*|}; planflag=""; [ -n "$pl" ] && planflag="--het-tp-plan $pl"
  rm -f $out
  pids=""
  for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29612 OMP_NUM_THREADS=1 \
    taskset -c $r .venv/bin/python pretrain_gpt.py $model --tensor-model-parallel-size 2 --global-batch-size 4 \
      --train-iters 24 --log-interval 24 --het-tp-interval 4 --seed 1234 --het-tp-policy $pol $planflag --het-tp-timer wall \
      --metrics-file $out > /tmp/noisy-sweep-sweep.$r.log 2>&1 &
    pids="$pids $!"
  done
  wait $pids
  kill $nb
  .venv/bin/python - "$out" "$plan" <<'PY'
import sys, json, statistics
rs=[json.loads(l) for l in open(sys.argv[1])]
tr=[r for r in rs if r.get("kind")=="train"]
key=[k for k in tr[0] if "time" in k or "step" in k]
ts=[r["elapsed_ms"]/1e3 for r in tr if r["iteration"]>12]
tm=[r for r in rs if r.get("kind")=="timing"]
print(sys.argv[2], "step ms %.1f" % (1e3*statistics.median(ts)), "compute", [round(x,3) for x in tm[-1]["compute_s"]] if tm else None, flush=True)
PY
done; done

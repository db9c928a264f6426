#!/bin/bash
# A/B: head units' measured split. old = 56c3cdf, new = 6840701; one round each, alternating.
cd /tmp
run() { # code case args...
  local code=$1 name=$2; shift 2
  ( cd /tmp/wt-$code && .venv/bin/python scripts/bench_head_units.py "$@" --repeats 1 --out /tmp/abhu/$name-$code-$round > /tmp/abhu/$name-$code-$round.log 2>&1 )
  echo "$(date +%H:%M) $name $code round $round: $(grep -E '^(migrate|hybrid) ' /tmp/abhu/$name-$code-$round/*/summary.txt | tr -s ' ' | tr '\n' ';')"
}
for round in 0 1; do
  if [ $round = 0 ]; then order="old new"; else order="new old"; fi
  for code in $order; do run $code tp4-3x-r1 --tp 4 --factor 3 --rank 1 --iters 24; done
  for code in $order; do run $code tp4-2.5x-r2 --tp 4 --factor 2.5 --rank 2 --iters 24; done
  for code in $order; do run $code tp2-h1024-2.5x-r1 --tp 2 --factor 2.5 --rank 1 --hidden-size 1024 --iters 32; done
done
echo done

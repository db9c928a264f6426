#!/bin/bash
# A/B: the planner before (b68b8d8) and after (measured attention split), alternating, same seeds
for seed in 15019 15252; do
  for side in old new; do
    cd /tmp/wt-$side && .venv/bin/python /tmp/shared/checks/generalize.py --seed $seed > /tmp/ab/$side-$seed.txt 2>&1
    ls -dt /tmp/generalize-* | head -1 > /tmp/ab/$side-$seed.dir
  done
done
echo done > /tmp/ab/DONE

#!/usr/bin/env bash
# A/B: main vs block-level timing regions, h512 GQA (2 groups) TP=2, rank 0 2.7x; alternate trees per round
M="--num-layers 2 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --ffn-hidden-size 1408 --position-embedding-type rope --normalization RMSNorm --disable-bias-linear --seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --lr 1e-4 --mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0"
echo '[{"name": "persistent-2.7x-rank0", "emulate": "persistent:rank=0,factor=2.7,mode=sharded"}]' > /tmp/ab-scen.json
for round in 0 1; do
for tree in main wt; do
  d=/work/main; [ $tree = wt ] && d=/tmp/wt
  cd $d && .venv/bin/python scripts/compare.py --tp 2 --scenarios none,/tmp/ab-scen.json --policies migrate,migrate-heads,hybrid --repeats 1 --iters 32 --out /tmp/ab-$tree-$round -- $M > /tmp/ab-$tree-$round.log 2>&1
  echo "$tree $round done $(date +%T)"
done; done

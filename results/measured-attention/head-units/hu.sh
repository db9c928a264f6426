#!/bin/bash
cd /tmp/wt-new
.venv/bin/python scripts/bench_head_units.py --tp 2 --factor 2.7 --rank 0 --repeats 2 --iters 32 --out /tmp/hu/h512-tp2-2.7x-rank0 > /tmp/hu/h512.log 2>&1
.venv/bin/python scripts/bench_head_units.py --tp 4 --factor 3 --rank 1 --repeats 2 --iters 24 --out /tmp/hu/h512-tp4-3x-rank1 > /tmp/hu/tp4.log 2>&1
.venv/bin/python scripts/bench_head_units.py --tp 2 --factor 2.5 --rank 1 --hidden-size 1024 --repeats 2 --iters 32 --out /tmp/hu/h1024-tp2-2.5x-rank1 > /tmp/hu/h1024.log 2>&1
echo done > /tmp/hu/DONE

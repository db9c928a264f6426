#!/usr/bin/env bash
# The noisy-loop benchmark rows of this folder (run from the repository root, on one code):
#   bash results/band-ends/bench_noisy_loop.sh > results/band-ends/bench_noisy_loop-<commit>.txt
set -euo pipefail
B=".venv/bin/python scripts/bench_noisy_loop.py"
echo "## persistent tp4 rank2"; $B --tp 4 --slow-rank 2 --runs 20 --noise 0.1,0.2 --factors 1.5,2,3
echo "## persistent tp2"; $B --runs 30
echo "## stop tp4 rank1"; $B --tp 4 --slow-rank 1 --stop 23 --runs 20 --policies migrate,hybrid --noise 0.05,0.15
echo "## stop tp2"; $B --stop 23 --runs 20 --policies migrate,hybrid --noise 0.05,0.15

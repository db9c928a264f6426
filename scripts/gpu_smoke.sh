#!/usr/bin/env bash
# GPU smoke test (for a lent GPU; CI never runs it): TP=1 GPT steps in bf16 on CUDA through the
# same pretrain_gpt.py, then the median throughput of the timed iterations.
#
#   bash scripts/gpu_smoke.sh                 # uses python3; installs megatron-core if missing
#   WHEELHOUSE=wheels bash scripts/gpu_smoke.sh   # offline: install from a folder of wheels
#
# Knobs (environment): PYTHON, ITERS (default 30), LAYERS (8), HIDDEN (2048), HEADS (16),
# SEQ (2048), MBS (4), GBS (16), OUT (metrics folder, default logs/gpu_smoke).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ITERS=${ITERS:-30} LAYERS=${LAYERS:-8} HIDDEN=${HIDDEN:-2048} HEADS=${HEADS:-16}
SEQ=${SEQ:-2048} MBS=${MBS:-4} GBS=${GBS:-16} OUT=${OUT:-logs/gpu_smoke}

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_smoke: no CUDA device visible to torch')"
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
  if [ -n "${WHEELHOUSE:-}" ]; then
    "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELHOUSE" megatron-core==0.16.1 psutil
  else
    "$PYTHON" -m pip install --quiet -r requirements-gpu.txt
  fi
fi

mkdir -p "$OUT"
METRICS="$OUT/tp1-bf16.jsonl"
rm -f "$METRICS"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m torch.distributed.run --nproc_per_node 1 \
  pretrain_gpt.py --bf16 --tensor-model-parallel-size 1 \
  --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" --position-embedding-type rope \
  --swiglu --disable-bias-linear --normalization RMSNorm \
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS" \
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 \
  --mock-data --vocab-size 32000 --log-interval 10 --eval-iters 0 --metrics-file "$METRICS"

"$PYTHON" - "$METRICS" <<'PY'
import json, statistics, sys
records = [json.loads(l) for l in open(sys.argv[1])]
run = next(r for r in records if r["kind"] == "run")
train = [r for r in records if r["kind"] == "train"]
timed = train[len(train) // 3:]  # skip warm-up iterations
a = run["args"]
tok = statistics.median(r["tokens_per_s"] for r in timed)
params = run["parameters_rank0"]
# 6 N per token for the weights (fwd + bwd) plus attention scores: 12 L s h per token
flops_per_token = 6 * params + 12 * a["num_layers"] * a["seq_length"] * a["hidden_size"]
print(f"gpu_smoke: TP=1 bf16, {params / 1e6:.0f}M parameters, {len(timed)} timed iterations: "
      f"median {tok:,.0f} tokens/s, ~{tok * flops_per_token / 1e12:.0f} TFLOP/s; "
      f"lm loss {train[0]['lm_loss']:.3f} -> {train[-1]['lm_loss']:.3f}")
PY

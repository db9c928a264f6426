#!/usr/bin/env bash
# GPU smoke test (for a lent GPU; CI never runs it): TP=1 GPT steps in bf16 on CUDA through the
# same pretrain_gpt.py, then the median throughput of the timed iterations. With 2 or more GPUs,
# also het-TP with sequence parallelism and the distributed optimizer (TP=2 x DP=GPUs/2, GPU 1
# shared with scripts/noisy_neighbor.py's kernel loop) against vanilla with the same flags:
# the decisions taken and the largest relative loss gap. Where
# Transformer Engine imports, checks that --transformer-impl transformer_engine --het-tp stops
# at start naming the flag.
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

"$PYTHON" - <<'PY' || exit 1
import subprocess, sys
try:
    import transformer_engine  # noqa: F401
except Exception:
    print("gpu_smoke: Transformer Engine does not import here; TE check skipped")
    sys.exit(0)
proc = subprocess.run(
    [sys.executable, "pretrain_gpt.py", "--het-tp", "--transformer-impl", "transformer_engine",
     "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
     "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
     "--mock-data", "--vocab-size", "255"],
    capture_output=True, text=True)
ok = proc.returncode == 2 and "--transformer-impl transformer_engine" in proc.stderr
print(f"gpu_smoke: --transformer-impl transformer_engine --het-tp "
      f"{'stops naming the flag' if ok else 'DID NOT STOP AS EXPECTED'}: {proc.stderr.strip()[-200:]}")
sys.exit(0 if ok else 1)
PY

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then
  echo "gpu_smoke: $GPUS GPU: het-TP with SP and the distributed optimizer needs 2; skipped"
  exit 0
fi
NPROC=$(( GPUS / 2 * 2 ))
PROD=(--bf16 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer
  --overlap-grad-reduce --num-layers 4 --hidden-size 1024 --num-attention-heads 16
  --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2
  --global-batch-size $(( NPROC / 2 * 4 )) --train-iters 20 --lr 3e-4 --mock-data
  --vocab-size 32000 --log-interval 5 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0)
NEIGHBOR=""
trap '[ -z "$NEIGHBOR" ] || kill "$NEIGHBOR" 2>/dev/null || true' EXIT
for NAME in vanilla het; do
  EXTRA=()
  if [ "$NAME" = het ]; then
    # a real straggler (emulation is CPU-only): a kernel loop shares GPU 1, TP rank 1's
    EXTRA=(--het-tp-policy migrate --het-tp-interval 2)
    "$PYTHON" scripts/noisy_neighbor.py --gpu 1 --duration 900 & NEIGHBOR=$!
  fi
  rm -f "$OUT/prod-$NAME.jsonl"
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m torch.distributed.run \
    --nproc_per_node "$NPROC" pretrain_gpt.py "${PROD[@]}" "${EXTRA[@]}" \
    --metrics-file "$OUT/prod-$NAME.jsonl"
done
[ -z "$NEIGHBOR" ] || { kill "$NEIGHBOR" 2>/dev/null || true; wait "$NEIGHBOR" 2>/dev/null || true; }
NEIGHBOR=""
"$PYTHON" - "$OUT/prod-vanilla.jsonl" "$OUT/prod-het.jsonl" <<'PY'
import json, sys
def losses(path):
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"}
vanilla, het = losses(sys.argv[1]), losses(sys.argv[2])
moves = [r for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "decision"]
gap = max(abs(het[i] - vanilla[i]) / abs(vanilla[i]) for i in vanilla)
print(f"gpu_smoke: het-TP (SP, distributed optimizer, bf16) vs vanilla: {len(moves)} decisions "
      f"({', '.join(str(r['action']) for r in moves)}), largest relative loss gap {gap:.1e}")
PY

#!/usr/bin/env bash
# The simple local launcher: torchrun on this machine, GPUs if torch sees any, else CPU ranks
# (gloo, one thread each). Arguments go to pretrain_gpt.py; NPROC ranks (default: the GPU
# count; on CPU, --tensor-model-parallel-size x --pipeline-model-parallel-size, or 2 where
# both are 1: two data-parallel ranks).
#   bash scripts/run_local.sh --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 128 \
#       --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
#       --micro-batch-size 2 --global-batch-size 2 --train-iters 20 --lr 1e-3 --mock-data \
#       --vocab-size 255 --het-tp-policy hybrid --het-tp-emulate persistent:rank=1,factor=2
#   DRY_RUN=1 bash scripts/run_local.sh ...   # print the command only
# Knobs: PYTHON (default .venv/bin/python if present, else python3), NPROC, MASTER_PORT (29500).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
TP=1 PP=1
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    --tensor-model-parallel-size) TP=${args[$((i + 1))]:-1} ;;
    --tensor-model-parallel-size=*) TP=${args[$i]#*=} ;;
    --pipeline-model-parallel-size) PP=${args[$((i + 1))]:-1} ;;
    --pipeline-model-parallel-size=*) PP=${args[$i]#*=} ;;
  esac
done
for value in "$TP" "$PP"; do  # pretrain_gpt.py names a bad one; the rank count needs a number
  [[ "$value" =~ ^[1-9][0-9]*$ ]] || { TP=1; PP=1; }
done
if [ "$GPUS" -gt 0 ]; then
  DEVICE="$GPUS GPU(s)"; NPROC=${NPROC:-$GPUS}
else
  DEVICE="CPU"; NPROC=${NPROC:-$(( TP * PP > 1 ? TP * PP : 2 ))}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "run_local.sh: NPROC must be a positive integer, got '$NPROC'" >&2; exit 2; }
cmd=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "${MASTER_PORT:-29500}"
     "$ROOT/pretrain_gpt.py" "$@")
echo "run_local.sh: $NPROC ranks on $DEVICE" >&2
if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
cd "$ROOT"
exec "${cmd[@]}"

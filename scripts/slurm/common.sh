# Shared by the sbatch scripts: knobs (environment variables with defaults), the launch helper
# and --dry-run. Source it; do not run it.
#
#   HETTP_DIR   repository root            (default: the directory sbatch was called from)
#   PYTHON      interpreter with hettp     (default: $HETTP_DIR/.venv/bin/python if present, else python3)
#   TP          tensor-parallel size       (default 2)
#   ITERS       training iterations        (default 40)
#   POLICY      --het-tp-policy            (default hybrid)
#   INTERVAL    --het-tp-interval          (default 5)
#   EMULATE     --het-tp-emulate scenario  (default: none; CPU only; vanilla.sbatch: megatron-core's
#               layers slowed alike)
#   MODEL_ARGS  Megatron model/optimizer flags (default: a small GPT on mock data)
#   EXTRA_ARGS  appended to every pretrain_gpt.py command line (default --log-interval 5)
#   OUT         metrics and logs folder    (default $HETTP_DIR/logs/slurm-$SLURM_JOB_ID)
#   SAVE        checkpoint folder: --save and --load (auto-resume), and a save on the SIGTERM
#               that `#SBATCH --signal=TERM@120` sends 2 minutes before the time limit
#               (default: none; het_tp*.sbatch and vanilla.sbatch only)
#   MASTER_PORT rendezvous port            (default: derived from the job id)
HETTP_DIR=${HETTP_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$HETTP_DIR/.venv/bin/python" ]; then PYTHON=$HETTP_DIR/.venv/bin/python; else PYTHON=python3; fi
fi
TP=${TP:-2}
ITERS=${ITERS:-40}
POLICY=${POLICY:-hybrid}
INTERVAL=${INTERVAL:-5}
EMULATE=${EMULATE:-}
MODEL_ARGS=${MODEL_ARGS:---num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --lr 1e-3 --mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0}
EXTRA_ARGS=${EXTRA_ARGS:---log-interval 5}
OUT=${OUT:-$HETTP_DIR/logs/slurm-${SLURM_JOB_ID:-dry}}
SAVE=${SAVE:-}
export HETTP_DIR PYTHON OUT
export PYTHONPATH=$HETTP_DIR${PYTHONPATH:+:$PYTHONPATH}

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "$(basename "$0"): unknown argument '$arg' (only --dry-run)" >&2; exit 2 ;;
  esac
done

hettp_fail() { echo "$(basename "$0"): $*" >&2; exit 2; }
[[ "$TP" =~ ^[1-9][0-9]*$ ]] || hettp_fail "TP must be a positive integer, got '$TP'"
[[ "$ITERS" =~ ^[1-9][0-9]*$ ]] || hettp_fail "ITERS must be a positive integer, got '$ITERS'"
[[ "$INTERVAL" =~ ^[1-9][0-9]*$ ]] || hettp_fail "INTERVAL must be a positive integer, got '$INTERVAL'"

# pretrain_gpt.py's flags for one run: hettp_args POLICY METRICS_FILE [EMULATE]
hettp_args() {
  local policy=$1 metrics=$2 emulate=${3:-}
  # shellcheck disable=SC2206  # MODEL_ARGS and EXTRA_ARGS are word lists on purpose
  ARGS=($MODEL_ARGS --tensor-model-parallel-size "$TP" --train-iters "$ITERS"
        --metrics-file "$metrics" $EXTRA_ARGS)
  if [ "$policy" != vanilla ]; then
    ARGS+=(--het-tp-policy "$policy" --het-tp-interval "$INTERVAL")
    [ -n "$emulate" ] && ARGS+=(--het-tp-emulate "$emulate")
  elif [ -n "$emulate" ]; then  # vanilla's layers, slowed alike (as scripts/compare.py runs it)
    ARGS+=(--het-tp-policy static --het-tp-emulate "$emulate")
  fi
  return 0
}

# A job that may be stopped by its time limit: checkpoints in $SAVE (resumed from by the next
# job), and a clean save-and-exit on the SIGTERM Slurm sends ahead of the limit.
hettp_checkpoint_args() {
  ARGS+=(--exit-signal-handler)
  [ -n "$SAVE" ] && ARGS+=(--save "$SAVE" --load "$SAVE")
  return 0
}

# One task per GPU: srun starts them; each derives RANK etc. from Slurm (hettp.launch_env).
hettp_srun() {
  local cmd=(srun --kill-on-bad-exit=1 bash "$HETTP_DIR/scripts/slurm/task.sh" "${ARGS[@]}")
  if [ "$DRY_RUN" = 1 ]; then
    echo "+ $(printf '%q ' "${cmd[@]}")"
    if [ -z "${SLURM_JOB_ID:-}" ]; then  # outside an allocation: nothing to derive it from
      echo "# task environment: each task derives it from Slurm's variables (hettp.launch_env)"
      return 0
    fi
    echo "# task environment (SLURM_PROCID=${SLURM_PROCID:-0}):"
    "$PYTHON" -m hettp.launch_env | sed 's/^/#   /'
    return 0
  fi
  mkdir -p "$OUT"
  "${cmd[@]}"
}

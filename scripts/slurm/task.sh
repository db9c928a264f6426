#!/usr/bin/env bash
# One Slurm task = one rank: torch.distributed's variables from Slurm's, then pretrain_gpt.py.
set -euo pipefail
eval "$("$PYTHON" -m hettp.launch_env)"
echo "task $RANK of $WORLD_SIZE on $(hostname) (local rank $LOCAL_RANK), rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" "$HETTP_DIR/pretrain_gpt.py" "$@"

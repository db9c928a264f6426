#!/usr/bin/env python
"""GPT pretraining on megatron-core, with Megatron-LM's flags.

    torchrun --nproc_per_node 2 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 1e-3 \
        --mock-data --vocab-size 255

Flags are validated before anything is built; a bad one exits with status 2 and a message that
names it.
"""

import os
import sys
import warnings

# Megatron-LM's launch scripts set this so TP communication is ordered before compute on GPU.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

# megatron-core announces every missing optional GPU extra (apex, Transformer Engine) at import.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")

from megatron.hetero.arguments import parse_args  # noqa: E402


def main(argv=None):
    args = parse_args(argv)
    from hettp.memory import OverCapError
    from megatron.hetero.checkpointing import CheckpointError
    from megatron.hetero.ckpt_integrity import UnsafeCheckpointError
    from megatron.hetero.save_lock import SaveLockError
    from megatron.hetero.stopping import NonFiniteError
    from megatron.hetero.training import pretrain, shutdown

    stops = (NonFiniteError, SaveLockError, CheckpointError, UnsafeCheckpointError, OverCapError)
    try:
        pretrain(args)
    except stops as err:  # every rank stops alike: one line
        if int(os.environ.get("RANK", "0")) == 0:
            sys.stderr.write(f"pretrain_gpt.py: error: {err}\n")
        sys.exit(2 if isinstance(err, (SaveLockError, OverCapError)) else 1)
    finally:
        shutdown()


if __name__ == "__main__":
    main()

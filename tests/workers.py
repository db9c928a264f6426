"""Functions that run inside spawned ranks (tests/distributed.py imports them by name)."""

from __future__ import annotations

import contextlib
import io


def train(argv: list[str]) -> dict:
    """pretrain_gpt.py's main on this rank; returns its losses and what it printed."""
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.training import pretrain, shutdown

    args = parse_args(argv)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = pretrain(args)
    finally:
        shutdown()
    return {"losses": result.losses, "eval_losses": result.eval_losses,
            "iteration": result.iteration, "stdout": out.getvalue(),
            "metrics_file": result.metrics_file}

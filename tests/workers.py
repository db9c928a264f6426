"""Functions that run inside spawned ranks (tests/distributed.py imports them by name)."""

from __future__ import annotations

import contextlib
import io
import os


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


def compat_paths(tmp_dir: str) -> dict:
    """Runs each upstream path a CPU shim covers; returns what each produced."""
    import torch
    import torch.distributed as dist

    from megatron.hetero import cpu_compat
    from megatron.hetero.arguments import parse_args

    report = {"activated": cpu_compat.activate()}
    args = parse_args(("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                       "--micro-batch-size 2 --train-iters 1 --lr 1e-2 --mock-data "
                       "--vocab-size 63 --clip-grad 1e-3").split())
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.utils import GlobalMemoryBuffer

    from megatron.hetero.data import build_datasets, build_loader, build_tokenizer
    from megatron.hetero.training import initialize, setup_model_and_optimizer, shutdown, train_step

    try:
        initialize(args)
        # current_device: megatron's global memory buffer allocates on current_device()
        probe = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")
        report["current_device"] = probe.device.type
        # rng_tracker: the model-parallel dropout fork keeps its own CPU generator state
        tracker = tensor_parallel.get_cuda_rng_tracker()
        with tracker.fork():
            first = torch.rand(4)
        with tracker.fork():
            second = torch.rand(4)
        report["rng_tracker"] = (type(tracker).__name__, not torch.equal(first, second))
        # cuda_literals + clip_grads: a step through the schedule and FP32Optimizer with clipping
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
        model, optimizer, scheduler = setup_model_and_optimizer(args, tokenizer.vocab_size)
        train_ds, _, _ = build_datasets(args, tokenizer)
        loss, grad_norm, skipped = train_step(args, model, optimizer, scheduler,
                                              iter(build_loader(train_ds, 0, args, 0, 1)))
        clipped = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                                 if p.grad is not None)).item()
        report["step"] = (loss, float(grad_norm), skipped, clipped)
        # synchronize: dist_checkpointing's writer, then a load that restores the weights
        state = model.module.sharded_state_dict()
        dist_checkpointing.save(state, tmp_dir)
        before = {k: v.detach().clone() for k, v in model.module.state_dict().items()
                  if isinstance(v, torch.Tensor)}
        for p in model.parameters():
            p.data.add_(1.0)
        loaded = dist_checkpointing.load(model.module.sharded_state_dict(), tmp_dir)
        model.module.load_state_dict(loaded)
        report["checkpoint_roundtrip"] = all(
            torch.equal(before[k], v) for k, v in model.module.state_dict().items() if k in before)
        report["world"] = dist.get_world_size()
    finally:
        shutdown()
    return report


def train_with_failing_save(argv: list[str], fail_at_iteration: int) -> dict:
    """pretrain with dist_checkpointing.save breaking half-way through one save."""
    from megatron.hetero import checkpointing

    real_save = checkpointing.dist_checkpointing.save

    def flaky_save(state, directory, *a, **kw):
        if state["iteration"] == fail_at_iteration:
            open(os.path.join(directory, "partial.distcp"), "w").write("half a checkpoint")
            raise OSError("disk full (injected)")
        return real_save(state, directory, *a, **kw)

    checkpointing.dist_checkpointing.save = flaky_save
    try:
        train(argv)
    except OSError as err:
        return {"error": str(err)}
    return {"error": None}

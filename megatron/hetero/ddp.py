"""megatron-core's DDP wrapper for het-TP models under the distributed optimizer.

megatron-core reduce-scatters gradients over the data-parallel group, so each DP rank's part of
a gradient buffer is reduced and the rest holds that rank's own gradient; then it all-reduces the
gradients of parameters replicated over the TP group (sequence-parallel norms, row-parallel
biases, --qk-layernorm's norms) over the TP group, whole. Under an even split every TP rank's
buffer has the same layout and owns the same part of such a parameter, so the owned parts add
up right. Under an uneven plan the buffers differ between TP ranks, the owned parts differ, and
the TP sum would add one rank's reduced part to another's unreduced one. `HetDDP` completes
those parameters' DP reduction (one all-reduce of their masked gradients) before the TP
all-reduce runs.

With --het-dp-compress, `HetDDP` reduces the gradient buffers itself, compressed with error
feedback (hettp/compress.py), instead of megatron-core's all-reduce: the same pre-scaling by
each bucket's gradient_scaling_factor, then a compressed sum over the bucket group's
data-parallel group (an average where megatron-core averages in the collective).

`gathered_params` is the step boundary's view of the weights under --overlap-param-gather.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel

from hettp.compress import ErrorFeedbackReducer


class HetDDP(DistributedDataParallel):
    def __init__(self, *args, compress: str = "none", **kwargs):
        super().__init__(*args, **kwargs)
        self.reducer = ErrorFeedbackReducer(compress) if compress != "none" else None

    def rebuild_kwargs(self) -> dict:
        """What a new wrapper around the same module (its parameters re-shaped by a migration
        or a layer move) takes besides the configs to reduce as this one does. The compression
        residues start over: they belong to the old buffers' layout."""
        return {"compress": self.reducer.kind if self.reducer is not None else "none"}

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        if self.reducer is not None:
            self._compressed_grad_sync()
            return
        super().finish_grad_sync(force_all_reduce=force_all_reduce)
        if self.ddp_config.use_distributed_optimizer and not force_all_reduce:
            for bucket_group in self.bucket_groups:
                _complete_replicated(bucket_group, self.config.sequence_parallel)

    def _compressed_grad_sync(self) -> None:
        """megatron-core's synchronous all-reduce path (no distributed optimizer, no overlap:
        the arguments refuse both), with the reduction compressed. Its NaN and large-gradient
        checks are off in this trainer's DDP config (ddp_config: check_for_nan_in_grad is not
        set), so skipping them changes nothing; a config that sets them is refused."""
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            raise RuntimeError("--het-dp-compress does not run megatron-core's gradient checks")
        groups = self.bucket_groups + self.expert_parallel_bucket_groups
        for g, bucket_group in enumerate(groups):
            dp = bucket_group.data_parallel_group
            size = dist.get_world_size(dp)
            for b, bucket in enumerate(bucket_group.buckets):
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
                if size > 1:
                    self.reducer.all_reduce_sum((g, b), bucket.grad_data, dp)
                    if self.ddp_config.average_in_collective:
                        bucket.grad_data /= size


def _replicated(param, sequence_parallel: bool) -> bool:
    """Whether `param`'s gradient is summed over TP ranks after the DP reduction: by
    megatron-core (replicated over the TP group: marked, or --qk-layernorm's weights, which it
    finds by name and het-TP's attention marks `het_tp_summed`) or by the runtime (a K/V
    replica of head units held by several ranks, `het_replicated`)."""
    return (
        getattr(param, "average_gradients_across_tp_domain", False)
        or getattr(param, "het_replicated", False)
        or getattr(param, "het_tp_summed", False)
        or (sequence_parallel and getattr(param, "sequence_parallel", False))
    )


def _complete_replicated(bucket_group, sequence_parallel: bool) -> None:
    size = bucket_group.intra_distributed_optimizer_instance_size
    if size == 1:
        return
    rank = bucket_group.intra_distributed_optimizer_instance_rank
    grads, owned = [], []
    for bucket in bucket_group.buckets:
        shard = bucket.grad_data.numel() // size
        base = bucket.grad_data.storage_offset()
        for param in bucket.params_list:
            if not _replicated(param, sequence_parallel):
                continue
            grad = param.main_grad.view(-1)
            start = grad.storage_offset() - base
            index = torch.arange(start, start + grad.numel(), device=grad.device)
            grads.append(grad)
            owned.append((index >= rank * shard) & (index < (rank + 1) * shard))
    if not grads:
        return
    # each element is owned (reduced) on exactly one DP rank: the sum of the owned values is
    # the reduced gradient, now on every rank
    flat = torch.cat([g * m for g, m in zip(grads, owned)])
    dist.all_reduce(flat, group=bucket_group.intra_distributed_optimizer_instance_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()])
        offset += grad.numel()


@contextmanager
def gathered_params(state):
    """Whole, current weights on every DP rank inside the block. Under --overlap-param-gather
    an optimizer step updates only each DP rank's own range of the weights, and the next
    forward's pre-hooks gather the rest; whatever reads or moves weights between the two
    (evaluation, checkpoints, migration, resizing) first forces the gather and lifts the hooks,
    as Megatron-LM does around evaluation and checkpoints. The hooks come back on exit unless
    the block replaced `state.model` (a migration's new wrapper brings its own). Reentrant."""
    model = state.model
    hooked = bool(getattr(model, "remove_forward_pre_hook_handles", None))
    if hooked:
        model.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        if hooked and state.model is model:
            model.enable_forward_pre_hook()

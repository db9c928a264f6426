"""Resizing on a megatron-core model built with the het spec: a rank computes only its top units.

`Resizer` owns the resize state of one TP group: the per-rank shares (every rank knows all of
them), the unit priorities (identical on every rank), and on this rank the bookkeeping that keeps
skipped units frozen. Resized ranks keep their local units in priority order, so the skipped
units are a suffix of the shard; the layers compute the prefix with views (layers.py).

Skipped units get no gradient (they are not in the forward); the optimizer still visits their
elements, so the resizer puts back their weights, fp32 masters and Adam moments after every
step from a copy taken when the resize began: they resume where they stopped. Adam's step
count (per tensor, or per group in a fused Adam) goes on while they are skipped, and its bias
correction with it, so before a resumed unit's first step its moments are rescaled to read as
they did when frozen (or, for a unit skipped before any update, after that update to read as a
fresh Adam's): hettp.resize.FrozenSince keeps when each was frozen. Evaluation computes every
unit (layers.UnitBlock.train).

The paper's baseline (`--het-tp-policy zero`) instead fills skipped gradients with a tiny constant
and lets the optimizer update them, as its public code does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hettp.resize import (
    SCORERS,
    FrozenSince,
    Priorities,
    check_shares,
    first_moment_factor,
    realized_share,
    resumed_moment_factor,
    skipped_count,
    skipped_units,
    swapped_units,
)
from hettp.units import UnitLayout

from . import cpu_compat
from .ddp import gathered_params
from .partition import comm_device, het_blocks
from .unit_state import OptimizerView, adam_betas, state_keys, step_count


class Resizer:
    """Resize shares, priorities and frozen skipped units of one TP group (on every rank)."""

    def __init__(
        self,
        partition,
        model,
        scorer: str = "dw",
        interval: int = 50,
        cap: float = 0.5,
        impute: float | None = None,
        sample: int = 1,
    ):
        if scorer not in SCORERS:
            raise ValueError(f"unknown priority scorer '{scorer}'; choose from {sorted(SCORERS)}")
        if interval < 1:
            raise ValueError(f"priority refresh interval must be >= 1, got {interval}")
        if not 1 <= sample <= interval:
            raise ValueError(
                f"priority sample interval must be within [1, {interval}], got {sample}"
            )
        self.partition = partition
        self.unit_work = partition.unit_work
        self.scorer, self.interval, self.cap, self.impute = scorer, interval, cap, impute
        # Per-step scorers observe iterations divisible by `sample`: keyed on the iteration,
        # so a resumed run observes the same steps as a straight one.
        self.sample = sample
        self._scores_steps = SCORERS[scorer].per_step
        self._observing = self._scores_steps
        self.shares = (0.0,) * partition.plan.tp_size
        self.priorities = Priorities.unmeasured(partition.plan)
        self._evidence = None  # (layer, block) -> (score sums, measured steps), global unit ids
        self._partial = False  # the evidence is this DP rank's range only (see _Owned)
        self._whole = False  # the evidence came whole from a checkpoint
        self._stash = []  # _Frozen: the skipped suffix's weights, masters, moments
        self._stashed_state = True  # False until the optimizer has created its moments
        self._frozen = FrozenSince()  # when each skipped unit (idle K/V group) was frozen
        self._first = {}  # key -> units that resumed with no update yet, and the count before
        self._before = None  # weights before the step (the dw scorer)

    @property
    def rank(self) -> int:
        return self.partition.rank

    @property
    def resized_ranks(self) -> list[int]:
        return [r for r, share in enumerate(self.shares) if share > 0]

    # ---- decisions (every rank, same step boundary) --------------------------------------

    def resize(self, state, shares) -> None:
        """Make rank r skip `shares[r]` of its units from the next step on (0: none).

        Checked against the cap before anything changes. Local work only: resized ranks sort
        their units by priority (in place) and slice; restoring is just a share of 0.
        """
        shares = tuple(float(s) for s in shares)
        if len(shares) != len(self.shares):
            raise ValueError(f"resize: {len(shares)} shares for a TP group of {len(self.shares)}")
        check_shares(shares, self.cap)
        self.shares = shares
        plan = self.priorities.ordered_plan(self.partition.plan, self.resized_ranks)
        self.partition.reorder(state, plan)
        self._activate(state)

    def repartition(self, state, plan, step=None, fault=None):
        """Migrate to `plan` keeping resized ranks in priority order; resizes carry over.
        Returns the Migration."""
        self.refresh(state)  # scores of units about to move must not be lost
        plan = self.priorities.ordered_plan(plan, self.resized_ranks)
        migration = self.partition.repartition(state, plan, step=step, fault=fault)
        self._activate(state)
        return migration

    def refresh(self, state) -> int:
        """Fold the evidence since the last refresh into the priorities (one all-reduce over
        the TP group), re-sort resized ranks, and return how many skipped units the re-sort
        brought back, over the whole group."""
        blocks = het_blocks(state.model)
        evidence = self._collect(blocks)
        scorer = SCORERS[self.scorer]
        owned = self._owned(state)
        if not scorer.per_step:  # known for every unit, skipped ones included
            for key, block in blocks.items():
                sums, steps = evidence[key]
                _add(
                    sums,
                    steps,
                    block.units,
                    _unit_scores(
                        block, lambda p: owned(p, scorer.evidence(p.detach(), _grad(p), None))
                    ),
                )
        keys = list(evidence)
        flat = torch.cat([t for key in keys for t in evidence[key]])
        dist.all_reduce(flat, group=self.partition.group)
        if owned.sharded:
            # each DP rank scored the elements it updates (see _owned): their sum over the
            # replicas is the whole evidence, the same on every replica
            dp = parallel_state.get_data_parallel_group()
            dist.all_reduce(flat, group=dp)
            offset = 0
            for key in keys:  # step counts are the same on every replica: not summed
                n = evidence[key][0].numel()
                flat[offset + n : offset + 2 * n] /= dist.get_world_size(dp)
                offset += 2 * n
        measured, offset = {}, 0
        for key in keys:
            n = evidence[key][0].numel()
            sums, steps = flat[offset : offset + n], flat[offset + n : offset + 2 * n]
            offset += 2 * n
            seen = torch.nonzero(steps > 0).flatten().tolist()
            measured[key] = dict(zip(seen, (sums[seen] / steps[seen]).tolist()))
        self.priorities = self.priorities.updated(measured)
        self._evidence = None
        self._whole = False
        old = self.partition.plan
        plan = self.priorities.ordered_plan(old, self.resized_ranks)
        if plan != old:
            self.partition.reorder(state, plan)
            self._activate(state)
        return swapped_units(old, plan, self.shares)

    def realized_shares(self) -> list[float]:
        """Per rank, the share of its unit parameters (~ its sharded GEMM work) skipped."""
        return [
            realized_share(self.partition.plan, self.shares, rank, self.unit_work)
            for rank in range(len(self.shares))
        ]

    def state_dict(self) -> dict:
        """What a checkpoint keeps (per TP rank): priorities and the evidence gathered since the
        last refresh, so a resumed run re-sorts exactly as the original would have."""
        evidence = None
        if self._evidence is not None:
            evidence = {}
            for (i, b), (sums, steps) in self._evidence.items():
                if self._partial:  # the whole evidence is the replicas' sum (collective)
                    sums = sums.clone()
                    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
                evidence[f"{i}.{b}"] = (sums.cpu(), steps.cpu())
        return {
            "scorer": self.scorer,
            "scores": {f"{i}.{b}": list(v) for (i, b), v in self.priorities.scores.items()},
            "evidence": evidence,
            "frozen": self._frozen.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take saved priorities (only those of the same scorer; else start unmeasured) and
        when the skipped units were frozen (a checkpoint saved before that record existed has
        none: the units this run skips count as frozen at the step it loaded)."""
        if state.get("frozen") is not None:
            self._frozen = FrozenSince.from_state_dict(state["frozen"])
        if state["scorer"] != self.scorer:
            return

        def key(text):
            layer, block = text.split(".")
            return int(layer), block

        scores = {key(k): list(v) for k, v in state["scores"].items()}
        if set(scores) != set(self.priorities.scores):
            raise ValueError("saved het-TP priorities are for another model")
        self.priorities = Priorities(scores)
        self._evidence = None
        if state["evidence"] is not None:
            device = comm_device()
            self._evidence = {
                key(k): (sums.to(device), steps.to(device))
                for k, (sums, steps) in state["evidence"].items()
            }
            self._whole = True

    # ---- every step ---------------------------------------------------------------------

    def begin_step(self, iteration: int) -> None:
        """Before the step that will be `iteration`: whether the scorer observes it."""
        self._observing = self._scores_steps and iteration % self.sample == 0

    def before_step(self, state) -> None:
        """After backward, before optimizer.step(): rescale the moments of units that resumed,
        impute or score gradients, keep weights."""
        blocks = het_blocks(state.model)
        resuming = self._frozen.take_resuming()
        if resuming:
            self._resume(state, blocks, resuming)
        if self.impute is not None:
            resized = any(b.active < len(b.units) for b in blocks.values())
            idle = self._idle_groups(blocks) if resized else {}
            with torch.no_grad():
                for (index, _), block in blocks.items():
                    n, active = len(block.units), block.active
                    if active < n:
                        for _, _, param, layout in block.unit_tensors():
                            for view in layout.suffix(_grad(param), n, active):
                                view.fill_(self.impute)
                        # Every holder fills the same constant: the replicas stay equal.
                        for param in _replicas_of(block, idle.get(index, ())):
                            _grad(param).fill_(self.impute)
        if self._observing and SCORERS[self.scorer].needs_delta:
            self._before = {
                p: p.detach().clone() for b in blocks.values() for _, _, p, _ in b.unit_tensors()
            }

    def after_step(self, state) -> None:
        """After optimizer.step(): put skipped units back, score the update."""
        with torch.no_grad():
            for frozen in self._stash:
                frozen.restore()
        if self._first:
            self._first_updates(state)
        if not self._stashed_state and self._stash_state(state):
            self._stashed_state = True
        scorer = SCORERS[self.scorer]
        if self._observing:
            before, self._before = self._before, None
            owned = self._owned(state)
            self._observe(
                het_blocks(state.model),
                lambda p: owned(p, scorer.evidence(p.detach(), _grad(p), _change(p, before))),
            )

    def step_end(self, iteration: int, state) -> int | None:
        """At the step boundary: refresh priorities every `interval` iterations."""
        if iteration % self.interval == 0:
            return self.refresh(state)
        return None

    # ---- internals ----------------------------------------------------------------------

    def _activate(self, state) -> None:
        """Set each block's active prefix from the shares and freeze the skipped suffix."""
        share = self.shares[self.rank]
        self._stash = []
        with gathered_params(state):  # the frozen copies are of the current weights
            for block in het_blocks(state.model).values():
                n = len(block.units)
                block.set_active(n - skipped_count(n, share))
            self._stashed_state = self.impute is not None or self._stash_state(state, weights=True)
        if self.impute is None:
            count = step_count(OptimizerView(state.optimizer))
            self._frozen.update(self._skipped(het_blocks(state.model)), count)

    def _skipped(self, blocks) -> dict:
        """Key -> what is frozen now over the whole TP group (the same on every rank): each
        block's skipped units, each layer's idle K/V groups (head units)."""
        out = {}
        for (index, name, _), units in skipped_units(self.partition.plan, self.shares).items():
            out.setdefault(_key(index, name), set()).update(units)
        for index, groups in self._idle_groups(blocks).items():
            if groups:
                out[_key(index, KV)] = groups
        return out

    def _resume(self, state, blocks, resuming) -> None:
        """Before the first step of units that resumed: moments frozen after step t are
        rescaled to read at the optimizer's count as they did at t (Adam's count went on while
        they were skipped); those frozen before any update wait for their first (see
        _first_updates)."""
        optimizer = OptimizerView(state.optimizer)
        count = step_count(optimizer)
        later, first = {}, {}
        for key, ids in resuming.items():
            for unit, frozen_at in ids.items():
                # a count past the optimizer's: it restarted (loaded without its state), and
                # the unit's moments with it
                (later if 0 < frozen_at <= count else first).setdefault(key, {})[unit] = frozen_at
        if later:
            self._scale(
                optimizer,
                blocks,
                later,
                lambda beta, frozen_at: resumed_moment_factor(beta, frozen_at, count),
            )
        if first:
            self._first = {"units": first, "count": count}

    def _first_updates(self, state) -> None:
        """After the first step of units that resumed without an update before it (zero
        moments): their moments, (1 - beta) of the step's gradient, are rescaled to a fresh
        Adam's after one step. A step the optimizer skipped (an fp16 overflow) leaves them
        waiting for the next."""
        optimizer = OptimizerView(state.optimizer)
        count = step_count(optimizer)
        waiting, self._first = self._first, {}
        if count == waiting["count"]:
            self._frozen.resuming = _merged(self._frozen.resuming, waiting["units"])
            return
        blocks = het_blocks(state.model)
        self._scale(
            optimizer, blocks, waiting["units"], lambda beta, _: first_moment_factor(beta, count)
        )

    def _scale(self, optimizer, blocks, units, factor) -> None:
        """Multiply the Adam moments of `units` (key -> {id: count frozen at}) by
        factor(beta, count frozen at), on the ranks that hold them (K/V replicas on each
        holder, alike); nothing for an optimizer without betas."""
        betas = adam_betas(optimizer)
        keys = [k for k in state_keys(optimizer, blocks) if k in betas]
        with torch.no_grad():
            for (index, name), block in blocks.items():
                ids = units.get(_key(index, name), {})
                n = len(block.units)
                if ids and n:
                    for key in keys:
                        values = [
                            factor(betas[key], ids[u]) if u in ids else 1.0 for u in block.units
                        ]
                        for _, _, param, layout in block.unit_tensors():
                            per_unit = torch.tensor(values, device=param.device)
                            full = layout.per_unit(per_unit, param.shape, n)
                            _scale_state(optimizer, param, key, full)
                groups = units.get(_key(index, KV), {})
                if groups and block.heads is not None:
                    for _, held, _ in block.replica_tensors():
                        for group, param in held.items():
                            if group in groups:
                                for key in keys:
                                    value = factor(betas[key], groups[group])
                                    _scale_state(optimizer, param, key, value)

    def _stash_state(self, state, weights=False) -> bool:
        """Freeze the skipped suffix of weights (and masters, moments once they exist).
        Returns whether the optimizer's moments were there to be frozen."""
        if self.impute is not None:
            return True
        optimizer = OptimizerView(state.optimizer)
        blocks = het_blocks(state.model)
        keys = state_keys(optimizer, blocks)
        has_moments = any(k != "master" for k in keys)
        wanted = [k for k in keys if k != "master" or weights]
        idle = self._idle_groups(blocks)
        with torch.no_grad():
            for (index, _), block in blocks.items():
                n, active = len(block.units), block.active
                if active == n:
                    continue
                for _, _, param, layout in block.unit_tensors():
                    if weights:
                        self._stash.extend(_Frozen(v) for v in layout.suffix(param.data, n, active))
                    for key in wanted:
                        self._stash.extend(_frozen_state(optimizer, param, key, layout, n, active))
                for param in _replicas_of(block, idle.get(index, ())):
                    whole = UnitLayout(0, param.shape[0])
                    if weights:
                        self._stash.append(_Frozen(param.data))
                    for key in wanted:
                        self._stash.extend(_frozen_state(optimizer, param, key, whole, 1, 0))
        return has_moments

    def _idle_groups(self, blocks) -> dict:
        """{layer: groups none of whose heads any rank computes} (head units): their K/V
        replicas get no gradient anywhere and are frozen (or imputed) like skipped units."""
        plan, out = self.partition.plan, {}
        skipped = skipped_units(plan, self.shares)
        for (index, name), block in blocks.items():
            heads = block.heads
            if heads is None:
                continue
            off = set().union(*(skipped[(index, name, r)] for r in range(plan.tp_size)))
            live = {heads.group_of(u) for u in range(heads.units) if u not in off}
            out[index] = set(range(heads.groups)) - live
        return out

    def _owned(self, state) -> _Owned:
        """Which elements this DP rank scores. Whole evidence from a checkpoint becomes DP rank
        0's share when the replicas score their own ranges."""
        owned = _Owned(OptimizerView(state.optimizer))
        self._partial = owned.sharded
        if self._whole and owned.sharded and self._evidence is not None:
            if parallel_state.get_data_parallel_rank() != 0:
                for sums, _ in self._evidence.values():
                    sums.zero_()
        self._whole = False
        return owned

    def _observe(self, blocks, evidence) -> None:
        """Add one step of per-unit evidence for the units that ran."""
        with torch.no_grad():
            self._collect(blocks)
            for key, block in blocks.items():
                updated = block.units if self.impute is not None else block.units[: block.active]
                if updated:
                    sums, steps = self._evidence[key]
                    _add(sums, steps, updated, _unit_scores(block, evidence)[: len(updated)])

    def _collect(self, blocks):
        if self._evidence is None:
            device = comm_device()
            self._evidence = {
                key: (
                    torch.zeros(b.num_units, dtype=torch.float64, device=device),
                    torch.zeros(b.num_units, dtype=torch.float64, device=device),
                )
                for key, b in blocks.items()
            }
        return self._evidence


KV = "kv"  # the key of a layer's K/V replica groups, beside its blocks'


def _key(index: int, name: str) -> str:
    return f"{index}.{name}"


def _merged(a: dict, b: dict) -> dict:
    out = {key: dict(ids) for key, ids in a.items()}
    for key, ids in b.items():
        out.setdefault(key, {}).update(ids)
    return out


def _scale_state(optimizer, param, key, factor) -> None:
    """Multiply `param`'s optimizer state `key` by `factor` (a number, or a tensor shaped like
    the parameter), in this DP rank's range of it under the distributed optimizer."""
    shard = optimizer.shard_of(param, key)
    if shard is None:  # the whole tensor is here
        tensor = optimizer.state[param].get(key)
        if tensor is not None:
            tensor.mul_(factor.to(tensor.device) if isinstance(factor, torch.Tensor) else factor)
        return
    tensor, start = shard
    if tensor is None:  # this DP rank holds none of it
        return
    if isinstance(factor, torch.Tensor):
        factor = factor.reshape(-1)[start : start + tensor.numel()].to(tensor.device)
    tensor.mul_(factor)


def _replicas_of(block, groups) -> list:
    """A head-unit block's K/V replicas of `groups` (none with group units)."""
    if block.heads is None:
        return []
    return [p for _, held, _ in block.replica_tensors() for g, p in held.items() if g in groups]


class _Frozen:
    """Elements of a tensor to put back after every optimizer step: a view of them, or (under
    the distributed optimizer) flat indices into this DP rank's range."""

    def __init__(self, tensor, index=None):
        self.tensor, self.index = tensor, index
        self.copy = (tensor if index is None else tensor[index]).clone()

    def restore(self) -> None:
        if self.index is None:
            self.tensor.copy_(self.copy)
        else:
            self.tensor.index_copy_(0, self.index, self.copy)


def _frozen_state(optimizer, param, key, layout, n, active) -> list[_Frozen]:
    """The skipped suffix of `param`'s master or moment `key`."""
    shard = optimizer.shard_of(param, key)
    if shard is None:  # the whole tensor is here
        tensor = optimizer.master(param) if key == "master" else optimizer.state[param][key]
        return [_Frozen(v) for v in layout.suffix(tensor, n, active)]
    tensor, start = shard
    if tensor is None:  # this DP rank holds none of it
        return []
    flat = torch.arange(param.numel(), device=tensor.device).view(param.shape)
    skipped = torch.cat([v.reshape(-1) for v in layout.suffix(flat, n, active)])
    local = skipped[(skipped >= start) & (skipped < start + tensor.numel())] - start
    return [_Frozen(tensor, local)] if local.numel() else []


class _Owned:
    """Under the distributed optimizer a DP rank reduces a gradient, and updates a weight, only
    in its own range of the flattened parameter (outside it the gradient is its own micro-
    batches' and, under --overlap-param-gather, the weight a step old). Evidence is kept there
    only, and summed over the replicas at a refresh: exactly the evidence of the plain
    optimizer, and the same on every replica (which must skip the same units)."""

    def __init__(self, view):
        self.view = view
        self.sharded = bool(view.sharded)

    def __call__(self, param, evidence):
        if not self.sharded:
            return evidence
        shard = self.view.shard_of(param, "master")
        if shard is None:
            return evidence
        tensor, start = shard
        flat = torch.zeros_like(evidence).view(-1)
        if tensor is not None:
            end = start + tensor.numel()
            flat[start:end] = evidence.reshape(-1)[start:end]
        return flat.view(evidence.shape)


def _change(param, before):
    """The step's change of `param`, written over its copy from before the step (a scratch
    tensor the scorer may overwrite: a shard-sized allocation fewer per observed step)."""
    if before is None:
        return None
    copy = before.pop(param)
    return torch.sub(param.detach(), copy, out=copy)


def _grad(param):
    """The gradient the optimizer will read: DDP's main_grad (or .grad without DDP)."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _unit_scores(block, evidence) -> torch.Tensor:
    """Per local unit, the sum of `evidence(param)` over all of the block's unit tensors."""
    n = len(block.units)
    with cpu_compat.suspended():
        return sum(
            layout.unit_sums(evidence(param), n) for _, _, param, layout in block.unit_tensors()
        )


def _add(sums, steps, units, scores) -> None:
    index = torch.tensor(list(units), dtype=torch.long, device=sums.device)
    sums.index_add_(0, index, scores.to(sums.device, torch.float64))
    steps.index_add_(0, index, torch.ones(len(units), dtype=torch.float64, device=sums.device))

"""Functions that run inside spawned ranks (tests/utils/ranks.py imports them by name)."""

from __future__ import annotations

import contextlib
import io
import os


def _pretrain(argv: list[str], hook=None):
    """pretrain_gpt.py's main on this rank, printing into a buffer: (TrainResult, output)."""
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.training import pretrain, shutdown

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            args = parse_args(argv)  # it prints, with --use-checkpoint-args
            result = pretrain(args, on_step_end=hook)
    finally:
        shutdown()
    return result, out.getvalue()


def train(argv: list[str]) -> dict:
    """pretrain_gpt.py's main on this rank; returns its losses and what it printed."""
    result, stdout = _pretrain(argv)
    return {
        "losses": result.losses,
        "eval_losses": result.eval_losses,
        "test_loss": result.test_loss,
        "iteration": result.iteration,
        "stdout": stdout,
        "metrics_file": result.metrics_file,
    }


def train_with_a_recording_wandb(argv: list[str], refuse: bool = False) -> dict:
    """`train`, with a stand-in `wandb` module (its init, log and finish, as the package's
    documented API takes them) that records its calls into the result's "wandb"; `refuse`:
    its init raises, as without an API key."""
    import importlib.machinery
    import sys
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(**kwargs):
        if refuse:
            raise PermissionError("no API key (stand-in)")
        calls.append(("init", kwargs))

    fake.init = init
    fake.log = lambda data, step=None: calls.append(("log", data, step))
    fake.finish = lambda: calls.append(("finish",))
    sys.modules["wandb"] = fake
    try:
        result = train(argv)
    finally:
        del sys.modules["wandb"]
    return {**result, "wandb": calls}


def train_and_count_whole_masters(argv: list[str]) -> dict:
    """pretrain; after every step, how many model parameters carry an fp32 master copy
    (`main_param`) other than the distributed optimizer's range of them."""
    counts = {}

    def hook(iteration, state, runtime):
        from megatron.hetero.unit_state import OptimizerView, _shard

        ranges = {}
        for sub in OptimizerView(state.optimizer).sharded:
            for param in sub.model_param_group_index_map:
                ranges[param] = _shard(sub, param)[0]
        counts[iteration] = sum(
            1
            for p in state.model.module.parameters()
            if getattr(p, "main_param", None) is not None
            and getattr(p, "main_param", None) is not ranges.get(p)
        )

    result, stdout = _pretrain(argv, hook)
    return {"losses": result.losses, "whole_masters": counts, "stdout": stdout}


def train_and_read_norms(argv: list[str]) -> dict:
    """pretrain; then every norm parameter of the model by name: (its `sequence_parallel`
    mark, its value)."""
    norms = {}

    def hook(iteration, state, runtime):
        from megatron.hetero.model import unwrap_model

        for name, param in unwrap_model(state.model).named_parameters():
            if "layernorm" in name:
                marked = getattr(param, "sequence_parallel", False)
                norms[name] = (marked, param.detach().clone())

    result, stdout = _pretrain(argv, hook)
    return {"losses": result.losses, "norms": norms, "stdout": stdout}


def compat_paths(tmp_dir: str) -> dict:
    """Runs each upstream path a CPU shim covers; returns what each produced."""
    import torch
    import torch.distributed as dist

    from megatron.hetero import cpu_compat
    from megatron.hetero.arguments import parse_args

    report = {"activated": cpu_compat.activate()}
    args = parse_args(
        (
            "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            "--micro-batch-size 2 --train-iters 1 --lr 1e-2 --mock-data "
            "--vocab-size 63 --clip-grad 1e-3"
        ).split()
    )
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
        # recompute_rng: a recomputed forward restores the RNG states its first run saw
        x = torch.ones(8, requires_grad=True)
        drawn = []

        def noisy(t):
            noise = torch.rand(8)
            drawn.append(noise)
            return t * noise

        tensor_parallel.checkpoint(noisy, False, x).sum().backward()
        report["recompute_rng"] = (len(drawn), torch.equal(drawn[0], drawn[-1]))
        # cuda_literals: megatron's optimizers check CUDA type names
        report["type_names"] = (
            torch.zeros(1, dtype=torch.bfloat16).type(),
            torch.zeros(1).type(),
            torch.zeros(1).type(torch.int64).dtype,
        )
        # cuda_literals + clip_grads: a step through the schedule and FP32Optimizer with clipping
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
        state = setup_model_and_optimizer(args, tokenizer.vocab_size)
        model = state.model
        train_ds, _, _ = build_datasets(args, tokenizer)
        step = train_step(args, state, iter(build_loader(train_ds, 0, args, 0, 1)))
        clipped = torch.sqrt(
            sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)
        ).item()
        report["step"] = (step.loss, float(step.grad_norm), step.skipped, clipped)
        # synchronize: dist_checkpointing's writer, then a load that restores the weights
        state = model.module.sharded_state_dict()
        dist_checkpointing.save(state, tmp_dir)
        before = {
            k: v.detach().clone()
            for k, v in model.module.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        for p in model.parameters():
            p.data.add_(1.0)
        loaded = dist_checkpointing.load(model.module.sharded_state_dict(), tmp_dir)
        model.module.load_state_dict(loaded)
        report["checkpoint_roundtrip"] = all(
            torch.equal(before[k], v) for k, v in model.module.state_dict().items() if k in before
        )
        report["world"] = dist.get_world_size()
    finally:
        shutdown()
    return report


def train_drawing_apart(argv: list[str]) -> dict:
    """pretrain where, after every step, each data-parallel replica draws its own number of
    values (r + 1 on replica r) from the default generator, as --het-dp's replicas do through
    dropout over different micro-batch counts; records a digest of the generator after each."""
    import hashlib

    import torch
    from megatron.core import parallel_state

    rng = {}

    def hook(iteration, state, runtime):
        torch.rand(parallel_state.get_data_parallel_rank() + 1)
        rng[iteration] = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()

    result, stdout = _pretrain(argv, hook)
    return {"losses": result.losses, "rng": rng, "stdout": stdout}


def train_reading_the_tracker_apart(argv: list[str], elsewhere: int) -> dict:
    """pretrain where every rank but 0 reads iteration `elsewhere` from --load's tracker, as
    when another job moves the tracker between ranks' reads."""
    import torch.distributed as dist

    from megatron.hetero import checkpointing

    real = checkpointing.latest_iteration

    def apart(root):
        return real(root) if dist.get_rank() == 0 else elsewhere

    checkpointing.latest_iteration = apart
    try:
        result, stdout = _pretrain(argv)
    finally:
        checkpointing.latest_iteration = real
    return {"losses": result.losses, "stdout": stdout}


def upstream_resume_paths(root: str, reads: list, loaded: int) -> dict:
    """The checkpoint upstream.py's glue resumes het-TP state from, on this rank, where rank r
    reads iteration reads[r] from `root`'s tracker: before upstream's load (the plan to start
    in), and after it loaded iteration `loaded`."""
    import argparse

    import torch.distributed as dist

    from megatron.hetero import checkpointing, upstream

    dist.init_process_group("gloo")
    real = checkpointing.latest_iteration
    checkpointing.latest_iteration = lambda _: reads[dist.get_rank()]
    try:
        args = argparse.Namespace(load=root, finetune=False, ckpt_step=None, iteration=loaded)
        before = upstream._checkpoint_to_resume(args)
        after = upstream._checkpoint_to_resume(args, iteration=args.iteration)
    finally:
        checkpointing.latest_iteration = real
        dist.destroy_process_group()
    return {"before": before, "after": after}


def train_pricing_a_layer_move(argv: list[str]) -> dict:
    """pretrain; after every step, the runtime's predicted seconds of moving one layer between
    pipeline stages (what every rank must agree on to decide a split)."""
    priced = {}

    def hook(iteration, state, runtime):
        priced[iteration] = runtime._layer_move_seconds()

    result, stdout = _pretrain(argv, hook)
    return {"losses": result.losses, "priced": priced, "stdout": stdout}


def train_with_slow_boundary(argv: list[str], seconds: float) -> dict:
    """pretrain with the het-TP runtime's step boundary and the on_step_end hook each taking
    `seconds` longer."""
    import time

    from megatron.hetero.runtime import HetTPRuntime

    real_end_step = HetTPRuntime.end_step

    def slow_end_step(self, *args, **kwargs):
        time.sleep(seconds)
        return real_end_step(self, *args, **kwargs)

    HetTPRuntime.end_step = slow_end_step
    try:
        result, stdout = _pretrain(argv, hook=lambda *_: time.sleep(seconds))
    finally:
        HetTPRuntime.end_step = real_end_step
    return {"metrics_file": result.metrics_file, "stdout": stdout}


def train_with_failing_planner(argv: list[str], stage: int | None = None) -> dict:
    """pretrain with the deciding rank's planner raising whenever it runs (of pipeline stage
    `stage` only, if given)."""
    from megatron.core import parallel_state

    from hettp.loop import ControlLoop

    real = ControlLoop.observe

    def failing(self, report, detection, plan, shares, decide, unit_bytes=None):
        here = stage is None or parallel_state.get_pipeline_model_parallel_rank() == stage
        if decide and here:
            raise ValueError("planner broke (injected)")
        return real(self, report, detection, plan, shares, decide, unit_bytes)

    ControlLoop.observe = failing
    try:
        return train(argv)
    finally:
        ControlLoop.observe = real


def exit_watch(world: int) -> dict:
    """ExitWatch on --exit-signal SIGUSR1 and a time budget: which signal stops the run, what
    SIGINT does, and how long the budget had run at install (it counts from process start)."""
    import signal
    import time

    import torch.distributed as dist

    from megatron.hetero.stopping import ExitWatch, process_start_time

    dist.init_process_group("gloo")
    try:
        sigint = signal.getsignal(signal.SIGINT)
        time.sleep(1.0)  # set-up, which the budget must count
        watch = ExitWatch(True, 10.0, exit_signal="SIGUSR1").install()
        untouched = signal.getsignal(signal.SIGINT) is sigint
        elapsed = time.time() - watch._start
        before = watch.due()
        if dist.get_rank() == world - 1:
            signal.raise_signal(signal.SIGUSR1)
        after = watch.due()
        watch.close()
        return {
            "untouched": untouched,
            "elapsed": elapsed,
            "started": time.time() - process_start_time(),
            "before": before,
            "after": after,
        }
    finally:
        dist.destroy_process_group()


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


def check_byte_items_counting_loads(folders: list[str]) -> list:
    """ckpt_integrity.check_byte_items on each folder (every rank, gloo): per folder, how
    many byte items this rank loaded and the refusal it raised (None if none)."""
    import torch.distributed as dist

    from megatron.hetero import ckpt_integrity

    dist.init_process_group("gloo")
    loads, real = [], ckpt_integrity.load_weights_only

    def counting(raw):
        loads.append(raw)
        return real(raw)

    ckpt_integrity.load_weights_only = counting
    out = []
    for folder in folders:
        loads.clear()
        meta = ckpt_integrity.check_metadata(os.path.join(folder, ".metadata"))
        try:
            ckpt_integrity.check_byte_items(folder, meta)
            out.append((len(loads), None))
        except ckpt_integrity.UnsafeCheckpointError as err:
            out.append((len(loads), str(err)))
    dist.destroy_process_group()
    return out


def _stray_buffers(live) -> int:
    """How many of megatron-core's parameter and gradient buffers are alive, after a
    collection, besides those of DDP wrapper `live`: those of a wrapper set aside (the old one
    of a move, a failed rebuild's new one, whoever holds them: its optimizer, a traceback)."""
    import gc

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    gc.collect()
    held = {id(b) for b in live.buffers + live.expert_parallel_buffers}
    return sum(
        1 for o in gc.get_objects() if isinstance(o, _ParamAndGradBuffer) and id(o) not in held
    )


def _post_hooks(live) -> dict:
    """megatron-core's DDP backward hooks alive, after a collection (each is held only by the
    gradient accumulator it is on): how many belong to wrappers other than `live`, and whether
    each parameter `live` hooks has exactly one of `live`'s, on its current accumulator."""
    import gc
    import types

    gc.collect()
    name = "DistributedDataParallel._make_backward_post_hook.<locals>.hook"
    owners = []  # (wrapper, parameter) of every live hook
    for o in gc.get_objects():
        if type(o) is types.FunctionType and o.__qualname__ == name:
            cells = dict(zip(o.__code__.co_freevars, o.__closure__))
            owners.append((cells["self"].cell_contents, cells["param"].cell_contents))
    mine = sorted(id(p) for w, p in owners if w is live)
    held = {id(a.variable): a for a in live.grad_accs}
    current = all(
        a.variable.expand_as(a.variable).grad_fn.next_functions[0][0] is a for a in live.grad_accs
    )
    return {
        "others": sum(1 for w, _ in owners if w is not live),
        "one_each": bool(held) and mine == sorted(held) and current,
    }


def train_with_repartitions(argv: list[str], plans: dict, faults: tuple = ()) -> dict:
    """pretrain, switching to plans[iteration] (an inline spec, JSON, "rebalance:<counts>", or a
    list of them applied in turn) after that iteration.

    A fault {"iteration": i, "rank": r, "stage": s} makes TP rank r fail at stage s of the
    transfer at iteration i (in every pipeline stage, or in "pipeline_stage" p only); the hook
    then records whether anything changed and goes on.
    """
    import weakref

    import torch
    import torch.distributed as dist

    from hettp.exchange import TransferError
    from hettp.plan import PartitionPlan

    events = []

    def snapshot(state):
        """Every parameter, fp32 master and optimizer state tensor, by parameter name; and
        every parameter's replica marks."""
        from megatron.hetero.unit_state import OptimizerView

        view = OptimizerView(state.optimizer)
        view.gather()  # whole tensors under the distributed optimizer (collective over DP)
        params = {n: p.detach().clone() for n, p in state.model.module.named_parameters()}
        extra = {}
        for name, param in state.model.module.named_parameters():
            if view.master(param) is not None:
                extra[(name, "master")] = view.master(param).detach().clone()
            extra.update(
                {
                    (name, k): v.clone()
                    for k, v in view.state[param].items()
                    if isinstance(v, torch.Tensor)
                }
            )
        marks = {
            name: (getattr(p, "shared", None), getattr(p, "het_replicated", None))
            for name, p in state.model.module.named_parameters()
        }
        return params, extra, marks

    def hook(iteration, state, runtime):
        specs = plans.get(iteration, [])
        for spec in [specs] if isinstance(specs, str) else specs:
            apply(iteration, spec, state, runtime)

    def apply(iteration, spec, state, runtime):
        partition = runtime.partition
        current = runtime.whole_plan()  # every layer of the model, over pipeline stages
        if spec.startswith("rebalance:"):  # new counts, fewest moves from the current plan
            counts = dict(part.split("=") for part in spec[len("rebalance:") :].split(";"))
            plan = current.rebalanced(
                *([int(c) for c in counts[b].split(",")] for b in ("attn", "mlp"))
            )
        else:
            plan = PartitionPlan.parse(
                spec,
                current.tp_size,
                current.num_layers,
                current.attn_units,
                current.mlp_units,
                current.mlp_unit_size,
            )
        tp_rank = dist.get_rank(partition.group)
        from megatron.core import parallel_state

        pp_stage = parallel_state.get_pipeline_model_parallel_rank()

        def inject(stage):
            for fault in faults:
                if (fault["iteration"], fault["stage"], fault["rank"]) == (
                    iteration,
                    stage,
                    tp_rank,
                ) and fault.get("pipeline_stage", pp_stage) == pp_stage:
                    raise RuntimeError(f"injected failure at {stage}")

        before = snapshot(state)
        wrapper = state.model
        # the old wrapper's buffers (gradients; parameters under the distributed optimizer)
        buffers = [
            weakref.ref(t)
            for b in wrapper.buffers
            for t in (b.grad_data, b.param_data)
            if t is not None
        ]
        try:
            migration = runtime.repartition(plan, iteration, fault=inject)
        except TransferError as err:
            after = snapshot(state)
            same = (
                before[0].keys() == after[0].keys()
                and before[1].keys() == after[1].keys()
                and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
                and all(torch.equal(before[1][k], after[1][k]) for k in before[1])
                and before[2] == after[2]
            )
            events.append(
                {
                    "iteration": iteration,
                    "error": str(err),
                    "unchanged": same,
                    "plan_kept": runtime.whole_plan() == current,
                    # while the error (and its traceback) lives, as in the runtime's recovery
                    "stray_buffers": _stray_buffers(state.model),
                    "post_hooks": _post_hooks(state.model),  # none of the failed one's left
                }
            )
            return
        schedule, result = migration.schedule, migration.result

        def hook_owner(name):  # whose method the config's hook is (None: unset)
            hook = getattr(state.config, name)
            hook = hook[0] if isinstance(hook, list) else hook
            return None if hook is None else getattr(hook, "__self__", "not a method")

        events.append(
            {
                "iteration": iteration,
                # the replaced DDP wrapper keeps no gradient buffer
                "old_wrapper_buffers": (
                    None if wrapper is state.model else len(wrapper.buffers + wrapper.bucket_groups)
                ),
                # ... and none of them is alive anywhere after a collection
                "old_buffers_alive": (None if wrapper is state.model else _alive_after_gc(buffers)),
                "hooks": {
                    name: ("unset" if hook_owner(name) is None else hook_owner(name) is state.model)
                    for name in ("no_sync_func", "grad_sync_func", "param_sync_func")
                },
                "units_moved": len(schedule.moves),
                "post_hooks": _post_hooks(state.model),  # none of the old wrappers' left
                "bytes": result.payload_bytes,
                "primitive": result.primitive,
                "moves": [(m.layer, m.block, m.unit, m.src, m.dst) for m in schedule.moves],
                "plan": runtime.whole_plan().to_json(),
                "local_units": {
                    f"{k[0]}.{k[1]}": list(b.units) for k, b in het_blocks(state.model).items()
                },
            }
        )

    import gc

    from megatron.hetero.partition import het_blocks

    result, stdout = _pretrain(argv, hook)
    return {
        "losses": result.losses,
        "events": events,
        "stdout": stdout,
        "frozen_objects": gc.get_freeze_count(),
    }


def _alive_after_gc(refs) -> int:
    import gc

    gc.collect()
    return sum(ref() is not None for ref in refs)


def _gather_full(module, group, dp_group=None) -> dict:
    """Every parameter in its canonical full (TP=1) layout, from this TP group's shards."""
    import torch
    import torch.distributed as dist

    from megatron.hetero.layers import HetQKVLinear, UnitShardedLinear

    unit_owned, head_owned, replicas = {}, {}, set()
    for m in module.modules():
        if isinstance(m, HetQKVLinear) and m.heads is not None:
            for name in m.unit_layouts:
                head_owned[id(getattr(m, name))] = (m, name)
                replicas.update(id(p) for p in m.replica_params(name).values())
        elif isinstance(m, UnitShardedLinear):
            for name, layout in m.unit_layouts.items():
                unit_owned[id(getattr(m, name))] = (m, layout)
    full = {}
    tp = dist.get_world_size(group)
    for name, param in module.named_parameters():
        if id(param) in replicas:  # in the canonical QKV tensor, with the query rows
            continue
        for what, tensor in (("param", param.detach()), ("grad", param.grad)):
            if tensor is None:
                continue
            if id(param) in head_owned:
                m, pname = head_owned[id(param)]
                of = (lambda p: p.detach()) if what == "param" else (lambda p: p.grad)
                mine = {
                    fragment: view.clone()
                    for view, fragment, main in m.canonical_fragments(pname, of)
                    if main
                }
                gathered = [None] * tp
                dist.all_gather_object(gathered, mine, group=group)
                pieces = {f: t for part in gathered for f, t in part.items()}
                value = torch.cat([pieces[f] for f in range(m.heads.fragments)])
            elif id(param) in unit_owned:
                m, layout = unit_owned[id(param)]
                mine = {
                    u: layout.payload(tensor, len(m.units), i).clone()
                    for i, u in enumerate(m.units)
                }
                gathered = [None] * tp
                dist.all_gather_object(gathered, mine, group=group)
                payloads = {u: t for part in gathered for u, t in part.items()}
                value = layout.assemble([payloads[u] for u in range(m.num_units)], tensor)
            elif getattr(param, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                value = torch.cat(parts, dim=param.partition_dim)
            else:
                value = tensor.clone()
            full[f"{what}:{name}"] = value
    return full


def _unit_slices(full_name, module, units_by_block):
    """Views of the canonical full tensor `full_name`'s slices for the units of
    units_by_block[(layer, block)]."""
    from megatron.hetero.partition import het_blocks

    for (index, block_name), block in het_blocks(module).items():
        units = units_by_block.get((index, block_name), ())
        for linear, param_name, _, layout in block.unit_tensors():
            if (
                f"decoder.layers.{index}.{'self_attention' if block_name == 'attn' else 'mlp'}."
                f"{linear}.{param_name}" == full_name
            ):
                return [(layout, u, getattr(block, linear)) for u in units]
    return []


def _mask_units(full, module, units_by_block):
    """Zero the given units' slices of every gathered tensor; report whether their gradients
    were zero already."""
    all_zero = True
    for key, tensor in full.items():
        what, _, name = key.partition(":")
        for layout, unit, linear in _unit_slices(name, module, units_by_block):
            heads = getattr(linear, "heads", None)
            if heads is not None:  # head units: the unit's query heads in the canonical QKV
                dim = linear.head_dim
                views = [tensor.narrow(0, f * dim, dim) for f in heads.query_fragments(unit)]
            else:
                views = [
                    tensor.narrow(
                        layout.axis,
                        layout.global_fragment(unit, part, _num_units(module, name))[0]
                        * layout.width,
                        layout.width,
                    )
                    for part in range(layout.parts)
                ]
            for view in views:
                if what == "grad":
                    all_zero = all_zero and bool((view == 0).all())
                view.zero_()
    return all_zero


def _num_units(module, name):
    from megatron.hetero.partition import het_blocks

    layer = int(name.split(".")[2])
    block = "attn" if ".self_attention." in name else "mlp"
    return het_blocks(module)[(layer, block)].num_units


def _gemm_backward(output) -> str:
    """The autograd node of the GEMM that made a column linear's output (under a bias add
    or a reshape, if any)."""
    node = output.grad_fn
    for _ in range(3):
        name = type(node).__name__
        if "Linear" in name or "Mm" in name or node is None or not node.next_functions:
            return name
        node = node.next_functions[0][0]
    return type(node).__name__


def het_numerics(argv: list[str], plans: list, shares=None, zeroed=None, masked=None) -> list:
    """Forward + backward of one fixed batch under each plan; per-token losses and every
    parameter and gradient in the canonical full layout (from rank 0).

    Resizing: `shares` (per TP rank) makes each rank compute only the prefix of its units that
    the share leaves; `zeroed` ({(layer, block): units}, TP=1) zeroes those units' weights
    instead. The units in `masked` are zeroed out of the gathered weights and gradients
    ("skipped_grads_zero" says whether their gradients were exactly zero)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hettp.plan import PartitionPlan
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.data import build_tokenizer
    from megatron.hetero.model import build_gpt_model, transformer_config
    from megatron.hetero.training import initialize, shutdown

    args = parse_args(argv)
    try:
        initialize(args)
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
        spec, partition = None, None
        if args.het_tp:
            from megatron.hetero.partition import HetPartition
            from megatron.hetero.spec import get_het_gpt_layer_spec

            spec = get_het_gpt_layer_spec(
                args.normalization,
                args.het_tp_granularity,
                args.het_tp_attn_granularity,
                args.qk_layernorm,
                args.qk_l2_norm,
            )
        module = build_gpt_model(args, transformer_config(args), tokenizer.vocab_size, spec)
        if args.het_tp:
            partition = HetPartition(module)
        batch, seq = 4, args.seq_length
        tokens = torch.randint(
            0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7)
        )
        dp, dp_rank = args.data_parallel_size, parallel_state.get_data_parallel_rank()
        mine = tokens[dp_rank * batch // dp : (dp_rank + 1) * batch // dp]
        labels = torch.roll(mine, -1, dims=1)
        position = torch.arange(seq).expand_as(mine)
        mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        results = []
        for spec_text in plans:
            if spec_text is not None:
                p = partition.plan
                partition.install(
                    module,
                    PartitionPlan.parse(
                        spec_text,
                        p.tp_size,
                        p.num_layers,
                        p.attn_units,
                        p.mlp_units,
                        p.mlp_unit_size,
                    ),
                )
            if shares is not None:
                from hettp.resize import skipped_count
                from megatron.hetero.partition import het_blocks

                for block in het_blocks(module).values():
                    n = len(block.units)
                    block.set_active(n - skipped_count(n, shares[dist.get_rank(tp_group)]))
            if zeroed is not None:
                from megatron.hetero.partition import het_blocks

                with torch.no_grad():
                    for key, block in het_blocks(module).items():
                        for _, _, param, layout in block.unit_tensors():
                            for unit in zeroed.get(key, ()):
                                for part in range(layout.parts):
                                    param.data.narrow(
                                        layout.axis,
                                        (part * len(block.units) + unit) * layout.width,
                                        layout.width,
                                    ).zero_()
            module.zero_grad(set_to_none=True)
            backward_fns, hooks = set(), []
            if partition is not None:
                from megatron.hetero.layers import HetColumnParallelLinear

                for sub in module.modules():
                    if isinstance(sub, HetColumnParallelLinear):
                        hooks.append(
                            sub.register_forward_hook(
                                lambda _m, _i, out, seen=backward_fns: seen.add(
                                    _gemm_backward(out[0])
                                )
                            )
                        )
            losses = module(mine, position, mask, labels=labels)
            for hook in hooks:
                hook.remove()
            losses.mean().backward()
            if partition is not None:  # what the runtime does: K/V replicas' sum
                partition.sum_replica_grads(module, attr="grad")
            for name, param in module.named_parameters():
                # what finalize_model_grads does under sequence parallelism: sum the replicated
                # norm weights' gradients over the TP group (each rank saw part of the sequence),
                # and so the query/key norms' (each rank saw its own heads)
                qk = args.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
                if qk and param.grad is None:  # a rank holding no head (DDP's buffer: zeros)
                    param.grad = torch.zeros_like(param)
                if param.grad is not None and (qk or getattr(param, "sequence_parallel", False)):
                    dist.all_reduce(param.grad, group=tp_group)
            for param in module.parameters():  # what DDP does: average over data-parallel ranks
                if param.grad is not None and dp > 1:
                    dist.all_reduce(param.grad, group=dp_group)
                    param.grad /= dp
            full = _gather_full(module, tp_group)
            if partition is not None:
                full["column_backward"] = backward_fns
            if masked is not None:
                full["skipped_grads_zero"] = _mask_units(full, module, masked)
            all_losses = [torch.empty_like(losses) for _ in range(dp)]
            dist.all_gather(all_losses, losses.detach().contiguous(), group=dp_group)
            full["losses"] = torch.cat(all_losses)
            results.append(full if dist.get_rank() == 0 else None)
        return results
    finally:
        shutdown()


def exchange_value(layer: int, block: str, unit: int, src: int) -> float:
    """What exchange_primitives' sender fills a unit's weight with: every (layer, block, unit,
    sender) its own (one layer's MLP and attention unit 0 must not be mistaken for each other)."""
    return float(layer * 1000 + unit * 10 + src + (500 if block == "attn" else 0))


def exchange_primitives(world_cases: list) -> dict:
    """run_transfer with every primitive on synthetic schedules; returns what each rank got
    (or the error it raised) and the cost model measured on this group. A case is (name,
    primitive, moves, message_bytes, (faulty rank, stage) or None); primitive "p2p grouped" is
    p2p with its operations posted as one group, as on NCCL."""
    import torch
    import torch.distributed as dist

    from hettp import exchange
    from hettp.exchange import TensorSpec, TransferError, measure_costs, run_transfer
    from hettp.transfer import TransferSchedule, UnitMove

    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    # a weight-like tensor joined along its columns (axis 1), and ids joined along axis 0
    specs = [TensorSpec((3, 5), torch.float32, axis=1), TensorSpec((7,), torch.int64)]

    def unit(move):  # what the sender holds for a unit: depends only on the move
        base = exchange_value(move.layer, move.block, move.unit, move.src)
        return [torch.full((3, 5), base), torch.arange(7, dtype=torch.int64) + move.unit]

    def payload(run):  # a run's units joined along each spec's axis
        return [
            torch.cat(tensors, dim=spec.axis)
            for tensors, spec in zip(zip(*(unit(m) for m in run)), specs)
        ]

    def faulty(case_fault):
        def fault(stage):
            if case_fault and case_fault == (rank, stage):
                raise RuntimeError(f"injected {stage} fault")

        return fault

    got = {}
    streams = exchange._groups_p2p
    for name, primitive, moves, message_bytes, case_fault in world_cases:
        grouped = primitive == "p2p grouped"
        exchange._groups_p2p = (lambda group: True) if grouped else streams
        primitive = "p2p" if grouped else primitive
        schedule = TransferSchedule(n, tuple(UnitMove(*m, 15 * 4 + 7 * 8) for m in moves))
        try:
            result = run_transfer(
                schedule,
                None,
                primitive,
                payload,
                lambda m: specs,
                fault=faulty(case_fault),
                message_bytes=message_bytes,
            )
        except TransferError as err:
            got[name] = str(err)
            continue
        got[name] = {
            (m.layer, m.block, m.unit, m.src, m.dst): [t.clone() for t in tensors]
            for m, tensors in result.received.items()
        }
        assert result.payload_bytes == schedule.total_bytes
    exchange._groups_p2p = streams
    model = measure_costs(None, sizes=(4096, 1 << 16), repeats=2)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "got": got,
        "model": {
            p: vars(getattr(model, p)) for p in ("p2p", "all_to_all", "scatter", "broadcast")
        },
    }


def train_with_resizes(argv: list[str], actions: dict, values_at=None) -> dict:
    """pretrain with resizes and migrations at step boundaries: actions[iteration] is a list of
    ("resize", shares), ("migrate", "rebalance:attn=..;mlp=..") or ("skip next step", None):
    the optimizer takes no step at the next iteration, as megatron-core's skips one on an fp16
    overflow (its step count stays).

    After every step, records this rank's local unit order and active count per block and the
    priorities, and at the steps in `values_at` (default: every step) a copy of every local
    unit's weights and optimizer state (by unit id): thousands of small tensors a step, which
    take longer to copy and send back than the tiny model takes to train."""

    from megatron.hetero.partition import het_blocks
    from megatron.hetero.unit_state import OptimizerView, state_keys, step_count, unit_tensors

    records = {}

    def hook(iteration, state, runtime):
        resizer = runtime.resizer
        for kind, arg in actions.get(iteration, []):
            if kind == "resize":
                runtime.resize(arg, iteration, "test")
            elif kind == "skip next step":
                for sub in OptimizerView(state.optimizer).subs:
                    sub.optimizer.step = lambda *a, _sub=sub, **k: _sub.optimizer.__dict__.pop(
                        "step"
                    )
            else:
                counts = dict(part.split("=") for part in arg[len("rebalance:") :].split(";"))
                plan = runtime.partition.plan.rebalanced(
                    *([int(c) for c in counts[b].split(",")] for b in ("attn", "mlp"))
                )
                runtime.repartition(plan, iteration)
        optimizer = OptimizerView(state.optimizer)
        optimizer.gather()  # whole tensors under the distributed optimizer (collective over DP)
        blocks = het_blocks(state.model)
        keys = state_keys(optimizer, blocks)
        record = {}
        copy = values_at is None or iteration in values_at
        for key, block in blocks.items():
            tensors = unit_tensors(block, optimizer, keys) if copy else []
            n = len(block.units)
            record[key] = {
                "units": block.units,
                "active": block.active,
                "unit_tensors": len(list(block.unit_tensors())),  # K/V replicas follow in values
                "values": {
                    u: [layout.payload(t, n, i).clone() for t, layout in tensors]
                    for i, u in enumerate(block.units)
                }
                if copy
                else None,
                "order_ok": resizer.priorities.order(key, block.units) == block.units,
            }
        evidence = resizer._evidence  # per block: (score sums, observed steps) per unit
        records[iteration] = {
            "blocks": record,
            "state_keys": keys,
            "count": step_count(optimizer),  # the optimizer's steps: Adam's bias correction
            "scheduler_steps": state.scheduler.num_steps,  # samples the schedule has counted
            "shares": resizer.shares,
            "observed": None
            if evidence is None
            else sum(steps.sum().item() for _, steps in evidence.values()),
            # --het-dp-compress: how many gradient buffers have rounding residues kept
            "residues": len(state.model.reducer.errors)
            if getattr(state.model, "reducer", None) is not None
            else None,
        }

    result, stdout = _pretrain(argv, hook)
    return {"losses": result.losses, "records": records, "stdout": stdout}


def train_with_control(argv: list[str]) -> dict:
    """pretrain with the control loop; records this rank's plan and shares after every step,
    and a digest of its default generator (TP peers must draw the same dropout masks)."""
    import hashlib

    import torch

    seen, unit_work, rng = {}, {}, {}  # unit_work: per iteration, the units' weights after it
    per_unit = {}  # per iteration, every TP rank's compute over its work, as the loop saw it
    anchor = {}  # per iteration: the slowdowns the anchor carries, whether it holds the level's

    def hook(iteration, state, runtime):
        rng[iteration] = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()
        controller = runtime.controller if runtime else None
        if controller is not None:
            saved = controller.loop.anchor.state_dict()
            anchor[iteration] = (saved["before"], saved["then"] is not None)
        latest = controller.loop.latest if controller else None
        if latest is not None and latest.iteration == iteration:
            per_unit[iteration] = [
                c / w if w else None for c, w in zip(latest.compute, latest.work)
            ]
        partition = runtime.partition if runtime else None
        resizer = runtime.resizer if runtime else None
        seen[iteration] = (
            partition.plan.to_json() if partition else None,
            resizer.shares if resizer else None,
        )
        unit_work[iteration] = dict(partition.unit_work) if partition else None

    result, stdout = _pretrain(argv, hook)
    return {
        "losses": result.losses,
        "seen": seen,
        "unit_work": unit_work,
        "rng": rng,
        "per_unit": per_unit,
        "anchor": anchor,
        "stdout": stdout,
        "metrics_file": result.metrics_file,
    }


def train_with_layer_moves(argv: list[str], moves: dict, faults: tuple = ()) -> dict:
    """pretrain, moving layers between pipeline stages after iteration i so that stage s holds
    moves[i][s] layers; a fault {"iteration": i, "global_rank": r, "stage": "pack", "built" or
    "exchanged"} fails that rank there, and the hook records whether anything changed. Records
    this rank's layer numbers, plan and its config's split after every step."""
    import torch.distributed as dist

    from hettp.exchange import TransferError
    from megatron.hetero.layer_moves import split_of
    from megatron.hetero.model import unwrap_model

    seen, events = {}, []

    def hook(iteration, state, runtime):
        if iteration in moves:
            fail = [f for f in faults if f["iteration"] == iteration]

            def fault(stage):
                for f in fail:
                    if f["global_rank"] == dist.get_rank() and f.get("stage", "pack") == stage:
                        raise RuntimeError(f"injected failure at {stage}")

            model = state.model
            try:
                moved = runtime.move_layers(moves[iteration], iteration, fault=fault)
                events.append({"iteration": iteration, "sent": moved.sent, "got": moved.received})
            except TransferError as err:
                events.append(
                    {
                        "iteration": iteration,
                        "error": str(err),
                        "kept": state.model is model,
                        "stray_buffers": _stray_buffers(state.model),  # the error alive
                    }
                )
        model = unwrap_model(state.model)
        seen[iteration] = (
            [layer.layer_number for layer in model.decoder.layers],
            runtime.partition.plan.to_json(),
            split_of(model.config),  # megatron-core's split, as the config says
        )

    result, stdout = _pretrain(argv, hook)
    return {
        "losses": result.losses,
        "seen": seen,
        "events": events,
        "stdout": stdout,
        "metrics_file": result.metrics_file,
    }


def preloaded(names: list[str]) -> dict:
    """Which of these modules the rank already had when it started (from the fork server)."""
    import sys

    return {name: name in sys.modules for name in names}


def train_with_data_split(argv: list[str]) -> dict:
    """pretrain under --het-dp; records, after each step, the split this rank ran it with
    (every replica's counts, this replica's count, its loss weight) and its data-parallel
    rank."""
    from megatron.core import parallel_state

    seen, where = {}, {}

    def hook(iteration, state, runtime):
        split = runtime.split
        seen[iteration] = (split.counts, split.here, split.loss_weight)
        where["dp_rank"] = parallel_state.get_data_parallel_rank()

    result, stdout = _pretrain(argv, hook)
    return {
        "losses": result.losses,
        "seen": seen,
        "dp_rank": where["dp_rank"],
        "stdout": stdout,
        "metrics_file": result.metrics_file,
    }


def compressed_sums(kind: str, steps: int) -> dict:
    """hettp.compress on this rank: `steps` reductions of seeded per-rank gradients; what came
    back each step, the exact sums, and the residue left at the end."""
    import torch
    import torch.distributed as dist

    from hettp.compress import ErrorFeedbackReducer

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    reducer = ErrorFeedbackReducer(kind)
    got, exact = [], []
    for step in range(steps):
        grads = [
            torch.randn(10_000, generator=torch.Generator().manual_seed(100 * step + r))
            for r in range(size)
        ]
        flat = grads[rank].clone()
        reducer.all_reduce_sum("buffer", flat)
        got.append(flat)
        exact.append(sum(grads))
    residues = [torch.zeros(10_000) for _ in range(size)]
    dist.all_gather(residues, reducer.errors["buffer"])
    dist.destroy_process_group()
    return {"got": got, "exact": exact, "residue": sum(residues)}


def train_and_count_sharded_weights(argv: list[str]) -> dict:
    """pretrain; after every step, the elements of this rank's sharded linear weights (QKV
    with any K/V replicas of head units, projection, fc1, fc2): the unit state it holds, in
    parameters."""
    counts = {}
    sharded = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

    def hook(iteration, state, runtime):
        from megatron.hetero.model import unwrap_model

        counts[iteration] = sum(
            p.numel()
            for name, p in unwrap_model(state.model).named_parameters()
            if (name.endswith("weight") or ".kv_weight." in name)
            and any(k in name for k in sharded)
        )

    result, stdout = _pretrain(argv, hook)
    return {
        "losses": result.losses,
        "weights": counts,
        "stdout": stdout,
        "metrics_file": result.metrics_file,
    }

"""Megatron-LM shaped log lines on rank 0, plus the JSONL metrics file and TensorBoard.

Printed iteration lines average over `--log-interval` iterations, as Megatron's do; the JSONL
file gets every iteration so benchmarks and plots need no log parsing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from datetime import datetime

import torch
import torch.distributed as dist

from hettp import __version__
from hettp.stages import split_text

from .flops import model_flops_per_sample


@dataclasses.dataclass(frozen=True)
class StageMove:
    """What one pipeline stage's part of a re-partition moved, and how."""

    units: int
    payload_bytes: int
    wire_bytes: int
    min_bytes: int  # the fewest bytes any transfer to the same plan could move
    seconds: float
    primitive: str
    predictions: dict  # primitive -> predicted seconds

    @classmethod
    def of(cls, migration) -> StageMove:
        result = migration.result
        return cls(
            migration.units_moved,
            result.payload_bytes,
            result.wire_bytes,
            migration.minimum_bytes(),
            result.seconds,
            result.primitive,
            dict(migration.predictions),
        )

    @classmethod
    def total(cls, moves) -> StageMove:
        """Over the stages: sums, the slowest stage's time, and how the stage that moved the
        most bytes moved them."""
        main = max(moves, key=lambda m: m.payload_bytes)
        return cls(
            sum(m.units for m in moves),
            sum(m.payload_bytes for m in moves),
            sum(m.wire_bytes for m in moves),
            sum(m.min_bytes for m in moves),
            max(m.seconds for m in moves),
            main.primitive,
            main.predictions,
        )


def _at_stage(stage) -> str:
    return f" (pipeline stage {stage})" if stage is not None else ""


def _stage_field(stage) -> dict:
    return {"stage": stage} if stage is not None else {}


def _moved_text(moved) -> str:
    """What a decision's move sent, for its log line ("" for none)."""
    if moved is None:
        return ""
    return (
        f" | moved {moved.units} units, {moved.payload_bytes} bytes in {moved.seconds * 1e3:.1f} ms"
    )


def _moved_fields(moved) -> dict:
    """What a decision's move sent, for its JSONL record (zeros for none)."""
    return {
        "units_moved": moved.units if moved else 0,
        "bytes": moved.payload_bytes if moved else 0,
        "min_bytes": moved.min_bytes if moved else 0,
    }


def _stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


class EventLog:
    """het-TP's own records: one line on rank 0 per plan, resize, re-partition and decision, and
    a JSONL record of each (plus every timing report) when a metrics file is open."""

    def __init__(self, metrics=None):
        self.metrics = metrics  # MetricsWriter on rank 0, None elsewhere

    @property
    def is_printer(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def info(self, message: str) -> None:
        if self.is_printer:
            print(message, flush=True)

    def plan(self, iteration, plan, why) -> None:
        self.info(f"> het-TP plan at iteration {iteration} ({why}): {plan.summary()}")
        if self.metrics is not None:
            self.metrics.write("plan", iteration=iteration, why=why, plan=plan.to_json())

    def priced(self, iteration, before, after, unit_work, call=None) -> None:
        """Core attention priced from the first steps' timings, and attention's per-call part
        as probed (`call`: hettp.attention_probe.CallPrice; megatron/hetero/control.py)."""
        probed = ""
        if call is not None:
            probed = (
                f"; its per-call part {call.call_s * 1e3:.2f} ms a layer (probed), weighs "
                f"{unit_work['call']:.0f}"
            )
        self.info(
            f"> het-TP at iteration {iteration}: core attention costs {after:.2f}x its FLOPs at "
            f"the GEMMs' rate (was taken as {before:.2f}x); an attention unit weighs "
            f"{unit_work['attn']:.0f}{probed}"
        )
        if self.metrics is not None:
            extra = {"call_s": call.call_s} if call is not None else {}
            self.metrics.write(
                "priced", iteration=iteration, core_scale=after, unit_work=dict(unit_work), **extra
            )

    def repartition(self, iteration, plan, moves) -> None:
        """One line per applied re-partition: the whole-model plan, what moved over every
        pipeline stage (`moves`, one StageMove per stage), how (the stage that moved the most)
        and what it cost."""
        moved = StageMove.total(moves)
        predicted = ", ".join(f"{p} {t * 1e3:.2f}" for p, t in sorted(moved.predictions.items()))
        self.info(
            f"> het-TP repartition at iteration {iteration}: {plan.summary()} | "
            f"moved {moved.units} units, {moved.payload_bytes} bytes "
            f"({moved.wire_bytes} on the wire) via {moved.primitive} in "
            f"{moved.seconds * 1e3:.1f} ms (predicted ms: {predicted})"
        )
        if self.metrics is not None:
            self.metrics.write(
                "repartition",
                iteration=iteration,
                plan=plan.to_json(),
                units_moved=moved.units,
                bytes=moved.payload_bytes,
                min_bytes=moved.min_bytes,
                wire_bytes=moved.wire_bytes,
                primitive=moved.primitive,
                seconds=moved.seconds,
                predicted_seconds=moved.predictions,
            )

    def layers(self, iteration, moves, split=None) -> None:
        """One line per layer move between pipeline stages: the split before and after, what
        chose it (`split`, a hettp.stages.LayerSplit; None when asked for directly), and what
        the stages sent (`moves`, one layer_moves.LayerMigration per stage; bytes counted by
        the sender and the receiver, so halved)."""
        first = moves[0]
        sent = sorted(g for m in moves for g in m.sent)
        payload = sum(m.bytes for m in moves) // 2
        seconds = max(m.seconds for m in moves)
        why = "asked"
        if split is not None:
            per_stage = ", ".join(
                f"{b * 1e3:.1f}->{a * 1e3:.1f}" for b, a in zip(split.before, split.after)
            )
            why = (
                f"layer compute ms per step by stage {per_stage} (predicted), "
                f"{split.gain:.0%} off the slowest stage, move predicted "
                f"{split.move_seconds * 1e3:.0f} ms"
            )
        self.info(
            f"> het-TP layer move at iteration {iteration}: layers per stage "
            f"{split_text(first.before)} -> {split_text(first.after)} ({why}) | moved "
            f"layer(s) {sent}, {payload} bytes per TP rank in {seconds * 1e3:.1f} ms"
        )
        if self.metrics is not None:
            self.metrics.write(
                "layers",
                iteration=iteration,
                before=list(first.before),
                after=list(first.after),
                layers_moved=sent,
                bytes=payload,
                seconds=seconds,
                stage_seconds=list(split.before) if split is not None else None,
                predicted_stage_seconds=list(split.after) if split is not None else None,
                predicted_move_seconds=split.move_seconds if split is not None else None,
            )

    def resize(self, iteration, resizer, why) -> None:
        """One line per resize decision: asked and realized skipped shares per rank."""
        realized = resizer.realized_shares()
        shares = ", ".join(f"{a:.0%}/{r:.1%}" for a, r in zip(resizer.shares, realized))
        self.info(
            f"> het-TP resize at iteration {iteration} ({why}): skipped share per TP rank "
            f"(asked/realized) {shares} | priority {resizer.scorer}, refreshed every "
            f"{resizer.interval} iterations"
            + (
                f" | skipped gradients imputed with {resizer.impute:g}"
                if resizer.impute is not None
                else ""
            )
        )
        if self.metrics is not None:
            self.metrics.write(
                "resize",
                iteration=iteration,
                why=why,
                shares=list(resizer.shares),
                realized=realized,
                priority=resizer.scorer,
                impute=resizer.impute,
            )

    def priorities(self, iteration, resizer, swapped) -> None:
        """A priority refresh: how many units it swapped between skipped and active."""
        if resizer.resized_ranks:
            self.info(
                f"> het-TP priorities refreshed at iteration {iteration} "
                f"({resizer.scorer}): {swapped} skipped units swapped in"
            )
        if self.metrics is not None:
            self.metrics.write(
                "priorities", iteration=iteration, priority=resizer.scorer, swapped=swapped
            )

    def timing(self, report, verdict, stage=None) -> None:
        """A timing report (JSONL only): per-rank compute per step (and of it, the part no split
        changes and the attention modules' seconds; and all of the rank's compute, busy), work,
        fitted slowdown factor and where it was read from (`reading`: hettp.loop.Verdict), the
        cost fit's own reading of the report (`modelled`), and the detector's smoothed
        slowdowns; with pipelining, one per stage's TP group, marked with its `stage`."""
        if self.metrics is not None:
            detection = verdict.detection
            self.metrics.write(
                "timing",
                iteration=report.iteration,
                **_stage_field(stage),
                compute_s=list(report.compute),
                fixed_s=list(report.fixed) if report.fixed is not None else None,
                busy_s=list(report.busy) if report.busy is not None else None,
                attention_s=list(report.attention) if report.attention is not None else None,
                work=list(report.work),
                factor=list(verdict.factors),
                step_s=report.step,
                slowdown=list(detection.slowdown) if detection else None,
                refused=verdict.refused,
                reading=verdict.reading or None,
                modelled=list(verdict.modelled) if verdict.modelled is not None else None,
            )
        if verdict.refused:
            self.info(
                f"> het-TP at iteration {report.iteration}{_at_stage(stage)}: {verdict.refused}"
            )

    def decision(self, iteration, decision, detection, moved: StageMove | None, stage=None):
        """One line per planner decision (with pipelining, per deciding stage): what, why,
        predicted step time before and after, and what its stage moved."""
        shares = ", ".join(f"{s:.0%}" for s in decision.shares)
        line = (
            f"> het-TP decision at iteration {iteration}{_at_stage(stage)}: {decision.action} "
            f"({decision.reason}) | resize shares {shares} | predicted step "
            f"{decision.predicted_before * 1e3:.1f} ms -> {decision.predicted_after * 1e3:.1f} ms"
        )
        if decision.migrates:
            line += f" | plan {decision.plan.summary()}"
        if "unit_state" in decision.details:  # under --het-tp-memory-cap
            held = "/".join(f"{x:.2f}" for x in decision.details["unit_state"])
            line += f" | unit state {held} x the even split's"
        self.info(line + _moved_text(moved))
        if self.metrics is not None:
            self.metrics.write(
                "decision",
                iteration=iteration,
                **_stage_field(stage),
                action=decision.action,
                reason=decision.reason,
                shares=list(decision.shares),
                plan=decision.plan.to_json(),
                predicted_before_s=decision.predicted_before,
                predicted_after_s=decision.predicted_after,
                details=decision.details,
                slowdown=list(detection.slowdown) if detection is not None else None,
                **_moved_fields(moved),
            )

    def data_resplit(self, iteration, before, after, paced: bool) -> None:
        """A batch ramp changed the micro-batches of a global batch: the decided counts split
        again for the new total; JSONL `decision` (action `ramp`), so the counts chain."""
        how = "by the paces they were decided on" if paced else "in proportion"
        reason = f"batch ramp to {sum(after)} micro-batches a step, split {how}"
        self.info(
            f"> het-TP decision at iteration {iteration}: ramp ({reason}) | micro-batches per "
            f"replica {split_text(before)} -> {split_text(after)}"
        )
        if self.metrics is not None:
            self.metrics.write(
                "decision",
                iteration=iteration,
                action="ramp",
                reason=reason,
                microbatches_before=list(before),
                microbatches=list(after),
                shares=None,
                plan=None,
                predicted_before_s=None,
                predicted_after_s=None,
                details={"paced": paced},
            )

    def data_decision(
        self,
        iteration,
        action,
        reason,
        before,
        after,
        predicted_before,
        predicted_after,
        details,
        plan=None,
        shares=None,
        moved: StageMove | None = None,
    ):
        """One line per decision over data-parallel replicas (--het-dp): a rebatch, or the
        joint policy's choice with the TP move or resize it comes with; JSONL `decision` with
        the micro-batch counts per replica before and after."""
        line = (
            f"> het-TP decision at iteration {iteration}: {action} ({reason}) | micro-batches "
            f"per replica {split_text(before)} -> {split_text(after)} | "
            f"predicted step {predicted_before * 1e3:.1f} ms -> {predicted_after * 1e3:.1f} ms"
        )
        if shares is not None and any(shares):
            line += " | resize shares " + ", ".join(f"{s:.0%}" for s in shares)
        if plan is not None:
            line += f" | plan {plan.summary()}"
        self.info(line + _moved_text(moved))
        if self.metrics is not None:
            self.metrics.write(
                "decision",
                iteration=iteration,
                action=action,
                reason=reason,
                microbatches_before=list(before),
                microbatches=list(after),
                shares=list(shares) if shares is not None else None,
                plan=plan.to_json() if plan is not None else None,
                predicted_before_s=predicted_before,
                predicted_after_s=predicted_after,
                details=details,
                **_moved_fields(moved),
            )


# Megatron-LM's timers (those megatron-core's schedule, gradient sync and optimizer start, and
# the training loop's own), in its order; pipeline send/receive timers included
TIMERS_TO_LOG = (
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "batch-generator",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
)


class WandbWriter:
    """Weights & Biases behind TensorBoard's add_scalar (Megatron-LM's flags, scalar names and
    steps): one run per job, its config the run's flags."""

    def __init__(self, args):
        import wandb

        folder = args.wandb_save_dir or os.path.join(args.save, "wandb")
        os.makedirs(folder, exist_ok=True)
        self.wandb = wandb
        wandb.init(
            dir=folder,
            name=args.wandb_exp_name,
            project=args.wandb_project,
            config={k: _jsonable(v) for k, v in sorted(vars(args).items())},
            **({"entity": args.wandb_entity} if args.wandb_entity else {}),
        )

    def add_scalar(self, tag, value, step) -> None:
        self.wandb.log({tag: value}, step=step)

    def close(self) -> None:
        self.wandb.finish()


class Scalars:
    """The scalar writers a run has (TensorBoard's --tensorboard-dir, --wandb-project): each
    gets every scalar."""

    def __init__(self, writers):
        self.writers = writers

    @classmethod
    def open(cls, args) -> Scalars | None:
        writers = []
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            writers.append(
                SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
            )
        if args.wandb_project:
            writers.append(WandbWriter(args))
        return cls(writers) if writers else None

    def add_scalar(self, tag, value, step) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def configure_logging(args) -> int | None:
    """--logging-level, else $MEGATRON_LOGGING_LEVEL (Megatron-LM's order): the root logger's
    level, with a handler so that the records reach stderr. Without either, Python's default
    (warnings and errors) stands. Returns the level set."""
    level = args.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.basicConfig(level=level)  # adds a stderr handler where the root has none
        logging.getLogger().setLevel(level)
    return level


class Logger:
    """The training log: Megatron-LM's run, iteration, evaluation and checkpoint lines; het-TP's
    records go through its `events`."""

    def __init__(self, args, metrics=None, timers=None):
        self.args = args
        self.timers = timers  # megatron-core's Timers (--timing-log-level), shared by the configs
        self.metrics = metrics  # MetricsWriter on rank 0, None elsewhere
        self.events = EventLog(metrics)
        self.is_printer = dist.get_rank() == 0
        self.writer = None
        failed = [None]
        if self.is_printer:
            try:
                self.writer = Scalars.open(args)
            except Exception as err:  # noqa: BLE001 - raised on every rank below
                failed = [f"{type(err).__name__}: {err}"]
        if args.tensorboard_dir or args.wandb_project:  # every rank learns how rank 0 fared
            dist.broadcast_object_list(failed, src=0)
        if failed[0] is not None:
            raise RuntimeError(
                f"rank 0 could not open --tensorboard-dir / --wandb-project: {failed[0]}"
            )
        self._window = []  # (loss, grad_norm, elapsed, batch) since the last interval's line
        self._first = True  # the job's first iteration is printed too (start-up cost shown)
        self._evaluated: set[tuple[str, int]] = set()  # (split, iteration) recorded
        self._skipped = 0
        self._nan = 0
        self._t0 = time.perf_counter()
        self._flops_per_sample = None  # with --log-throughput, from run_start

    def info(self, message: str) -> None:
        if self.is_printer:
            print(message, flush=True)

    def run_start(self, model, tokenizer, iteration, loaded_from) -> None:
        """`loaded_from`: which checkpoint the run loaded ("<folder> at iteration <n>"), if
        any."""
        args = self.args
        if args.log_throughput:
            self._flops_per_sample = model_flops_per_sample(args, tokenizer.vocab_size)
        params = sum(p.numel() for p in model.parameters())
        totals = torch.tensor([params], dtype=torch.long)
        if torch.cuda.is_available():
            totals = totals.cuda()
        dist.all_reduce(totals)
        self.info(
            f"> hettp {__version__} on megatron-core: world size {args.world_size}, "
            f"tensor-model-parallel size {args.tensor_model_parallel_size}, "
            f"pipeline-model-parallel size {args.pipeline_model_parallel_size}, "
            f"data-parallel size {args.data_parallel_size}, "
            f"{'CUDA' if torch.cuda.is_available() else 'CPU'} / {args.distributed_backend}"
        )
        self.info(
            f"> number of parameters on rank 0: {params}; summed over ranks: "
            f"{totals.item()}; micro-batches per step: {args.num_microbatches}"
        )
        if args.rampup_batch_size is not None:  # Megatron-LM's line
            start, increment, samples = args.rampup_batch_size
            self.info(
                f"will use batch size rampup starting from global batch size {start} to global "
                f"batch size {args.global_batch_size} with batch size increments {increment} "
                f"over {samples} samples; training iterations: {args.train_iters}"
            )
        if loaded_from:
            self.info(f"> loaded checkpoint from {loaded_from}")
        elif args.load:
            self.info(f"> no checkpoint under --load {args.load} yet: starting from iteration 0")
        if self.metrics is not None:
            self.metrics.write(
                "run",
                time=time.time(),
                version=__version__,
                world_size=args.world_size,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                data_parallel_size=args.data_parallel_size,
                start_iteration=iteration,
                parameters_rank0=params,
                tokenizer_vocab_size=tokenizer.vocab_size,
                device="cuda" if torch.cuda.is_available() else "cpu",
                args={k: _jsonable(v) for k, v in sorted(vars(args).items())},
            )

    def train_step(self, iteration, consumed, global_batch_size, step, lr, elapsed) -> None:
        """`step`: training.StepResult."""
        args = self.args
        loss, skipped = step.loss, step.skipped
        tokens_per_s = global_batch_size * args.seq_length / max(elapsed, 1e-12)
        grad_norm = float(step.grad_norm) if step.grad_norm is not None else float("nan")
        if self.metrics is not None:
            self.metrics.write(
                "train",
                iteration=iteration,
                consumed_samples=consumed,
                global_batch_size=global_batch_size,
                lm_loss=loss,
                grad_norm=grad_norm,
                loss_scale=step.loss_scale,
                lr=lr,
                skipped=bool(skipped),
                elapsed_ms=elapsed * 1000.0,
                tokens_per_s=tokens_per_s,
                **({"num_zeros": step.num_zeros} if step.num_zeros is not None else {}),
                **({"params_norm": step.params_norm} if step.params_norm is not None else {}),
            )
        if self.writer is not None and iteration % args.tensorboard_log_interval == 0:
            self.writer.add_scalar("lm loss", loss, iteration)
            self.writer.add_scalar("learning-rate", lr, iteration)
            self.writer.add_scalar("grad-norm", grad_norm, iteration)
            if args.log_loss_scale_to_tensorboard:
                self.writer.add_scalar("loss-scale", step.loss_scale, iteration)
            if args.log_world_size_to_tensorboard:
                self.writer.add_scalar("world-size", args.world_size, iteration)
            self.writer.add_scalar("iteration-time", elapsed, iteration)
            if step.num_zeros is not None:
                self.writer.add_scalar("num-zeros", step.num_zeros, iteration)
            if step.params_norm is not None:
                self.writer.add_scalar("params-norm", step.params_norm, iteration)
        self._skipped += int(skipped)
        self._nan += int(not math.isfinite(loss))
        self._window.append((loss, grad_norm, elapsed, global_batch_size))
        first, self._first = self._first, False
        interval = not iteration % args.log_interval or iteration == args.train_iters
        if not (interval or first):
            return
        n = len(self._window)
        mean_loss = sum(w[0] for w in self._window) / n
        mean_ms = 1000.0 * sum(w[2] for w in self._window) / n
        samples = sum(w[3] for w in self._window) / n  # per step (the batch may ramp up)
        tokens = samples * args.seq_length
        throughput = ""
        if self._flops_per_sample is not None:  # Megatron-LM's field: model TFLOP/s per GPU
            per_device = (
                (self._flops_per_sample * samples / (mean_ms / 1e3)) / args.world_size / 1e12
            )
            shown = f"{per_device:.1f}" if per_device >= 1 else f"{per_device:.4f}"  # CPU ranks
            throughput = f" throughput per GPU (TFLOP/s/GPU): {shown} |"
        norm = f" grad norm: {grad_norm:.3f} |" if step.grad_norm is not None else ""
        if step.num_zeros is not None:  # Megatron-LM's fields, in its order
            norm += f" num zeros: {step.num_zeros} |"
        if step.params_norm is not None:
            norm += f" params norm: {step.params_norm:.3f} |"
        line = (
            f" [{_stamp()}] iteration {iteration:8d}/{args.train_iters:8d} |"
            f" consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {mean_ms:.1f} |"
            f"{throughput}"
            f" tokens per second: {tokens * 1000.0 / mean_ms:.1f} |"
            f" learning rate: {lr:.6E} |"
            f" global batch size: {global_batch_size:5d} |"
            f" lm loss: {mean_loss:.6E} |"
            f" loss scale: {step.loss_scale:.1f} |"
            f"{norm}"
            f" number of skipped iterations: {self._skipped:3d} |"
            f" number of nan iterations: {self._nan:3d} |"
        )
        self.info(line)
        if interval:  # as Megatron-LM, the first line's steps count in the next line's means
            self._log_timers(iteration, n)
            self._window, self._skipped, self._nan = [], 0, 0

    def _log_timers(self, iteration: int, steps: int) -> None:
        """megatron-core's timers over the interval's `steps`, as Megatron-LM prints them (and
        writes their max over ranks). Collective: every rank reaches every interval."""
        if self.timers is None or not self.args.timing_log_level:
            return
        if self.args.log_timers_to_tensorboard:
            # Timers.write's max over ranks (seconds a step), one gather for every writer
            # (megatron-core's write takes a SummaryWriter or the wandb module only)
            times = self.timers._get_global_min_max_time(TIMERS_TO_LOG, False, False, steps)
            if self.writer is not None:
                for name, (_, most) in times.items():
                    self.writer.add_scalar(f"{name}-time", most, iteration)
        # gathered on every rank, printed by rank 0 with the iteration lines (megatron-core's
        # Timers.log goes to its logger, which a run does not print)
        text = self.timers.get_all_timers_string(TIMERS_TO_LOG, normalizer=steps)
        if text is not None:
            self.info(text)

    def evaluation(self, iteration, loss, split: str | None = None) -> None:
        """Megatron-LM's lines: "at iteration N" in the loop, "at iteration N on validation
        set" / "on test set" after it (the word "validation" in both, as there). A split's loss
        is recorded once an iteration (the final validation repeats the loop's last)."""
        ppl = math.exp(min(20.0, loss))
        where = f"iteration {iteration}" + (f" on {split} set" if split else "")
        text = (
            f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        )
        rule = "-" * (len(text) + 1)
        self.info(f"{rule}\n{text}\n{rule}")
        split = split or "validation"
        if (split, iteration) in self._evaluated:
            return
        self._evaluated.add((split, iteration))
        if self.metrics is not None:
            self.metrics.write("eval", iteration=iteration, lm_loss=loss, ppl=ppl, split=split)
        if self.writer is not None:
            self.writer.add_scalar(f"lm loss {split}", loss, iteration)
            if self.args.log_validation_ppl_to_tensorboard:
                self.writer.add_scalar(f"lm loss {split} ppl", ppl, iteration)

    def saved(self, iteration, path) -> None:
        self.info(f"  successfully saved checkpoint from iteration {iteration:7d} to {path}")
        if self.metrics is not None:
            self.metrics.write("checkpoint", iteration=iteration, path=path)

    def run_end(self, iteration) -> None:
        total = time.perf_counter() - self._t0
        self.info(f"> training finished at iteration {iteration} after {total:.1f} s")
        if self.metrics is not None:
            self.metrics.write("end", iteration=iteration, seconds=total)
        self.close()
        sys.stdout.flush()

    def close(self) -> None:
        """The scalar writers (once; an error path closes them too)."""
        if self.writer is not None:
            self.writer, writer = None, self.writer
            writer.close()


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "to_json"):  # e.g. the parsed --het-tp-plan: as data, not its repr
        return json.loads(value.to_json())
    return str(value)

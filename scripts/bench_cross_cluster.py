#!/usr/bin/env python
"""The cross-cluster planner's predictions against real runs over a rate-limited link.

    python scripts/bench_cross_cluster.py [--rate-mbit 50] [--ranks 1,1] [--iters 8] [--all]

Two sites in network namespaces (scripts/netlab.py; root), joined by a tbf-limited link. The
planner (hettp/sim/geo.py) gets the sites, the link (its rate, at the 95.6% of it that TCP
delivers through tbf) and this machine's compute, measured by one single-rank run of the
same model (its step over its micro-batches, as an effective FLOP rate); it picks the grid and
splits, and names what a planner blind to the sites would run. Both (with --all: every grid it
priced) then train for real with pretrain_gpt.py across the sites; prints predicted and
measured step times side by side, their ratio, and the chosen layout's measured speedup over
the baseline's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hettp.sim.engine import Costs, Layout, flop_costs  # noqa: E402
from hettp.sim.geo import GeoLayout, Site, plan_sites  # noqa: E402
from hettp.sim.network import Fabric, Link  # noqa: E402
from hettp.sim.workload import ModelSpec  # noqa: E402


def model_flags(hidden: int = 256) -> list[str]:
    return (
        f"--num-layers 4 --hidden-size {hidden} --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 "
        "--mock-data --vocab-size 255 --hidden-dropout 0 --attention-dropout 0 --seed 1234"
        " --eval-iters 0"
    ).split()


MODEL = model_flags()
# The link as a user would describe it to the planner: its nominal rate, of which TCP carries
# 1448 payload bytes in every 1514-byte frame, and its latency (the veth pair's own: netem,
# which would add more, is not in every kernel); gloo inside a site runs over loopback at
# hettp.transfer's fitted point-to-point speed.
TCP_SHARE = 1448 / 1514
WAN_ALPHA = 1e-4
LOOPBACK = Link(alpha=5e-5, beta=1.3e9)


def _netlab():
    spec = importlib.util.spec_from_file_location(
        "netlab", os.path.join(ROOT, "scripts", "netlab.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["netlab"] = module
    spec.loader.exec_module(module)
    return module


def model_microbatches(flags: list[str]) -> int:
    """The global batch in micro-batches."""
    value = {a: b for a, b in zip(flags, flags[1:])}
    return int(value["--global-batch-size"]) // int(value["--micro-batch-size"])


def cpu_model(flags: list[str]) -> ModelSpec:
    """The model on CPU: fp32 weights, gradients and activations; two Adam moments."""
    return ModelSpec.from_megatron_args(flags, state_bytes=12, grad_bytes=4, activation_bytes=4)


def _flags(model: list[str], layout: GeoLayout, iters: int) -> list[str]:
    """Megatron's flags for a planned layout (micro-batches even over its replicas)."""
    if len(set(layout.counts)) > 1:
        raise ValueError(f"uneven micro-batches {layout.counts}: needs --het-dp (not timed here)")
    return _grid_flags(model, layout.tp, layout.pp, layout.layers, iters)


def _grid_flags(model: list[str], tp: int, pp: int, layers, iters: int) -> list[str]:
    flags = model + [
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--train-iters",
        str(iters),
        "--log-interval",
        str(iters),
    ]
    if len(set(layers[1:-1])) > 1:
        raise ValueError(f"layers {layers}: Megatron's flags set the first and last only")
    if pp > 1 and len(set(layers)) > 1:
        flags += [
            "--decoder-first-pipeline-num-layers",
            str(layers[0]),
            "--decoder-last-pipeline-num-layers",
            str(layers[-1]),
        ]
    return flags


@dataclasses.dataclass(frozen=True)
class Compute:
    """This machine's compute as the planner prices it: an effective FLOP rate, a micro-batch's
    FLOPs over its seconds (what a step spends besides its micro-batches is counted in them:
    on one CPU rank it is within the runs' noise, and a difference of two runs' steps to
    separate it is noisier than it is large)."""

    flops: float

    def costs(self, model: ModelSpec, layout: Layout) -> Costs:
        return dataclasses.replace(flop_costs(model, layout, self.flops), optimizer_per_param=0.0)


def measure_compute(netlab, model: ModelSpec, flags: list[str], iters: int, work: str) -> Compute:
    """One single-rank run of the model at the job's micro-batches a step."""
    mbs = model_microbatches(flags)
    with netlab.TwoSites(None) as sites:
        job = netlab.launch(
            sites,
            (1, 0),
            _grid_flags(flags, 1, 1, (model.num_layers,), iters),
            os.path.join(work, "one"),
            600,
        )
    step = netlab.steady(netlab.step_seconds(job.metrics))
    unit = flop_costs(model, Layout(1), 1.0)
    flops = (
        model.num_layers
        * (
            model.query_groups * unit.unit_seconds["attn"]
            + model.mlp_units * unit.unit_seconds["mlp"]
        )
        + unit.stage_extra[-1]
    )
    return Compute(flops * mbs / step)


def check(
    rate_mbit: float,
    ranks: tuple[int, int],
    iters: int,
    every: bool,
    work: str,
    flags: list[str] = MODEL,
) -> dict:
    """Plan the sites, run the chosen and the baseline layout (`every`: all priced) across
    the limited link; predicted and measured step times."""
    netlab = _netlab()
    reason = netlab.unavailable()
    if reason is not None:
        raise SystemExit(f"bench_cross_cluster.py: network namespaces unavailable: {reason}")
    model = cpu_model(flags)
    compute = measure_compute(netlab, model, flags, iters, work)
    sites = [Site("A", ranks[0]), Site("B", ranks[1])]
    fabric = Fabric(
        gpus_per_node=max(ranks),
        intra_node=LOOPBACK,
        inter_node=LOOPBACK,
        inter_cluster=Link(WAN_ALPHA, TCP_SHARE * rate_mbit * 1e6 / 8),
    )

    def costs(layout):
        return compute.costs(model, layout)

    microbatches = model_microbatches(flags)
    plan = plan_sites(model, sites, fabric, costs, microbatches, gpu_memory=None)
    runs = {"chosen": plan.chosen, "baseline": plan.baseline}
    if every:
        for i, c in enumerate(plan.candidates):
            if c not in runs.values():
                runs[f"candidate {i}"] = c
    rows = []
    with netlab.TwoSites(rate_mbit) as lab:
        for name, layout in runs.items():
            job = netlab.launch(
                lab,
                ranks,
                _flags(flags, layout, iters),
                os.path.join(work, name.replace(" ", "_")),
                900,
            )
            measured = netlab.steady(netlab.step_seconds(job.metrics))
            rows.append(
                {
                    "run": name,
                    "layout": layout.summary(),
                    "predicted_s": layout.predicted_s,
                    "measured_s": measured,
                    "ratio": layout.predicted_s / measured,
                    "crossed_mb_per_step": (job.bytes_a_to_b + job.bytes_b_to_a) / 1e6 / iters,
                }
            )
    chosen, baseline = rows[0], rows[1]
    return {
        "rate_mbit": rate_mbit,
        "ranks": list(ranks),
        "iters": iters,
        "cpu_gflops": compute.flops / 1e9,
        "rows": rows,
        "measured_speedup": baseline["measured_s"] / chosen["measured_s"],
        "predicted_speedup": plan.speedup,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=float, default=50.0)
    p.add_argument("--ranks", default="1,1", help="ranks in site A,B")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--all", action="store_true", help="also run every other grid priced")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument(
        "--hidden-size", type=int, default=256, help="of the model (smaller: fewer bytes to move)"
    )
    a = p.parse_args(argv)
    ranks = tuple(int(x) for x in a.ranks.split(","))
    with tempfile.TemporaryDirectory() as work:
        result = check(a.rate_mbit, ranks, a.iters, a.all, work, model_flags(a.hidden_size))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if a.json:
        print(json.dumps(result))
        return 0
    print(
        f"{ranks[0]}+{ranks[1]} CPU ranks in two sites, {a.rate_mbit:g} Mbit/s between them; "
        f"compute measured at {result['cpu_gflops']:.1f} GFLOP/s a rank"
    )
    print(
        f"{'run':12s} {'predicted s':>11s} {'measured s':>10s} {'ratio':>6s} "
        f"{'MB/step':>8s}  layout"
    )
    for r in result["rows"]:
        print(
            f"{r['run']:12s} {r['predicted_s']:11.3f} {r['measured_s']:10.3f} {r['ratio']:6.2f} "
            f"{r['crossed_mb_per_step']:8.2f}  {r['layout']}"
        )
    print(
        f"chosen vs baseline: measured {result['measured_speedup']:.2f}x, predicted "
        f"{result['predicted_speedup']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Het-TP policies at scale, simulated: a Megatron GPT job of TP x PP x DP over a straggler
trace, with the project's own detector and planner deciding on simulated timing reports.

    python scripts/simulate.py [--gpus 4096] [--tp 8] [--pp 8] [--model llama-70b]
                               [--trace production] [--steps 1000] [--seed 0]
                               [--het-tp-granularity 128] [--het-tp-attn-granularity 0]
                               [--policies none,resize,migrate,hybrid,rebatch,joint]
                               [--het-migration-budget 0.05] [--json]
    python scripts/simulate.py --calibrate results/compare/report.json [--json]
    python scripts/simulate.py --sites A:1024:1.0,B:1024:0.6 [--inter-site-gbps 100]
                               [--inter-site-ms 5] [--global-microbatches 256] [--json]

`--trace` is `production` (a seeded draw of the straggler mix production studies report:
hettp/sim/traces.py) or a scripts/compare.py scenario (a built-in name or a JSON file), laid
over the job's global ranks. The step model, its defaults (a GPU that sustains --gpu-tflops,
NVLink in a node, InfiniBand between nodes) and what it leaves out are in hettp/sim/engine.py.
`--calibrate` replays a measured comparison instead and prints how far the predicted step
times are from the measured ones (hettp/sim/calibrate.py). `--sites` plans a job over
clusters of their own GPU speed joined by a slower link instead (hettp/sim/geo.py): the grid,
layers per stage and micro-batches per replica it predicts fastest, against what a planner that
took the sites for one homogeneous cluster would run. `--json` prints one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hettp.config import DEFAULT_MIGRATION_BUDGET  # noqa: E402
from hettp.scenarios import ScenarioError, resolve  # noqa: E402
from hettp.sim.calibrate import replay  # noqa: E402
from hettp.sim.engine import (  # noqa: E402
    POLICIES,
    Layout,
    SimError,
    applicable,
    flop_costs,
    refusal,
    simulate,
    summary,
)
from hettp.sim.geo import Site, plan_sites  # noqa: E402
from hettp.sim.network import Fabric, Link  # noqa: E402
from hettp.sim.traces import from_scenario, production  # noqa: E402
from hettp.sim.workload import MODELS, WorkloadError  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=4096, help="GPUs in the job (TP x PP x DP)")
    p.add_argument("--tp", type=int, default=8, help="--tensor-model-parallel-size")
    p.add_argument("--pp", type=int, default=8, help="--pipeline-model-parallel-size")
    p.add_argument("--model", default="llama-70b", choices=sorted(MODELS))
    p.add_argument(
        "--het-tp-granularity",
        type=int,
        default=128,
        help="ffn neurons per MLP unit (as the trainer's flag)",
    )
    p.add_argument(
        "--het-tp-attn-granularity",
        type=int,
        default=0,
        help="query heads per attention unit (as the trainer's flag; 0: whole query groups, "
        "whose K/V a rank holding any head of the group then computes as a replica)",
    )
    p.add_argument(
        "--het-tp-memory-cap",
        type=float,
        default=None,
        metavar="F",
        help="as the trainer's flag: no rank holds more than F times the even split's unit "
        "state (layers then stay in their stages)",
    )
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per replica")
    p.add_argument("--trace", default="production", help="production, or a compare.py scenario")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0, help="seed of the production trace")
    p.add_argument(
        "--policies",
        help=f"comma-separated from {', '.join(POLICIES)} (default: every one the layout can "
        "run: rebatch and joint need data-parallel replicas, joint runs without stages, as "
        "--het-tp-policy joint)",
    )
    p.add_argument(
        "--het-migration-budget",
        type=float,
        default=DEFAULT_MIGRATION_BUDGET,
        help="the joint policy's budget: at most this share of training time spent moving "
        "state (as the trainer's flag)",
    )
    p.add_argument("--het-tp-interval", type=int, default=10, help="steps per report")
    p.add_argument("--gpu-tflops", type=float, default=400.0, help="sustained TFLOP/s per GPU")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="with --sites: per GPU")
    p.add_argument("--calibrate", metavar="REPORT_JSON", help="replay a measured comparison")
    p.add_argument(
        "--speeds",
        choices=("timed", "step"),
        default="timed",
        help="with --calibrate: a slow rank's slowdown as its timed compute says (timed) or "
        "as the vanilla step time implies (step)",
    )
    p.add_argument(
        "--sites",
        help="cross-cluster planning: NAME:GPUS:SPEED,... (speed relative to the fastest GPU)",
    )
    p.add_argument("--inter-site-gbps", type=float, default=100.0, help="link between sites")
    p.add_argument("--inter-site-ms", type=float, default=5.0, help="one-way latency between sites")
    p.add_argument(
        "--global-microbatches",
        type=int,
        default=256,
        help="with --sites: the global batch in micro-batches",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    if args.sites:
        try:
            args.site_list = parse_sites(args.sites)
        except (ValueError, SimError) as err:
            p.error(f"--sites {args.sites}: {err}")
        if args.inter_site_gbps <= 0 or args.inter_site_ms < 0:
            p.error("--inter-site-gbps must be positive and --inter-site-ms non-negative")
    for name in ("gpus", "tp", "pp", "microbatches", "het_tp_interval", "gpus_per_node"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first step is left out), got {args.steps}")
    if args.gpus % (args.tp * args.pp):
        p.error(f"--gpus {args.gpus} is not a multiple of --tp x --pp = {args.tp * args.pp}")
    layout = Layout(args.tp, args.pp, args.gpus // (args.tp * args.pp))
    if args.policies is None:
        args.policy_list = list(applicable(layout))
    else:
        args.policy_list = args.policies.split(",")
        unknown = set(args.policy_list) - set(POLICIES)
        if unknown:
            p.error(
                f"--policies: unknown {', '.join(sorted(unknown))}; "
                f"choose from {', '.join(POLICIES)}"
            )
        for policy in args.policy_list:
            refused = refusal(policy, layout)
            if refused and not (args.calibrate or args.sites):
                p.error(f"--policies: {refused}")
    if not 0.0 <= args.het_migration_budget <= 1.0:
        p.error(f"--het-migration-budget must be within [0, 1], got {args.het_migration_budget}")
    if args.gpu_tflops <= 0:
        p.error(f"--gpu-tflops must be positive, got {args.gpu_tflops}")
    return args


def parse_sites(text: str) -> list[Site]:
    sites = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"'{item}' is not NAME:GPUS:SPEED")
        sites.append(Site(parts[0], int(parts[1]), float(parts[2])))
    if len(sites) < 2:
        raise ValueError("give at least two sites")
    return sites


def _model(args):
    return dataclasses.replace(
        MODELS[args.model],
        mlp_unit=args.het_tp_granularity,
        attn_unit=args.het_tp_attn_granularity,
    )


def geo(args) -> dict:
    model = _model(args)
    fabric = Fabric(
        args.gpus_per_node,
        inter_cluster=Link(args.inter_site_ms / 1e3, args.inter_site_gbps * 1e9 / 8),
    )
    flops = args.gpu_tflops * 1e12
    plan = plan_sites(
        model,
        args.site_list,
        fabric,
        lambda layout: flop_costs(model, layout, flops),
        args.global_microbatches,
        gpu_memory=args.gpu_memory_gb * 1e9,
    )

    def row(layout):
        return {
            "tp": layout.tp,
            "pp": layout.pp,
            "dp": layout.dp,
            "layers": list(layout.layers),
            "microbatches": list(layout.counts),
            "stages_per_site": list(layout.stages_per_site),
            "crossing": list(layout.crossing),
            "cross_gb_per_step": round(layout.cross_bytes / 1e9, 3),
            "predicted_s": round(layout.predicted_s, 5),
            "summary": layout.summary(),
        }

    return {
        "sites": [dataclasses.asdict(s) for s in args.site_list],
        "model": args.model,
        "inter_site_gbps": args.inter_site_gbps,
        "chosen": row(plan.chosen),
        "baseline": row(plan.baseline),
        "speedup": round(plan.speedup, 4),
        "candidates": [row(c) for c in plan.candidates],
    }


def calibrate(args) -> dict:
    rows = replay(args.calibrate, args.speeds)
    predicted = [r for r in rows if not r.fitted]
    if not predicted:
        raise ValueError(f"{args.calibrate}: no row to predict (only vanilla runs)")
    worst = max(predicted, key=lambda r: r.rel_error)
    return {
        "report": args.calibrate,
        "speeds": args.speeds,
        "rows": [
            {
                "scenario": r.scenario,
                "policy": r.policy,
                "measured_s": round(r.measured_s, 5),
                "predicted_s": round(r.predicted_s, 5),
                "rel_error": round(r.rel_error, 4),
                "fitted": r.fitted,
            }
            for r in rows
        ],
        "max_rel_error": round(worst.rel_error, 4),
        "max_rel_error_fitted": round(max((r.rel_error for r in rows if r.fitted), default=0), 4),
        "worst": f"{worst.scenario}/{worst.policy}",
    }


def run(args) -> dict:
    layout = Layout(args.tp, args.pp, args.gpus // (args.tp * args.pp))
    model = _model(args)
    if args.trace == "production":
        trace = production(layout.world, args.steps, args.seed)
    else:
        specs = resolve(args.trace, args.tp, args.steps, "--trace", args.pp, layout.dp)
        if len(specs) != 1:
            raise ScenarioError(f"--trace names {len(specs)} scenarios; give one")
        trace = from_scenario(specs[0], args.tp, args.pp, layout.dp, args.steps)
    costs = flop_costs(model, layout, args.gpu_tflops * 1e12)
    began = time.perf_counter()
    results = simulate(
        model,
        layout,
        costs,
        trace,
        args.policy_list,
        args.steps,
        fabric=Fabric(gpus_per_node=args.gpus_per_node),
        microbatches=args.microbatches,
        interval=args.het_tp_interval,
        budget=args.het_migration_budget,
        memory_cap=args.het_tp_memory_cap,
    )
    per_policy = {p: summary(r) for p, r in results.items()}
    return {
        "gpus": layout.world,
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "model": args.model,
        "granularity": args.het_tp_granularity,
        "attn_granularity": args.het_tp_attn_granularity,
        "memory_cap": args.het_tp_memory_cap,
        "trace": trace.name,
        "slow_gpus": len(trace.touched),
        "steps": args.steps,
        "migration_budget": args.het_migration_budget,
        "E": {p: s["E"] for p, s in per_policy.items()},
        "planner_seconds": max(s["planner_seconds"] for s in per_policy.values()),
        "policies": per_policy,
        "seconds": round(time.perf_counter() - began, 2),
    }


def text(result: dict) -> str:
    if "chosen" in result:
        sites = ", ".join(
            f"{s['name']}: {s['gpus']} GPUs at {s['speed']:g}" for s in result["sites"]
        )
        lines = [
            f"{result['model']} over {sites}; {result['inter_site_gbps']:g} Gb/s between sites",
            "",
            f"{'':9s} {'step s':>8s} {'GB/step across':>15s}  layout",
        ]
        for name, r in [("chosen", result["chosen"]), ("baseline", result["baseline"])] + [
            ("", c) for c in result["candidates"][1:]
        ]:
            lines.append(
                f"{name:9s} {r['predicted_s']:8.3f} {r['cross_gb_per_step']:15.2f}  {r['summary']}"
            )
        lines.append(f"\nchosen vs homogeneous baseline: {result['speedup']:.2f}x")
        return "\n".join(lines)
    if "rows" in result:
        lines = [f"replay of {result['report']} (speeds: {result['speeds']})", ""]
        lines.append(
            f"{'scenario':16s} {'policy':9s} {'measured ms':>12s} "
            f"{'predicted ms':>13s} {'error':>7s}"
        )
        for r in result["rows"]:
            lines.append(
                f"{r['scenario']:16s} {r['policy']:9s} {r['measured_s'] * 1e3:12.1f} "
                f"{r['predicted_s'] * 1e3:13.1f} {r['rel_error']:7.1%}"
                + ("  (fitted: its runs gave the speeds or T_fast)" if r["fitted"] else "")
            )
        lines.append(
            f"\nmax relative error of the predicted rows {result['max_rel_error']:.1%} "
            f"({result['worst']}); of the fitted rows {result['max_rel_error_fitted']:.1%}"
        )
        return "\n".join(lines)
    lines = [
        f"{result['gpus']} GPUs (TP={result['tp']} PP={result['pp']} DP={result['dp']}), "
        f"{result['model']}, {result['steps']} steps of trace {result['trace']} "
        f"({result['slow_gpus']} GPUs slow at some step); simulated in {result['seconds']} s",
        "",
        f"{'policy':9s} {'E':>6s} {'step s':>8s} {'decisions':>9s} {'moving s':>9s} "
        f"{'planner s/report (max)':>22s}",
    ]
    for p, s in result["policies"].items():
        lines.append(
            f"{p:9s} {s['E']:6.3f} {s['step_s']:8.3f} {s['decisions']:9d} {s['moved_s']:9.2f} "
            f"{s['planner_seconds_mean']:11.4f} ({s['planner_seconds']:.4f})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.calibrate:
            result = calibrate(args)
        elif args.sites:
            result = geo(args)
        else:
            result = run(args)
    except (SimError, WorkloadError, ScenarioError, ValueError, OSError) as err:
        print(f"simulate.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

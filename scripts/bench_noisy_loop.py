"""The control loop on noisy per-step timings (hettp.sim.noisy), side by side: for each per-step
noise level, straggler factor and kind (emulated: only the sharded work slowed, as
--het-tp-emulate; device: all of the rank's compute), over --runs seeds, how many runs ended a
persistent straggle while it lasted, took a fast rank for the slow one, and the steady E
(the best split's step over the loop's) at the worst tenth and the median. Pure and fast: no
process group; it shows what the loop does with timings this noisy, not a machine's speed.

    python scripts/bench_noisy_loop.py [--runs 30] [--policies migrate,hybrid]
    python scripts/bench_noisy_loop.py --tp 4 --slow-rank 2 --noise 0.1,0.2 --factors 1.5,2,3
    python scripts/bench_noisy_loop.py --tp 4 --slow-rank 1 --stop 23   # the end: how soon back

With --stop the straggle ends at that step, and each row says in how many runs the split was
back (within hettp.loop.NEAR_EVEN of even) by the second normal step, and in how many it never
came back in the 20 steps after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hettp.sim.noisy import straggle  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30, help="seeds per row")
    p.add_argument("--policies", default="migrate,hybrid")
    p.add_argument("--noise", default="0.05,0.1,0.15,0.25", help="per-step noise levels")
    p.add_argument("--factors", default="1.5,2.5,4", help="straggler factors")
    p.add_argument("--tp", type=int, default=2, help="TP group size")
    p.add_argument("--slow-rank", type=int, default=0, help="the straggling rank")
    p.add_argument("--stop", type=int, default=None, help="the straggle's first normal step")
    a = p.parse_args(argv)
    if a.stop is not None and a.stop <= 10:
        p.error(f"--stop must be after the onset (step 8) and its first move, got {a.stop}")
    if a.tp < 2 or not 0 <= a.slow_rank < a.tp:
        p.error(f"need --tp >= 2 and 0 <= --slow-rank < --tp, got {a.tp} and {a.slow_rank}")
    if a.runs < 10:
        p.error(f"--runs must be >= 10 (a tenth of them is a row's worst), got {a.runs}")
    try:
        noises = [float(x) for x in a.noise.split(",")]
        factors = [float(x) for x in a.factors.split(",")]
    except ValueError as err:
        p.error(f"--noise and --factors take comma-separated numbers: {err}")
    policies = [x for x in a.policies.split(",") if x]
    bad = [x for x in policies if x not in ("migrate", "hybrid", "resize")]
    if bad:
        p.error(f"--policies: unknown {bad}; choose from migrate, hybrid, resize")
    if a.stop is None:
        print(
            f"{'noise':>5} {'factor':>6} {'kind':>8} {'policy':>8} {'ended':>6} {'swapped':>7} "
            f"{'moves':>5} {'E p10':>6} {'E med':>6}"
        )
    else:
        print(f"{'noise':>5} {'factor':>6} {'kind':>8} {'policy':>8} {'back <= 2':>9} {'never':>6}")
    for noise in noises:
        for factor in factors:
            for sharded_only in (True, False):
                for policy in policies:
                    runs = [
                        straggle(
                            policy,
                            factor,
                            noise,
                            seed,
                            sharded_only,
                            tp=a.tp,
                            slow_rank=a.slow_rank,
                            **({} if a.stop is None else {"stop": a.stop, "steps": a.stop + 20}),
                        )
                        for seed in range(a.runs)
                    ]
                    es = sorted(r.steady_e for r in runs)
                    kind = "emulated" if sharded_only else "device"
                    if a.stop is not None:
                        lags = [r.restored - a.stop for r in runs if r.restored is not None]
                        print(
                            f"{noise:>5.2f} {factor:>6.1f} {kind:>8} {policy:>8} "
                            f"{sum(lag <= 2 for lag in lags):>6}/{a.runs:<2} "
                            f"{len(runs) - len(lags):>3}/{a.runs:<2}",
                            flush=True,
                        )
                        continue
                    print(
                        f"{noise:>5.2f} {factor:>6.1f} {kind:>8} "
                        f"{policy:>8} {sum(r.ended for r in runs):>3}/{a.runs:<2} "
                        f"{sum(r.swapped for r in runs):>4}/{a.runs:<2} "
                        f"{statistics.median(len(r.decisions) for r in runs):>5.1f} "
                        f"{es[len(es) // 10]:>6.3f} {statistics.median(es):>6.3f}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

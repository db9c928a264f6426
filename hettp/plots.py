"""PNG plots of a comparison: step time over iterations with straggler windows shaded and the
ideal bound dashed, one line per policy; and loss curves. matplotlib (Agg) is imported here
only, so the rest of hettp does not need it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .report import PLAIN, VANILLA, Run, ideal_step


def _per_iteration_median(runs: Sequence[Run], field: str) -> tuple[list[int], list[float]]:
    its = sorted(set.intersection(*(set(getattr(r, field)) for r in runs)))
    return its, [statistics.median(getattr(r, field)[i] for r in runs) for i in its]


def _windows(slowed: Sequence[bool]) -> list[tuple[int, int]]:
    """Iteration ranges [start, end] (1-based) where some rank is slow."""
    out, start = [], None
    for i, slow in enumerate(list(slowed) + [False], 1):
        if slow and start is None:
            start = i
        elif not slow and start is not None:
            out.append((start, i - 1))
            start = None
    return out


def plot(
    runs: Sequence[Run],
    speeds: dict[str, list[tuple[float, ...]]],
    baseline: dict,
    bounds: dict[str, dict],
    step_png: str,
    loss_png: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r.scenario for r in runs))
    policies = list(dict.fromkeys(r.policy for r in runs))
    stages = max((r.stages for r in runs), default=1)  # one size: the report checks
    colors = {p: plt.get_cmap("tab10")(k % 10) for k, p in enumerate(policies)}
    for png, field, ylabel in (
        (step_png, "step_s", "step time (ms)"),
        (loss_png, "loss", "lm loss"),
    ):
        fig, axes = plt.subplots(
            len(scenarios), 1, figsize=(9, 2.6 * len(scenarios) + 0.6), squeeze=False, sharex=True
        )
        for ax, scenario in zip(axes[:, 0], scenarios):
            windows = _windows([min(s) < 1.0 for s in speeds[scenario]])
            for k, (start, end) in enumerate(windows):
                ax.axvspan(
                    start - 0.5,
                    end + 0.5,
                    color="0.88",
                    lw=0,
                    label="straggler" if k == 0 else None,
                )
            top = 0.0  # the first step (warm-up) is left off the y range
            for policy in policies:
                group = [r for r in runs if r.scenario == scenario and r.policy == policy]
                if not group:
                    continue
                its, values = _per_iteration_median(group, field)
                scale = 1e3 if field == "step_s" else 1.0
                vanilla = policy in (PLAIN, VANILLA)  # wide and pale: lossless ones lie on it
                ax.plot(
                    its,
                    [v * scale for v in values],
                    color=colors[policy],
                    lw=3.5 if vanilla else 1.3,
                    alpha=0.45 if vanilla else 1.0,
                    zorder=1 if vanilla else 2,
                    label=policy,
                )
                later = [v * scale for i, v in zip(its, values) if i > 1]
                top = max(top, max(later, default=0.0))
            if field == "step_s":
                its = range(1, len(speeds[scenario]) + 1)
                ax.plot(
                    its,
                    [
                        1e3
                        * ideal_step(
                            baseline["t_fast_s"],
                            bounds[scenario]["slowed_s"],
                            s,
                            bounds[scenario]["movable_s"],
                            stages,  # the report's bound: the slowest stage paces the step
                        )
                        for s in speeds[scenario]
                    ],
                    "k--",
                    lw=0.9,
                    label="T_ideal",
                )
            if field == "step_s" and top > 0:
                ax.set_ylim(0, 1.15 * top)
            ax.set_title(scenario, fontsize=10, loc="left")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        handles = {}
        for ax in axes[:, 0]:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, handle)
        fig.legend(
            handles.values(), handles.keys(), fontsize=8, ncol=len(handles), loc="upper center"
        )
        axes[-1, 0].set_xlabel("iteration (medians over repeats)")
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
        fig.savefig(png, dpi=110)
        plt.close(fig)

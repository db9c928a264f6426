"""The het-TP policies and what each one needs: the one table every caller consults.

Adding a policy: add a row here, and (when it `decides`) its decision rule in
hettp/planner.py's `Planner._RULES`; the flag's choices and help, the runtime's components and
scripts/compare.py's policy list all follow from this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    name: str
    help: str
    layers: str  # "vanilla": megatron-core's own layers only; "het": implies --het-tp; "any"
    times: bool  # timed every report interval although it decides nothing (a baseline)
    decides: bool  # a planner acts on detected stragglers (unless fixed shares replace it)
    resizes: bool  # may skip units: keeps unit priorities (a Resizer) and scores them
    migrates: bool  # may move units between ranks
    fixed_shares: bool  # takes --het-tp-resize; fixed shares replace the planner's decisions
    cut: float | None = None  # the only share it resizes a straggler to (the paper baseline)
    impute: float | None = None  # gradient given to skipped units instead of freezing them
    scorer: str | None = None  # the priority scorer it requires
    rebatches: bool = False  # splits each global batch over data-parallel replicas by speed

    @property
    def vanilla(self) -> bool:
        return self.layers == "vanilla"


# Gradient the paper's public code gives skipped units ("data imputation").
ZERO_IMPUTED_GRAD = 1e-8

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy(
            "none",
            "vanilla megatron-core layers, timed (the baseline of a comparison)",
            layers="vanilla",
            times=True,
            decides=False,
            resizes=False,
            migrates=False,
            fixed_shares=False,
        ),
        Policy(
            "static",
            "the given --het-tp-plan and --het-tp-resize for the whole run",
            layers="any",
            times=False,
            decides=False,
            resizes=False,
            migrates=False,
            fixed_shares=True,
        ),
        Policy(
            "resize",
            "a detected straggler skips its lowest-priority units",
            layers="het",
            times=False,
            decides=True,
            resizes=True,
            migrates=False,
            fixed_shares=False,
        ),
        Policy(
            "migrate",
            "units and their optimizer state move off a detected straggler",
            layers="het",
            times=False,
            decides=True,
            resizes=False,
            migrates=True,
            fixed_shares=False,
        ),
        Policy(
            "hybrid",
            "resize at once; migrate when the straggle is predicted to repay the "
            "move, then undo the resize",
            layers="het",
            times=False,
            decides=True,
            resizes=True,
            migrates=True,
            fixed_shares=False,
        ),
        Policy(
            "zero",
            "the paper's public-code baseline: a fixed 50% cut by accumulated |dW| "
            "with imputed gradients, of the ranks --het-tp-resize names, else of detected "
            "stragglers",
            layers="het",
            times=False,
            decides=True,
            resizes=True,
            migrates=False,
            fixed_shares=True,
            cut=0.5,
            impute=ZERO_IMPUTED_GRAD,
            scorer="dw",
        ),
        Policy(
            "rebatch",
            "the data-parallel replicas run micro-batch counts that follow their measured speeds "
            "(implies --het-dp; the TP split stays)",
            layers="any",
            times=True,
            decides=False,
            resizes=False,
            migrates=False,
            fixed_shares=False,
            rebatches=True,
        ),
        Policy(
            "joint",
            "at each report, nothing, a rebatch over data-parallel replicas (implies --het-dp), "
            "a migration of the shared plan or a resize, whichever is predicted best within "
            "--het-migration-budget",
            layers="het",
            times=False,
            decides=True,
            resizes=True,
            migrates=True,
            fixed_shares=False,
            rebatches=True,
        ),
    )
}

# The policy that runs megatron-core's own layers: a comparison's baseline.
VANILLA = next(name for name, p in POLICIES.items() if p.vanilla)


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown het-TP policy '{name}'; choose from {', '.join(POLICIES)}"
        ) from None


def compared_policies() -> list[str]:
    """What a comparison can run: the vanilla baseline and every policy that decides (TP units
    or the data split)."""
    return [name for name, p in POLICIES.items() if p.vanilla or p.decides or p.rebatches]

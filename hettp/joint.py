"""Joint online control of the data split and the TP partition (seed 002), pure.

At each report the controller weighs doing nothing, rebatching the data-parallel replicas,
re-partitioning the TP groups' shared plan (balanced for the slowest replica at each TP
position, or for one replica, the others then rebatched around it) and resizing, each with the
rebatch that suits it. Each option is predicted from the replicas' measured paces: replica r
runs `fixed_r + n_r * (rest_r + max_p f_rp * slope * w_p)` seconds a step (n_r micro-batches,
w_p TP rank p's work, f_rp its slowdown). Moving state is budgeted in Lyapunov drift-plus-
penalty form: a virtual queue Q grows by the seconds spent moving and shrinks by the budget's
share of the seconds trained, and among the options the budget affords (the run's moving,
with the option's and the steps it is predicted to hold for, within the budget's share) the
one minimising

    V * (H * T_a + C_a + A * H * T_a * s_a)  +  Q * (C_a - F * (H * T_a + C_a))

is taken (T_a predicted step seconds, C_a moving seconds, s_a the share of units a resize
skips, H the steps the option is expected to hold for, F the budget: --het-migration-budget).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from . import rebatch
from .memory import MemoryCap
from .plan import PartitionPlan
from .planner import balanced_target, balancing_shares
from .step_model import StepModel, plan_work

# Weight of the drift-plus-penalty's penalty (seconds) against the queue (seconds): 1 trades
# one second of training against one second of backlog.
JOINT_V = 1.0
# A resize that skips share s of the units for H steps costs A * s of those steps' time: a
# lossy step is worth that much less than a full one.
ACCURACY_WEIGHT = 2.0
# An option other than doing nothing must gain this share of the predicted step (noise).
JOINT_MIN_GAIN = 0.05
# Plans balanced for one replica are weighed for this many of the slowest distinct paces.
REPLICA_TARGETS = 8


@dataclass(frozen=True)
class ReplicaPace:
    """One data-parallel replica's TP group, measured: per micro-batch `rest` seconds outside
    the work units carry, per TP rank the slowdown `factors` (1: the fastest rank's speed)."""

    rest: float
    factors: tuple[float, ...]

    def per_microbatch(self, work: Sequence[float], slope: float) -> float:
        return self.rest + max(f * slope * w for f, w in zip(self.factors, work))

    def per_step(self, fixed: float) -> float:
        return max(self.factors) * fixed


@dataclass(frozen=True)
class JointState:
    """What the options are predicted from: the TP plan and shares all replicas share, their
    micro-batch counts, and each replica's pace. `slope`: seconds per unit of work and micro-
    batch at full speed; `fixed`: per-step seconds no split changes (the optimizer step)."""

    plan: PartitionPlan
    shares: tuple[float, ...]
    counts: tuple[int, ...]
    paces: tuple[ReplicaPace, ...]
    slope: float
    fixed: float = 0.0

    def step_seconds(self, work: Sequence[float], counts: Sequence[int]) -> float:
        return max(
            p.per_step(self.fixed) + n * p.per_microbatch(work, self.slope)
            for p, n in zip(self.paces, counts)
        )

    def best_counts(self, work: Sequence[float]) -> tuple[int, ...]:
        seconds = [p.per_microbatch(work, self.slope) for p in self.paces]
        fixed = [p.per_step(self.fixed) for p in self.paces]
        return rebatch.split(sum(self.counts), seconds, fixed)


@dataclass(frozen=True)
class Option:
    action: str  # none | rebatch | migrate | resize | restore, "+rebatch" where counts change
    plan: PartitionPlan
    shares: tuple[float, ...]
    counts: tuple[int, ...]
    step_seconds: float  # predicted
    move_seconds: float = 0.0  # predicted seconds moving state (a migration's transfer)

    @property
    def resized_share(self) -> float:
        return sum(self.shares) / len(self.shares) if self.shares else 0.0


def options(
    state: JointState,
    unit_work: Mapping[str, float],
    cap: float,
    migration_seconds: Callable[[PartitionPlan, PartitionPlan], float] | None,
    resizes: bool = True,
    memory: MemoryCap | None = None,
) -> list[Option]:
    """Every option worth weighing from `state`: nothing, rebatch, a migration to the plan
    balanced for the slowest replica at each TP position and to the plan balanced for each
    of the REPLICA_TARGETS slowest replicas alone (each with its best counts), a resize of
    the positions' stragglers to their peers and an undoing of the resize in force. Under
    `memory` the migrations stay within the cap on a rank's unit state."""
    plan, shares, counts = state.plan, state.shares, state.counts
    work = plan_work(plan, unit_work, shares)
    out = [Option("none", plan, shares, counts, state.step_seconds(work, counts))]

    def with_counts(action, new_plan, new_shares, move=0.0):
        w = plan_work(new_plan, unit_work, new_shares)
        best = state.best_counts(w)
        for n, name in ((counts, action), (best, f"{action}+rebatch")):
            if name == "none" or (n == counts and name.endswith("+rebatch")):
                continue
            if name == "none+rebatch":
                name = "rebatch"
            out.append(Option(name, new_plan, new_shares, n, state.step_seconds(w, n), move))

    with_counts("none", plan, shares)
    zero = (0.0,) * plan.tp_size
    # the shared plan's migration targets: slowest replica per position, and each replica's own
    slowest = tuple(max(col) for col in zip(*(p.factors for p in state.paces)))
    targets = [("migrate", slowest)]
    if len(state.paces) > 1:
        # one target per distinct pace, of the slowest replicas only: at scale hundreds of
        # replicas would each want a plan, and one for a replica that does not bound the step
        # gains little when the rest must be rebatched around it
        distinct = {slowest}
        paces = sorted(
            enumerate(state.paces), key=lambda rp: -rp[1].per_microbatch(work, state.slope)
        )
        for r, p in paces:
            if len(distinct) > REPLICA_TARGETS:
                break
            if p.factors not in distinct:
                distinct.add(p.factors)
                targets.append((f"migrate:replica{r}", p.factors))
    seen = [plan]
    if migration_seconds is not None:
        for name, factors in targets:
            model = StepModel(0.0, tuple(factors), state.slope)
            target = balanced_target(plan, model, unit_work, memory)
            if target in seen:
                continue
            seen.append(target)
            with_counts(name, target, zero, migration_seconds(plan, target))
    if resizes:
        composite = StepModel(0.0, slowest, state.slope, state.fixed)
        slow = {r for r, f in enumerate(slowest) if f > min(slowest)}
        new = balancing_shares(plan, unit_work, composite, slow, cap)
        if any(new) and new != shares:
            with_counts("resize", plan, new)
        if any(shares):
            with_counts("restore", plan, zero)
    return out


@dataclass(frozen=True)
class Choice:
    """The option taken and the objective terms it was taken on (logged)."""

    option: Option
    step_before: float  # predicted seconds per step, doing nothing
    horizon: int  # steps the option is expected to hold for
    queue: float  # the virtual queue it was chosen under
    terms: dict = field(default_factory=dict)  # action -> {penalty, drift, score}


class JointController:
    """Chooses among `options()` by drift-plus-penalty; `account` keeps the virtual queue."""

    def __init__(
        self,
        budget: float,
        v: float = JOINT_V,
        accuracy_weight: float = ACCURACY_WEIGHT,
        min_gain: float = JOINT_MIN_GAIN,
    ):
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"migration budget must be within [0, 1], got {budget}")
        self.budget, self.v = budget, v
        self.accuracy_weight, self.min_gain = accuracy_weight, min_gain
        self.queue = 0.0  # seconds of moving beyond the budget, carried forward
        self.moved = 0.0  # seconds spent moving state, in all
        self.trained = 0.0  # seconds of training, moves included, in all
        self._slow = frozenset()  # who was slow at the last report
        self._since = 0  # ... since this iteration

    def hold(self, iteration: int, slow: frozenset, interval: int) -> int:
        """Steps an option taken now is expected to hold for: as long as who is slow (`slow`,
        e.g. (replica, TP rank) pairs) has stayed the same so far, at least a report
        interval (a straggle that lasted t steps is expected to last about t more)."""
        if slow != self._slow:
            self._slow, self._since = slow, iteration
        return max(interval, iteration - self._since)

    def terms(self, option: Option, horizon: int) -> dict:
        run = horizon * option.step_seconds
        penalty = run + option.move_seconds + self.accuracy_weight * run * option.resized_share
        drift = option.move_seconds - self.budget * (run + option.move_seconds)
        return {
            "penalty": round(penalty, 6),
            "drift": round(drift, 6),
            "score": round(self.v * penalty + self.queue * drift, 6),
        }

    def choose(self, candidates: Sequence[Option], horizon: int) -> Choice:
        """The option of least score; doing nothing unless the best one's penalty (time, moving
        and lost accuracy over the horizon) is `min_gain` below doing nothing's: predictions
        within timing noise of each other are not worth a change."""
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1 step, got {horizon}")
        if not candidates or candidates[0].action != "none":
            raise ValueError("the options must start with doing nothing")
        terms = {o.action: self.terms(o, horizon) for o in candidates}
        allowed = [o for o in candidates if self.affords(o, horizon)]
        best = min(allowed, key=lambda o: terms[o.action]["score"])
        if terms[best.action]["penalty"] > (1.0 - self.min_gain) * terms["none"]["penalty"]:
            best = candidates[0]
        return Choice(best, candidates[0].step_seconds, horizon, self.queue, terms)

    def affords(self, option: Option, horizon: int) -> bool:
        """A move is taken only where the run's seconds spent moving, with it, stay within the
        budget's share of its seconds trained, with the steps the move is predicted to hold
        for: with no budget nothing moves, and a run exceeds its budget by at most its last
        move's unrealised horizon."""
        if option.move_seconds == 0.0:
            return True
        ahead = horizon * option.step_seconds + option.move_seconds
        return self.moved + option.move_seconds <= self.budget * (self.trained + ahead)

    def account(self, moved_seconds: float, trained_seconds: float) -> None:
        """After a report interval: `moved_seconds` spent moving state in it, `trained_seconds`
        its wall time in all."""
        self.moved += moved_seconds
        self.trained += trained_seconds
        self.queue = max(0.0, self.queue + moved_seconds - self.budget * trained_seconds)

    @property
    def spent_share(self) -> float:
        return self.moved / self.trained if self.trained else 0.0

    def state_dict(self) -> dict:
        return {
            "queue": self.queue,
            "moved": self.moved,
            "trained": self.trained,
            "slow": sorted(list(s) for s in self._slow),
            "since": self._since,
        }

    def load_state_dict(self, state: dict) -> None:
        self.queue, self.moved, self.trained = state["queue"], state["moved"], state["trained"]
        self._slow = frozenset(tuple(s) for s in state.get("slow", ()))
        self._since = state.get("since", 0)

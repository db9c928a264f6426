"""Cross-cluster planning (seed 003: HGTrainer's heterogeneous, geo-distributed training): given
sites (clusters) of GPUs of their own speed and the links between them, the Megatron grid (TP x PP x
DP), the layers per stage and the micro-batches per replica that train fastest.

megatron-core lays ranks out TP fastest, then data-parallel, then pipeline stages, and every site
holds consecutive global ranks; so a grid decides which traffic crosses a site boundary: stages on
both sides (activations cross), replicas on both sides (gradients cross), or a TP group (refused: TP
all-reduces four times a layer). Each site's stage count follows from the grid (its per-site PP
degree); its stages' layers and its replicas' micro-batches follow from its GPUs' speed
(hettp.stages.optimal_split, hettp.rebatch.split: the trainer's own --het-tp layer moves and --het-
dp counts). Every candidate is priced by the simulator's step model; the baseline is what a planner
that took the sites for one homogeneous cluster would pick (the fastest grid there, even splits),
priced on the real sites."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..rebatch import split as split_microbatches
from ..stages import optimal_split
from .engine import Costs, Layout, SimError, Simulation
from .network import Fabric
from .traces import persistent
from .workload import ModelSpec, WorkloadError


@dataclass(frozen=True)
class Site:
    name: str
    gpus: int
    speed: float = 1.0  # of the fastest GPU in the job

    def __post_init__(self):
        if self.gpus < 1 or not 0 < self.speed <= 1.0:
            raise SimError(f"site {self.name}: needs GPUs >= 1 and a speed in (0, 1]: {self}")


@dataclass(frozen=True)
class GeoLayout:
    tp: int
    pp: int
    dp: int
    layers: tuple[int, ...]  # per stage
    counts: tuple[int, ...]  # micro-batches per replica
    stages_per_site: tuple[int, ...]  # stages whose first rank is in each site
    crossing: tuple[str, ...]  # what crosses a site boundary: "pipeline", "data"
    cross_bytes: float  # per step over the inter-site links
    predicted_s: float

    def summary(self) -> str:
        crossing = "+".join(self.crossing) or "nothing"
        return (
            f"TP={self.tp} PP={self.pp} DP={self.dp}, layers {_runs(self.layers)}, "
            f"micro-batches {_runs(self.counts)}, {crossing} crosses sites"
        )


@dataclass(frozen=True)
class GeoPlan:
    chosen: GeoLayout
    baseline: GeoLayout
    candidates: tuple[GeoLayout, ...]  # fastest first

    @property
    def speedup(self) -> float:
        return self.baseline.predicted_s / self.chosen.predicted_s


def _runs(values: Sequence[int]) -> str:
    """3/3/2/2 as 2x3/2x2: a replica list of a large job stays one line."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{j - i}x{values[i]}" if j - i > 1 else str(values[i]))
        i = j
    return "/".join(out)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _site_of(sites: Sequence[Site]) -> Callable[[int], int]:
    bounds, start = [], 0
    for site in sites:
        start += site.gpus
        bounds.append(start)
    return lambda rank: next(i for i, b in enumerate(bounds) if rank < b)


def memory_per_gpu(model: ModelSpec, tp: int, pp: int, layers: int | None = None) -> float:
    """Bytes the first stage's GPU holds with `layers` layers (default: an even split's): its
    parameters' and embeddings' weights, optimizer state and gradients (4 bytes), and 1F1B's
    `pp` micro-batches of activations in flight (34 bytes per token and hidden element per
    layer, sharded by TP: Korthikanti et al.)."""
    layers = layers if layers is not None else -(-model.num_layers // pp)
    embeddings = (model.vocab / tp + model.seq) * model.hidden
    params = layers * model.layer_params() / tp + embeddings
    activations = pp * layers * 34 * model.tokens * model.hidden / tp
    return params * (model.state_bytes + 4) + activations


def grids(
    model: ModelSpec, world: int, gpus_per_node: int, microbatches: int
) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) that fit: TP inside a node and dividing the units, a stage per layer at
    most, and the global batch's micro-batches split over the replicas."""
    out = []
    for tp in _divisors(gpus_per_node):
        if world % tp or model.query_groups % tp or model.mlp_units % tp:
            continue
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if pp <= model.num_layers and microbatches % dp == 0 and microbatches >= dp:
                out.append((tp, pp, dp))
    return out


def price(
    model: ModelSpec,
    sites: Sequence[Site],
    fabric: Fabric,
    costs_of: Callable[[Layout], Costs],
    grid: tuple[int, int, int],
    microbatches: int,
    balanced: bool = True,
    gpu_memory: float | None = None,
) -> GeoLayout | None:
    """The layout of `grid` over `sites` and its predicted step (None where a TP group would
    span sites or the model would not fit in `gpu_memory` bytes). `balanced`: layers and
    micro-batches by the GPUs' speeds, else even."""
    tp, pp, dp = grid
    layout = Layout(tp, pp, dp)
    site_of = _site_of(sites)
    speeds = {g: sites[site_of(g)].speed for g in range(layout.world)}
    for d in range(dp):
        for s in range(pp):
            if len({site_of(layout.rank(t, d, s)) for t in range(tp)}) > 1:
                return None
    slowest_stage = [
        max(1.0 / speeds[layout.rank(t, d, s)] for t in range(tp) for d in range(dp))
        for s in range(pp)
    ]
    slowest_replica = [
        max(1.0 / speeds[layout.rank(t, d, s)] for t in range(tp) for s in range(pp))
        for d in range(dp)
    ]
    if balanced:
        layers = optimal_split(slowest_stage, model.num_layers)
        counts = split_microbatches(microbatches, slowest_replica)
    elif model.num_layers % pp == 0:
        layers = (model.num_layers // pp,) * pp
        counts = (microbatches // dp,) * dp
    else:
        return None
    if gpu_memory is not None and memory_per_gpu(model, tp, pp, max(layers)) > gpu_memory:
        return None
    trace = persistent(layout.world, {g: 1.0 / v for g, v in speeds.items() if v < 1.0})
    sim_fabric = Fabric(
        fabric.gpus_per_node,
        fabric.intra_node,
        fabric.inter_node,
        fabric.inter_cluster,
        tuple(site.gpus for site in sites),
    )
    try:
        sim = Simulation(
            model,
            layout,
            costs_of(layout),
            trace,
            "none",
            fabric=sim_fabric,
            microbatches=microbatches // dp,
            layers=layers,
            counts=counts,
        )
    except (SimError, WorkloadError):
        return None
    step = sim.steady_step()
    crossing, cross_bytes = [], 0.0
    act = model.activation()
    boundaries = [
        s
        for s in range(pp - 1)
        if site_of(layout.rank(0, 0, s)) != site_of(layout.rank(0, 0, s + 1))
    ]
    if boundaries or any(
        site_of(layout.rank(0, d, s)) != site_of(layout.rank(0, d, s + 1))
        for d in range(dp)
        for s in range(pp - 1)
    ):
        crossing.append("pipeline")
        cross_bytes += (
            sum(
                2 * act * counts[d]
                for d in range(dp)
                for s in range(pp - 1)
                if site_of(layout.rank(0, d, s)) != site_of(layout.rank(0, d, s + 1))
            )
            * tp
        )
    for s in range(pp):
        ring = [site_of(layout.rank(0, d, s)) for d in range(dp)]
        changes = sum(a != b for a, b in zip(ring, ring[1:] + ring[:1]))  # link crossings
        if changes:
            if "data" not in crossing:
                crossing.append("data")
            grads = max(sim.params[s]) * model.grad_bytes
            cross_bytes += tp * changes * 2 * (dp - 1) / dp * grads
    if sim.embedding_crosses and model.tied_embeddings:
        cross_bytes += tp * dp * 2 * model.vocab * model.hidden / tp * model.grad_bytes
    first_site = [site_of(layout.rank(0, 0, s)) for s in range(pp)]
    stages_per_site = tuple(first_site.count(i) for i in range(len(sites)))
    return GeoLayout(
        tp,
        pp,
        dp,
        tuple(layers),
        tuple(counts),
        stages_per_site,
        tuple(crossing),
        cross_bytes,
        step,
    )


def plan_sites(
    model: ModelSpec,
    sites: Sequence[Site],
    fabric: Fabric,
    costs_of: Callable[[Layout], Costs],
    microbatches: int,
    keep: int = 8,
    gpu_memory: float | None = 80e9,
) -> GeoPlan:
    """The fastest layout over `sites` (module docstring) and the homogeneous baseline.
    `microbatches`: the global batch in micro-batches; `costs_of(layout)`: what a layout's
    compute costs at full speed; `gpu_memory`: bytes a GPU has (None: no limit)."""
    world = sum(site.gpus for site in sites)
    options = grids(model, world, fabric.gpus_per_node, microbatches)
    if not options:
        raise SimError(
            f"no TP x PP x DP grid of {world} GPUs fits the model and {microbatches} micro-batches"
        )
    priced = [
        price(model, sites, fabric, costs_of, g, microbatches, gpu_memory=gpu_memory)
        for g in options
    ]
    priced = sorted((p for p in priced if p is not None), key=lambda p: p.predicted_s)
    if not priced:
        raise SimError(
            "no grid fits: each puts a TP group across sites or needs more than the GPU's "
            "memory; give sites of whole nodes, or GPUs with more memory"
        )
    # What a planner that sees one homogeneous cluster picks: the fastest grid there.
    uniform = [Site("all", world)]
    flat = Fabric(fabric.gpus_per_node, fabric.intra_node, fabric.inter_node, fabric.inter_node)
    homogeneous = [
        (p.predicted_s, g)
        for g in options
        if (
            p := price(
                model, uniform, flat, costs_of, g, microbatches, False, gpu_memory=gpu_memory
            )
        )
        is not None
    ]
    baseline = None
    for _, grid in sorted(homogeneous):
        baseline = price(model, sites, fabric, costs_of, grid, microbatches, balanced=False)
        if baseline is not None:
            break
    if baseline is None:
        raise SimError("no homogeneous grid fits these sites (a TP group would span two)")
    return GeoPlan(priced[0], baseline, tuple(priced[:keep]))

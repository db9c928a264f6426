"""Links and collectives under an alpha-beta model: a message of n bytes over a link takes
alpha + n / beta. Where GPUs sit: nodes of `gpus_per_node` consecutive global ranks, clusters
of consecutive nodes; a group's collective runs at its slowest link."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float  # bytes per second

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha + nbytes / self.beta


# Defaults of a current GPU cluster: NVLink inside a node, 400 Gb/s InfiniBand per GPU between
# nodes, a 100 Gb/s WAN between clusters.
NVLINK = Link(alpha=5e-6, beta=200e9)
INFINIBAND = Link(alpha=10e-6, beta=40e9)
WAN = Link(alpha=5e-3, beta=12.5e9)


@dataclass(frozen=True)
class Fabric:
    gpus_per_node: int = 8
    intra_node: Link = NVLINK
    inter_node: Link = INFINIBAND
    inter_cluster: Link = WAN
    clusters: tuple[int, ...] = ()  # GPUs per cluster, consecutive global ranks; () = one

    def cluster_of(self, rank: int) -> int:
        start = 0
        for index, size in enumerate(self.clusters):
            if rank < start + size:
                return index
            start += size
        return 0 if not self.clusters else len(self.clusters) - 1

    def link(self, a: int, b: int) -> Link:
        if self.clusters and self.cluster_of(a) != self.cluster_of(b):
            return self.inter_cluster
        if a // self.gpus_per_node != b // self.gpus_per_node:
            return self.inter_node
        return self.intra_node

    def ring_link(self, ranks: Sequence[int]) -> Link:
        """The slowest link of a ring over `ranks` (in their order): a ring collective's pace."""
        if len(ranks) < 2:
            return self.intra_node
        links = [self.link(a, b) for a, b in zip(ranks, list(ranks[1:]) + [ranks[0]])]
        return max(links, key=lambda link: (1.0 / link.beta, link.alpha))


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of `nbytes` over `n` members: 2(n-1) steps of nbytes/n each."""
    if n < 2 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * (link.alpha + nbytes / n / link.beta)

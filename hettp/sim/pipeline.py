"""The 1F1B pipeline schedule, timed exactly: every stage runs its warm-up forwards, then
alternates one forward and one backward, then drains its backwards; an operation starts when
its stage is free and its input has arrived from the neighbour stage. A hand-off occupies its
link (each direction of each boundary) for its whole time, one after the other: a slow link's
bandwidth bounds the step, not only its latency."""

from __future__ import annotations

from collections.abc import Sequence


def stage_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    warm = min(stages - stage - 1, microbatches)
    order = [("F", m) for m in range(warm)]
    for i in range(microbatches - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", m) for m in range(microbatches - warm, microbatches)]
    return order


def one_f_one_b(
    forward: Sequence[float],
    backward: Sequence[float],
    microbatches: int,
    hand_off: Sequence[float] = (),
) -> float:
    """Seconds from the first forward to the last backward. `forward[s]`/`backward[s]`: stage
    s's time per micro-batch; `hand_off[s]`: the transfer between stages s and s+1 (each
    way)."""
    stages = len(forward)
    if stages != len(backward) or microbatches < 1:
        raise ValueError(f"{stages} forward and {len(backward)} backward times, {microbatches} mbs")
    hand_off = list(hand_off) or [0.0] * (stages - 1)
    orders = [stage_order(s, stages, microbatches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    busy: dict[tuple[int, str], float] = {}  # a link direction: when its last hand-off ends
    position = [0] * stages
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                if kind == "F":
                    dep = done.get(("F", s - 1, m)) if s > 0 else 0.0
                    channel = (s - 1, "F") if s > 0 else None
                    length = forward[s]
                else:
                    dep = done.get(("B", s + 1, m)) if s < stages - 1 else done.get(("F", s, m))
                    channel = (s, "B") if s < stages - 1 else None
                    length = backward[s]
                if dep is None:
                    break
                arrival = dep
                if channel is not None:
                    arrival = max(dep, busy.get(channel, 0.0)) + hand_off[channel[0]]
                    busy[channel] = arrival
                free[s] = max(free[s], arrival) + length
                done[(kind, s, m)] = free[s]
                position[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen: the order is 1F1B's
    return max(free)

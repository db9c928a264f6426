"""The 1F1B pipeline schedule, timed exactly: every stage runs its warm-up forwards, then
alternates one forward and one backward, then drains its backwards; an operation starts when
its stage is free and its input has arrived from the neighbour stage."""

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
    position = [0] * stages
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                if kind == "F":
                    dep = done.get(("F", s - 1, m)) if s > 0 else 0.0
                    arrival = None if dep is None else dep + (hand_off[s - 1] if s > 0 else 0.0)
                    length = forward[s]
                else:
                    dep = done.get(("B", s + 1, m)) if s < stages - 1 else done.get(("F", s, m))
                    arrival = (
                        None if dep is None else dep + (hand_off[s] if s < stages - 1 else 0.0)
                    )
                    length = backward[s]
                if arrival is None:
                    break
                free[s] = max(free[s], arrival) + length
                done[(kind, s, m)] = free[s]
                position[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen: the order is 1F1B's
    return max(free)

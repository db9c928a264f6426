"""The 1F1B pipeline schedule, timed exactly: every stage runs its warm-up forwards, then
alternates one forward and one backward, then drains its backwards. Transfers go as
megatron-core's non-interleaved schedule makes them: a stage sends its output and posts the
receive of its next input in one blocking call, so a transfer starts when the sender has its
output and the receiver has finished its previous compute (a rendezvous), the sender waits
until it is through, and each direction of each boundary carries one transfer at a time (a
slow link's bandwidth bounds the step, not only its latency)."""

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
    s's time per micro-batch; `hand_off[s]`: one transfer between stages s and s+1."""
    stages = len(forward)
    if stages != len(backward) or microbatches < 1:
        raise ValueError(f"{stages} forward and {len(backward)} backward times, {microbatches} mbs")
    hand_off = list(hand_off) or [0.0] * (stages - 1)
    orders = [stage_order(s, stages, microbatches) for s in range(stages)]
    position = [0] * stages
    computed = [0.0] * stages  # when the stage's last compute ended (it posts its receive)
    sent: list[float | None] = [0.0] * stages  # when its last send went through (None: pending)
    outbox: dict[tuple[str, int, int], tuple[int, float]] = {}  # message -> (sender, ready)
    arrived: dict[tuple[str, int, int], float] = {}
    link: dict[tuple[int, str], float] = {}  # (boundary, direction) -> its last transfer's end
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                key = (kind, s, m)
                needs = (kind == "F" and s > 0) or (kind == "B" and s < stages - 1)
                if needs and key not in arrived:
                    if key not in outbox:
                        break  # not sent yet
                    sender, ready = outbox.pop(key)
                    channel = (min(s, sender), kind)
                    begin = max(ready, computed[s], link.get(channel, 0.0))
                    arrived[key] = link[channel] = begin + hand_off[channel[0]]
                    sent[sender] = arrived[key]
                if sent[s] is None:
                    break  # this stage's own send waits for its receiver
                ready = arrived.get(key, 0.0)
                end = max(computed[s], sent[s], ready) + (
                    forward[s] if kind == "F" else backward[s]
                )
                computed[s] = end
                if kind == "F" and s < stages - 1:
                    outbox[("F", s + 1, m)] = (s, end)
                    sent[s] = None
                elif kind == "F":
                    arrived[("B", s, m)] = end  # the last stage turns around
                elif s > 0:
                    outbox[("B", s - 1, m)] = (s, end)
                    sent[s] = None
                position[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen: the order is 1F1B's
    return max(max(computed), max(t for t in sent if t is not None))

"""How far a resumed unit's Adam moments are from reading as they did when it was frozen."""

from __future__ import annotations

import torch

BETAS = (0.9, 0.999)  # megatron's defaults, which the tests keep


def resume_misfit(frozen, after, frozen_at: int, count: int, betas=BETAS) -> float:
    """The relative misfit of a unit's moments (m, v) one step after it resumed at the
    optimizer's `count` (`after`), given them as frozen after step `frozen_at` (`frozen`).

    Frozen after an update (`frozen_at` >= 1), the step must have started from the moments
    rescaled to read at `count` as at `frozen_at`: the gradient that m's update implies must
    also explain v's. Frozen before any (zero moments), the moments after the step must read as
    a fresh Adam's after one: m_hat^2 = v_hat. About 1e-7 where they do; where Adam's count
    was left to correct them, 0.3 or more."""
    (beta1, beta2), (m0, v0), (m1, v1) = betas, frozen, after
    m0, v0, m1, v1 = (t.double() for t in (m0, v0, m1, v1))
    step = count + 1
    if frozen_at == 0:
        assert not m0.any() and not v0.any(), "a unit frozen before any update has zero moments"
        m_hat, v_hat = m1 / (1 - beta1**step), v1 / (1 - beta2**step)
        return float((m_hat**2 - v_hat).abs().max() / v_hat.abs().max())
    scale1 = (1 - beta1**count) / (1 - beta1**frozen_at)
    scale2 = (1 - beta2**count) / (1 - beta2**frozen_at)
    grad = (m1 - beta1 * scale1 * m0) / (1 - beta1)
    predicted = beta2 * scale2 * v0 + (1 - beta2) * grad**2
    return float((v1 - predicted).abs().max() / v1.abs().max())


def resumed_misfits(ranks) -> list[tuple]:
    """(block, unit, step frozen at, step resumed at, resume_misfit) of every unit that
    resumed in a run of `train_with_resizes` (its result on every rank), from the records of
    the step it resumed at and the next. A unit skipped at the first recorded step counts as
    skipped from the start (frozen at 0)."""
    records = [rank["records"] for rank in ranks]
    steps = sorted(records[0])
    skipped = {
        it: {
            key: set().union(*(_skipped(rank[it]["blocks"][key]) for rank in records))
            for key in records[0][it]["blocks"]
        }
        for it in steps
    }
    out = []
    for it in steps[1:-1]:
        for key, units in skipped[it - 1].items():
            for unit in sorted(units - skipped[it][key]):
                since = it - 1
                while since - 1 in skipped and unit in skipped[since - 1][key]:
                    since -= 1
                since = 0 if since == steps[0] else since
                frozen, record = _unit(records, it, key, unit)
                after, later = _unit(records, it + 1, key, unit)
                assert later["count"] == record["count"] + 1, "a step the optimizer skipped"
                keys, tensors = record["state_keys"], record["blocks"][key]["unit_tensors"]
                pairs = zip(_moments(frozen, keys, tensors), _moments(after, keys, tensors))
                misfit = max(resume_misfit(a, b, since, record["count"]) for a, b in pairs)
                out.append((key, unit, since, it, misfit))
    return out


def _skipped(block) -> set:
    return set(block["units"][block["active"] :])


def _unit(records, it, key, unit):
    """A unit's recorded values at step `it`, from the rank holding it, and that record."""
    for rank in records:
        values = rank[it]["blocks"][key]["values"]
        if unit in values:
            return values[unit], rank[it]
    raise KeyError((it, key, unit))


def _moments(values: list[torch.Tensor], keys: list[str], tensors: int) -> list[tuple]:
    """(exp_avg, exp_avg_sq) of each of the `tensors` unit tensors in a recorded unit's values
    (per tensor: the weight, then one entry per state key; K/V replicas, which follow, are
    left out: a head's group may have trained on while the head was skipped)."""
    per_tensor = 1 + len(keys)
    m, v = 1 + keys.index("exp_avg"), 1 + keys.index("exp_avg_sq")
    return [(values[i + m], values[i + v]) for i in range(0, tensors * per_tensor, per_tensor)]

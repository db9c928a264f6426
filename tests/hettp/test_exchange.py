"""Every transfer primitive moves exactly the scheduled payloads (3 real gloo ranks), and the
cost model can be fitted on a live group."""

from __future__ import annotations

import torch

from tests.utils import exchange_primitives, run_ranks

# (layer, block, unit, src, dst)
MANY = [
    (0, "mlp", 0, 0, 1),
    (0, "mlp", 1, 0, 2),
    (0, "mlp", 2, 1, 0),
    (1, "attn", 3, 2, 0),
    (1, "attn", 4, 2, 1),
    (1, "attn", 5, 1, 2),
]
FAN = [(0, "mlp", 0, 1, 0), (0, "mlp", 1, 1, 2), (1, "mlp", 2, 1, 2)]
CASES = [("p2p", MANY), ("all_to_all", MANY), ("scatter", FAN), ("broadcast", FAN)]


def test_every_primitive_delivers_exactly_the_scheduled_units():
    results = run_ranks(exchange_primitives, 3, CASES)
    for primitive, moves in CASES:
        for result in results:
            rank = result["rank"]
            expected = {(layer, u, s, d) for layer, _, u, s, d in moves if d == rank}
            got = result["got"][primitive]
            assert set(got) == expected, (primitive, rank)
            for (layer, unit, src, _dst), (values, ids) in got.items():
                assert torch.equal(
                    values, torch.full((3, 5), float(layer * 1000 + unit * 10 + src))
                )
                assert torch.equal(ids, torch.arange(7, dtype=torch.int64) + unit)
    for name, cost in results[0]["model"].items():
        assert cost["beta"] > 0 and cost["call"] >= 0 and cost["alpha"] >= 0, name

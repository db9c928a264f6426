"""Every transfer primitive moves exactly the scheduled payloads (3 real gloo ranks), and the
cost model can be fitted on a live group."""

from __future__ import annotations

import torch

from tests.utils import exchange_primitives, exchange_value, run_ranks

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
# runs: consecutive units of one layer's block travel joined; ranks both send and receive
RUNS = [(0, "mlp", u, 0, 1) for u in range(5)] + [(0, "attn", 0, 0, 1), (0, "attn", 1, 0, 2)]
RUNS += [(1, "mlp", u, 1, 0) for u in range(3, 9)] + [(1, "mlp", 9, 2, 0), (1, "mlp", 10, 2, 0)]
BIG = 1 << 20  # every bundle in one message
CASES = [
    ("p2p", "p2p", MANY, BIG, None),
    ("all_to_all", "all_to_all", MANY, BIG, None),
    ("scatter", "scatter", FAN, BIG, None),
    ("broadcast", "broadcast", FAN, BIG, None),
    # 64 bytes: each run's 3x5 floats (60 bytes per unit) is a message of its own, and a lone
    # unit's tensors share one
    ("p2p runs", "p2p", RUNS, 64, None),
    ("all_to_all runs", "all_to_all", RUNS, 64, None),
    ("p2p runs one message", "p2p", RUNS, BIG, None),
    # as on NCCL, where a pair's operations must go out as one group (MANY and RUNS swap units
    # between pairs of ranks, the case where streamed operations deadlock there)
    ("p2p grouped", "p2p grouped", MANY, BIG, None),
    ("p2p grouped runs", "p2p grouped", RUNS, 64, None),
]
FAULTS = [
    ("p2p pack fault", "p2p", RUNS, 64, (0, "pack")),  # rank 0 sends zeros in place of its runs
    ("p2p pack fault receiver", "p2p", RUNS, 64, (2, "pack")),
    ("p2p grouped pack fault", "p2p grouped", RUNS, 64, (0, "pack")),
    ("all_to_all pack fault", "all_to_all", RUNS, 64, (1, "pack")),
]


def test_every_primitive_delivers_exactly_the_scheduled_units():
    results = run_ranks(exchange_primitives, 3, CASES + FAULTS)
    for name, _, moves, _, _ in CASES:
        for result in results:
            rank = result["rank"]
            expected = {(layer, b, u, s, d) for layer, b, u, s, d in moves if d == rank}
            got = result["got"][name]
            assert set(got) == expected, (name, rank)
            for (layer, block, unit, src, _dst), (values, ids) in got.items():
                base = exchange_value(layer, block, unit, src)
                assert torch.equal(values, torch.full((3, 5), base))
                assert torch.equal(ids, torch.arange(7, dtype=torch.int64) + unit)
    for name, _, _, _, (culprit, stage) in FAULTS:  # every rank aborts; none blocks
        for result in results:
            error = result["got"][name]
            assert isinstance(error, str), (name, result["rank"])
            assert f"TP rank(s) [{culprit}] failed" in error, error
            if result["rank"] == culprit:
                assert f"{stage}: RuntimeError: injected {stage} fault" in error, error
    for name, cost in results[0]["model"].items():
        assert cost["beta"] > 0 and cost["call"] >= 0 and cost["alpha"] >= 0, name

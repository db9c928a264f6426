"""Compressed data-parallel gradient reduction (--het-dp-compress, hettp/compress.py) on gloo
ranks: what it sums, that error feedback loses nothing over a run, and training with it."""

from __future__ import annotations

import pytest
import torch

from hettp.compress import CHUNK, compress, decompress, wire_bytes
from tests.utils import MHA, run_ranks, train
from tests.utils.workers import compressed_sums


def test_int8_and_bf16_round_trips_are_bounded_by_their_resolution():
    x = torch.randn(3 * CHUNK + 5) * torch.linspace(0.01, 10, 3 * CHUNK + 5)
    q, scales = compress(x, "int8")
    assert q.dtype == torch.int8 and scales.numel() == 4
    back = decompress(q, scales, x.numel())
    for c in range(4):  # each chunk within half a step of its own scale
        part = slice(c * CHUNK, (c + 1) * CHUNK)
        assert (back[part] - x[part]).abs().max() <= scales[c] / 2 + 1e-7
    b, none = compress(x, "bf16")
    assert none is None and torch.allclose(decompress(b, None, x.numel()), x, rtol=1 / 128)
    assert (
        wire_bytes(x.numel(), "int8")
        < wire_bytes(x.numel(), "bf16")
        < wire_bytes(x.numel(), "none")
    )
    with pytest.raises(ValueError, match="compression 'fp8'"):
        compress(x, "fp8")


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_error_feedback_delays_gradients_and_loses_none(kind):
    steps = 6
    ranks = run_ranks(compressed_sums, 2, kind, steps)
    got, exact = ranks[0]["got"], ranks[0]["exact"]
    assert all(torch.equal(a, b) for a, b in zip(got, ranks[1]["got"]))  # every rank alike
    for g, e in zip(got, exact):
        error = (g - e).abs().max() / e.abs().max()
        assert 0 < error < (0.02 if kind == "int8" else 0.01)  # compressed, and close
    # over the run: the sums of what was reduced are the exact sums less the last residues
    drift = sum(got) - sum(exact) + ranks[0]["residue"]
    assert drift.abs().max() < 1e-4 * sum(exact).abs().max()


def test_residues_round_trip_a_state_dict_of_their_own_kind_only():
    from hettp.compress import ErrorFeedbackReducer

    saved = ErrorFeedbackReducer("int8")
    saved.errors[(0, 1)] = torch.tensor([0.5, -0.25])
    state = saved.state_dict()
    saved.errors[(0, 1)].zero_()  # the state is a copy
    loaded = ErrorFeedbackReducer("int8")
    loaded.load_state_dict(state)
    assert torch.equal(loaded.errors[(0, 1)], torch.tensor([0.5, -0.25]))
    with pytest.raises(ValueError, match="residues of 'int8' cannot seed 'bf16'"):
        ErrorFeedbackReducer("bf16").load_state_dict(state)


def test_a_rebuilt_wrapper_keeps_compressing():
    """A migration or layer move rebuilds DDP (partition._wrapper_like, from the old
    wrapper's `rebuild_kwargs()`); the new wrapper must reduce as the old one did, residues
    started over."""
    from hettp.compress import ErrorFeedbackReducer
    from megatron.hetero.ddp import HetDDP
    from megatron.hetero.partition import _wrapper_like

    class Probe(HetDDP):
        def __init__(self, config, ddp_config, module, compress="none"):
            self.config, self.ddp_config, self.module = config, ddp_config, module
            self.reducer = ErrorFeedbackReducer(compress) if compress != "none" else None

    old = Probe("config", "ddp", "module", compress="int8")
    old.reducer.errors["buffer"] = torch.ones(3)
    new = _wrapper_like(old)
    assert type(new) is Probe and new.module == "module"
    assert new.reducer.kind == "int8" and not new.reducer.errors
    assert _wrapper_like(Probe("config", "ddp", "module")).reducer is None


TRAIN = MHA.replace("--train-iters 1", "--train-iters 8").split() + [
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
]


def test_training_with_compressed_gradients_tracks_the_exact_reduction_and_resumes(tmp_path):
    exact = run_ranks(train, 2, TRAIN)[0]["losses"]
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    int8 = run_ranks(train, 2, TRAIN + ["--het-dp-compress", "int8"] + ckpt)
    losses = int8[0]["losses"]
    assert losses == int8[1]["losses"]
    assert losses != exact  # the reduction did change
    for i in exact:
        assert losses[i] == pytest.approx(exact[i], rel=2e-3), i
    # the checkpoint keeps each rank's residues: resumed from iteration 4 (Megatron's tracker
    # file names the checkpoint to load), the run sends what this one sent
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = run_ranks(
        train, 2, TRAIN + ["--het-dp-compress", "int8", "--load", str(tmp_path / "ckpt")]
    )[0]["losses"]
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[i] for i in range(5, 9)] == [losses[i] for i in range(5, 9)]


def test_a_reorder_drops_the_residues_of_units_that_changed_places():
    """A resize sorts a rank's units by priority in place (same parameters, same DDP): the
    residues, kept by gradient-buffer position, would land on other units' gradients."""
    from tests.utils import train_with_resizes

    argv = TRAIN + ["--tensor-model-parallel-size", "2", "--het-dp-compress", "int8"]
    argv += ["--het-tp-priority-interval", "2", "--het-tp-priority-sample-interval", "1"]
    argv += ["--het-tp-resize", "0,0"]
    ranks = run_ranks(train_with_resizes, 4, argv, {3: [("resize", (0, 0.5))]})
    for rank in (1, 3):  # TP rank 1, both replicas: sorted by priority at 3
        records = ranks[rank]["records"]
        moved = [
            k
            for k, b in records[3]["blocks"].items()
            if b["units"] != records[2]["blocks"][k]["units"]
        ]
        assert moved, "the resize changed no unit's place: nothing tested"
        assert records[2]["residues"] > 0 and records[3]["residues"] == 0
        assert records[5]["residues"] > 0  # kept again from the next reduction on (4 re-sorts)
    for rank in (0, 2):  # TP rank 0 kept its order, and its residues
        assert all(ranks[rank]["records"][i]["residues"] > 0 for i in (2, 3, 4))

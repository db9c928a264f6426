"""scripts/checkpoint_pieces.py: its piece counts (pure, a small shape)."""

from __future__ import annotations

import importlib.util
import os

from tests.utils import ROOT


def _script():
    spec = importlib.util.spec_from_file_location(
        "checkpoint_pieces", os.path.join(ROOT, "scripts", "checkpoint_pieces.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_stretches_never_outnumber_one_shape_pieces_and_an_even_plan_is_vanilla_s(capsys):
    script = _script()
    script.main(["--ffn", "512", "--tp", "4", "--layers", "3", "--moves", "6", "--seed", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 7 and rows[0][3:5] == ["12", "12"]  # a piece per rank and layer
    assert all(int(before) >= int(now) >= 12 for *_, before, now, _ in rows)
    assert any(int(before) > int(now) for *_, before, now, _ in rows[1:])


def test_a_straggle_that_ends_leaves_one_stretch_per_rank_and_layer(capsys):
    """The revert to even gives every rank back the units it gave: the ids come home."""
    script = _script()
    script.main(["--ffn", "512", "--tp", "4", "--layers", "3", "--moves", "6", "--ends"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[4] for row in rows[2::2]] == ["12"] * 3  # after each end: one per rank, layer
    assert all(int(row[4]) > 12 for row in rows[1::2])  # during each straggle: more

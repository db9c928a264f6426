"""The CPU shims: each covered upstream path runs, and a missing upstream symbol fails loudly."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.hetero import cpu_compat
from tests.utils import compat_paths, run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are off with CUDA")


def test_every_covered_upstream_symbol_exists():
    cpu_compat._check_symbols()  # raises CompatError naming the symbol if megatron-core moved it
    names = [s.name for s in cpu_compat.SHIMS]
    assert len(names) == len(set(names))
    assert all(s.covers and s.why for s in cpu_compat.SHIMS)


def test_a_missing_symbol_raises_compat_error(monkeypatch):
    bogus = cpu_compat.Shim(
        "bogus", ("megatron.core.tensor_parallel.random:NoSuchTracker",), "test"
    )
    monkeypatch.setattr(cpu_compat, "SHIMS", cpu_compat.SHIMS + (bogus,))
    with pytest.raises(cpu_compat.CompatError, match="NoSuchTracker for shim 'bogus'"):
        cpu_compat._check_symbols()


def test_shimmed_upstream_paths_run_on_cpu(tmp_path):
    (tmp_path / "ckpt").mkdir()
    report = run_ranks(compat_paths, 1, str(tmp_path / "ckpt"))[0]
    assert report["activated"] is True
    assert report["current_device"] == "cpu"
    tracker_class, fork_advances = report["rng_tracker"]
    assert tracker_class == "CpuRNGStatesTracker" and fork_advances
    assert report["recompute_rng"] == (2, True)  # recomputed with the same random numbers
    assert report["type_names"] == (
        "torch.cuda.BFloat16Tensor",
        "torch.cuda.FloatTensor",
        torch.int64,
    )
    loss, grad_norm, skipped, clipped = report["step"]
    assert math.isfinite(loss) and not skipped
    assert grad_norm > 1e-3  # so clipping to --clip-grad 1e-3 really happened
    assert clipped == pytest.approx(1e-3, rel=1e-3)
    assert report["checkpoint_roundtrip"] is True

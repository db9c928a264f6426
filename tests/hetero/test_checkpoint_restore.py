"""What a checkpoint load restores or mends, without ranks: the generators (the dropout
tracker's only onto the kind of device that saved them), and a save killed between renames."""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron.hetero import checkpointing


def _saved_on(device: str) -> dict:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {"model-parallel-rng": torch.zeros(5056, dtype=torch.uint8)},
        "device": device,
    }


def test_a_state_from_another_kind_of_device_restores_the_host_generators_only(monkeypatch):
    """A CUDA state set as a CPU rank's tracker (or the reverse) fails at the first forward
    ("RNG state is wrong size"): such a state restores the host generators, not the tracker."""
    here = "cuda" if torch.cuda.is_available() else "cpu"
    other = "cpu" if here == "cuda" else "cuda"
    torch.manual_seed(3)
    state = _saved_on(other)
    expected = torch.rand(4)
    set_states = []
    tracker = tensor_parallel.get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "set_states", lambda s: set_states.append(s))
    # this process's tracker holds a state of the saved one's size (a CPU generator's)
    live = {"model-parallel-rng": torch.zeros(5056, dtype=torch.uint8)}
    monkeypatch.setattr(tracker, "get_states", lambda: live)
    assert checkpointing._set_rng_state(state) is False
    assert torch.equal(torch.rand(4), expected) and set_states == []
    # saved on this kind of device (or before checkpoints named it): all of it
    for device in (here, None):
        state = _saved_on(here)
        if device is None:
            del state["device"]
        assert checkpointing._set_rng_state(state) is True
        assert set_states.pop() is state["tracker"]
    # saved before the kind was named, on the other kind: told by the states' sizes
    live["model-parallel-rng"] = torch.zeros(16, dtype=torch.uint8)  # a CUDA Philox state
    state = _saved_on(here)
    del state["device"]
    assert checkpointing._set_rng_state(state) is False and set_states == []


def test_a_save_killed_between_its_renames_is_mended_from_the_copy_it_moved_aside(tmp_path):
    """A save over an existing iteration moves the old copy aside, then renames its own into
    place: killed in between, the tracker names a missing folder; the aside copy takes it back."""
    final = tmp_path / "iter_0000006"
    (tmp_path / "iter_0000006.replaced").mkdir()
    (tmp_path / "iter_0000006.replaced" / "common.pt").write_text("old")
    assert checkpointing.restore_replaced(str(tmp_path), 6) is True
    assert (final / "common.pt").read_text() == "old"
    assert not (tmp_path / "iter_0000006.replaced").exists()
    # the save's own copy in place: nothing to do; nothing aside: nothing to do
    (tmp_path / "iter_0000006.replaced").mkdir()
    assert checkpointing.restore_replaced(str(tmp_path), 6) is False
    assert checkpointing.restore_replaced(str(tmp_path), 9) is False
    assert (final / "common.pt").read_text() == "old"

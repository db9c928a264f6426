"""Checkpoint manifests and the allowlist read of dist-checkpoint metadata
(megatron/hetero/ckpt_integrity.py), on plain folders: no process group."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron.hetero.ckpt_integrity import (
    MANIFEST,
    UnsafeCheckpointError,
    check_metadata,
    verify,
    write_manifest,
)


def _folder(tmp_path):
    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(os.urandom(10000))
    (folder / "common.pt").write_bytes(b"common")
    meta = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                torch.Size([4, 2]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))],
            )
        },
        storage_data={MetadataIndex("w", torch.Size([0, 0]), 0): None},
    )
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    write_manifest(str(folder))
    return folder


def test_an_intact_checkpoint_verifies_and_real_metadata_passes_the_allowlist(tmp_path):
    folder = _folder(tmp_path)
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "common.pt", MANIFEST]
    assert verify(str(folder)) is None


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda f: (f / "__0_0.distcp").write_bytes(os.urandom(9997)), "9997 bytes, the manifest"),
        (lambda f: (f / "common.pt").write_bytes(b"commoN"), "SHA-256 differs"),
        (lambda f: os.remove(f / "common.pt"), "common.pt is damaged: No such file"),
        (lambda f: (f / "__9_9.distcp").write_bytes(b""), "__9_9.distcp is not in the"),
        (lambda f: (f / MANIFEST).write_text("{"), "manifest.json is unreadable"),
    ],
    ids=["truncated", "changed", "missing", "unlisted", "bad-manifest"],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, change, message):
    folder = _folder(tmp_path)
    change(folder)
    with pytest.raises(UnsafeCheckpointError, match=message) as err:
        verify(str(folder))
    assert str(folder) in str(err.value)


def test_a_checkpoint_without_manifest_loads_with_a_warning(tmp_path):
    folder = _folder(tmp_path)
    os.remove(folder / MANIFEST)
    assert "has no manifest.json" in verify(str(folder))
    # ... but not without its metadata, nor where the tracker names a folder that is gone:
    # one line naming it, where megatron-core's load failed with a traceback
    os.remove(folder / ".metadata")
    with pytest.raises(UnsafeCheckpointError, match=r"iter_0000001/\.metadata is missing"):
        verify(str(folder))
    with pytest.raises(UnsafeCheckpointError, match="iter_0000002 is missing"):
        verify(str(tmp_path / "iter_0000002"))


class _Runs:
    def __reduce__(self):
        return (print, ("ran",))


def test_metadata_that_needs_anything_else_is_refused_without_running(tmp_path, capsys):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"x": _Runs()}))
    with pytest.raises(UnsafeCheckpointError, match="needs builtins.print"):
        check_metadata(str(path))
    assert "ran" not in capsys.readouterr().out
    path.write_bytes(b"not a pickle")
    with pytest.raises(UnsafeCheckpointError, match="refused"):
        check_metadata(str(path))


def test_numpy_s_rng_state_loads_under_either_numpy_major_s_name():
    """The byte-item check allows NumPy's array constructor under the module names NumPy 1
    and 2 pickle it by: a checkpoint saved in an image with the one (a GPU container) loads
    where the other is installed; anything else stays refused."""
    import io
    import zipfile

    import numpy as np

    from megatron.hetero.ckpt_integrity import load_weights_only

    saved = io.BytesIO()
    torch.save({"numpy": np.random.get_state()}, saved)

    def renamed(raw, old, new):
        source, out = zipfile.ZipFile(io.BytesIO(raw)), io.BytesIO()
        with zipfile.ZipFile(out, "w") as target:
            for item in source.infolist():
                data = source.read(item.filename)
                if item.filename.endswith("data.pkl"):
                    assert old in data or new in data
                    data = data.replace(old, new)
                target.writestr(item, data)
        return out.getvalue()

    for name in (b"numpy.core.multiarray", b"numpy._core.multiarray"):
        raw = renamed(saved.getvalue(), b"numpy._core.multiarray", name)
        raw = renamed(raw, b"numpy.core.multiarray", name)
        state = load_weights_only(raw)["numpy"]
        assert state[0] == "MT19937" and np.array_equal(state[1], np.random.get_state()[1])

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    crafted = io.BytesIO()
    torch.save(Evil(), crafted)
    with pytest.raises(pickle.UnpicklingError):
        load_weights_only(crafted.getvalue())

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


class _Pid:
    """Pickles as a call of os.getpid: harmless if it ran, refused by a weights-only load."""

    def __reduce__(self):
        return (os.getpid, ())


def _byte_items(folder, crafted: set[int]):
    """A .metadata with five byte items in one file, those numbered in `crafted` refused."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder.mkdir()
    blob, storage = b"", {}
    for i in range(5):
        raw = io.BytesIO()
        torch.save(_Pid() if i in crafted else {"item": torch.arange(i + 1)}, raw)
        storage[MetadataIndex(f"item_{i}")] = _StorageInfo(
            "__0_0.distcp", len(blob), len(raw.getvalue())
        )
        blob += raw.getvalue()
    (folder / "__0_0.distcp").write_bytes(blob)
    meta = Metadata(
        state_dict_metadata={f"item_{i}": BytesStorageMetadata() for i in range(5)},
        storage_data=storage,
    )
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return str(folder)


def test_byte_items_are_checked_a_share_per_rank_and_refused_alike(tmp_path):
    """Two gloo ranks: each loads every second byte item (not all of them), and an item only
    rank 1 loads is refused on both, the first refused one named (item 2's refusal, rank 0's
    first, loses to item 1's)."""
    from tests.utils.ranks import run_ranks
    from tests.utils.workers import check_byte_items_counting_loads

    clean = _byte_items(tmp_path / "clean", set())
    crafted = _byte_items(tmp_path / "crafted", {1, 2})
    ranks = run_ranks(check_byte_items_counting_loads, 2, [clean, crafted])
    assert [r[0] for r in ranks] == [(3, None), (2, None)]  # items 0, 2, 4 and 1, 3
    refusal = f"{crafted}/__0_0.distcp: item item_1 refused"
    assert [r[1][0] for r in ranks] == [2, 1]  # rank 0 stopped at item 2, rank 1 at item 1
    assert all(r[1][1].startswith(refusal) for r in ranks), ranks
    assert "getpid" in ranks[0][1][1]

"""What --load trusts in a checkpoint folder, checked before any of it is read.

Integrity: every save writes `manifest.json`, the size and SHA-256 of each file, hashed by all
ranks in parallel (each a share of the files, read back from the page cache right after they
were written). `--load` recomputes them the same way and refuses a folder where a file is
missing, unlisted, of another size or another digest, naming it. A checkpoint saved before
manifests existed loads with a warning.

Safety: torch's dist-checkpoint reader unpickles `.metadata` with plain pickle, which runs
whatever a crafted file asks for. It is therefore first read with an unpickler that only
resolves the classes dist-checkpoint metadata is made of (`SAFE_GLOBALS`); a file that needs
anything else is refused by name and nothing of it runs. The byte items inside `.distcp` files
(the RNG states, het-TP's runtime state, layers' extra state) torch unpickles without
restriction too (dist-checkpoint's `load_bytes`), so each is first loaded from the file with
`weights_only=True` (tensors, containers, numbers, and NumPy's arrays for the RNG states),
each rank a share of them; one that needs more is refused naming it, on every rank.
`common.pt` torch reads with `weights_only=True`.
A manifest is not a signature: someone who can write the folder can rewrite it too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
METADATA = ".metadata"
_CHUNK = 8 << 20

SAFE_GLOBALS = {
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "TensorWriteData",
        "WriteItem",
        "WriteItemType",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file asks to run code or is damaged; nothing of it was restored."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"needs {module}.{name}, which checkpoint metadata never does")


def check_metadata(path: str):
    """The dist-checkpoint metadata at `path`; UnsafeCheckpointError if its pickle needs
    anything beyond SAFE_GLOBALS."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # noqa: BLE001 - any failure: the file is not loaded
        raise UnsafeCheckpointError(f"{path} refused: {err}") from None


def _numpy_globals() -> list:
    """What NumPy's RNG state (saved with the RNG states) needs to unpickle: arrays, dtypes;
    the array constructor under the names NumPy 1 and 2 pickle it by (a checkpoint saved in an
    image with the one loads in an environment with the other)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1
        from numpy.core.multiarray import _reconstruct
    names = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")
    return [
        *((_reconstruct, name) for name in names),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def load_weights_only(raw: bytes):
    """A byte item's object, loaded as torch does with `weights_only=True` (NumPy's arrays
    allowed), onto the CPU; raises what torch raises for anything more."""
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def check_byte_items(folder: str, metadata) -> None:
    """Raise UnsafeCheckpointError naming the first byte item of the checkpoint in `folder` that
    does not load with `weights_only=True`, or that lies outside the folder or behind a storage
    transform (this trainer writes none), before torch unpickles them unrestricted. Each rank
    checks every world-th item (a job holds a few per rank, so checking all of them on every
    rank would read world-squared items) and all raise the same first refusal."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    items = {
        fqn
        for fqn, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, BytesStorageMetadata)
    }
    stored = sorted((metadata.storage_data or {}).items(), key=lambda kv: kv[0].fqn)
    checks = [(index, info) for index, info in stored if index.fqn in items]
    rank, world = _share()
    first = None  # (position in checks, refusal) of this rank's first refused item
    for position in range(rank, len(checks), world):
        refusal = _byte_item_refusal(folder, *checks[position])
        if refusal is not None:
            first = (position, refusal)
            break
    found = sorted(f for f in _gathered(first) if f is not None)
    if found:
        raise UnsafeCheckpointError(found[0][1])


def _byte_item_refusal(folder: str, index, info) -> str | None:
    """Why one byte item is refused (None: it loads with `weights_only=True`)."""
    root = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(folder, info.relative_path))
    named = f"{os.path.join(folder, info.relative_path)}: item {index.fqn}"
    if os.path.commonpath([root, path]) != root:
        return f"{named} refused: it lies outside {folder}"
    if getattr(info, "transform_descriptors", None):
        return f"{named} refused: stored behind a transform"
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        load_weights_only(raw)
    except Exception as err:  # noqa: BLE001 - any failure: the item is not loaded
        return f"{named} refused: {_why(err)}"
    return None


def _why(err: Exception) -> str:
    """One line of a failed weights-only load: what it met (torch's message is a page)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    met = [line for line in lines if "GLOBAL" in line or "global" in line]
    return (met or lines or [type(err).__name__])[0]


def _digest(path: str) -> dict:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha.hexdigest()}


def _digests(folder: str, names: list[str]) -> dict:
    """{name: digest} of `names`, each rank hashing every world-th file; the same dict on every
    rank. A file that cannot be read gets {"error": ...}."""
    rank, world = _share()
    mine = {}
    for name in names[rank::world]:
        try:
            mine[name] = _digest(os.path.join(folder, name))
        except OSError as err:
            mine[name] = {"error": err.strerror or str(err)}
    return {name: d for part in _gathered(mine) for name, d in part.items()}


def _share() -> tuple[int, int]:
    """(rank, world size) of the job that checks a folder together ((0, 1) alone)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _gathered(mine) -> list:
    """Every rank's `mine`, in rank order, on every rank."""
    if _share()[1] == 1:
        return [mine]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def _files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n != MANIFEST)


def write_manifest(folder: str) -> None:
    """Every rank: hash the files of a just-written checkpoint; rank 0 writes the manifest."""
    names = _files(folder) if (not dist.is_initialized() or dist.get_rank() == 0) else None
    if dist.is_initialized():
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    digests = _digests(folder, names)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(folder, MANIFEST), "w") as f:
            json.dump({"version": 1, "files": digests}, f, indent=0, sort_keys=True)


def verify_file(folder: str, name: str) -> None:
    """On this rank alone: raise UnsafeCheckpointError where `name` differs from the folder's
    manifest (before a single file is read ahead of `verify`; a folder without a manifest, or
    a file it does not list, is left to `verify`)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            want = json.load(f)["files"].get(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if want is None:
        return
    path = os.path.join(folder, name)
    try:
        have = _digest(path)
    except OSError as err:
        raise UnsafeCheckpointError(f"{path} is damaged: {err.strerror or err}") from None
    if have != {k: want.get(k) for k in have}:
        raise UnsafeCheckpointError(f"{path} is damaged: it differs from the manifest")


def verify(folder: str) -> str | None:
    """Every rank: raise UnsafeCheckpointError naming the first damaged, missing, unlisted or
    unsafe file; returns a warning for a checkpoint without a manifest, else None."""
    warning = None
    if not os.path.isdir(folder):  # the tracker names an iteration whose folder is gone
        raise UnsafeCheckpointError(f"{folder} is missing (named by the checkpoint's tracker)")
    if not os.path.exists(os.path.join(folder, METADATA)):
        raise UnsafeCheckpointError(f"{os.path.join(folder, METADATA)} is missing")
    manifest_path = os.path.join(folder, MANIFEST)
    if os.path.exists(manifest_path):
        try:
            with open(manifest_path) as f:
                listed = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UnsafeCheckpointError(f"{manifest_path} is unreadable ({err})") from None
        present = _files(folder)
        extra = sorted(set(present) - set(listed))
        if extra:
            raise UnsafeCheckpointError(
                f"{os.path.join(folder, extra[0])} is not in the checkpoint's manifest"
            )
        got = _digests(folder, sorted(listed))
        for name in sorted(listed):
            want, have = listed[name], got.get(name, {})
            if "error" in have:
                why = have["error"]
            elif have.get("size") != want.get("size"):
                why = f"{have.get('size')} bytes, the manifest says {want.get('size')}"
            elif have.get("sha256") != want.get("sha256"):
                why = "its SHA-256 differs from the manifest's"
            else:
                continue
            raise UnsafeCheckpointError(f"{os.path.join(folder, name)} is damaged: {why}")
    else:
        warning = f"{folder} has no {MANIFEST} (saved before manifests): not verified"
    check_byte_items(folder, check_metadata(os.path.join(folder, METADATA)))
    return warning

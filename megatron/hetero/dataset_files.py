"""A cheap structural check of megatron-core's indexed dataset files, before training starts.

megatron-core reads `<prefix>.idx` with asserts and memory-maps `<prefix>.bin`; a truncated or
overwritten file surfaces as an assertion or an index error deep in the data loader, naming no
file. This reads the index header and its last entries (constant time, whatever the dataset's
size) and checks that both files are as long as the index says.
"""

from __future__ import annotations

import os
import struct

_HEADER = b"MMIDIDX\x00\x00"  # megatron-core's _INDEX_HEADER, version 1
_PREAMBLE = len(_HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequences, documents


class DatasetFileError(ValueError):
    """An indexed dataset file is damaged; the message names it."""


def check_indexed_dataset(prefix: str) -> int:
    """Raise DatasetFileError naming the file if `prefix`.idx/.bin cannot be a valid pair;
    else the bytes of the .bin that the index covers."""
    from megatron.core.datasets.indexed_dataset import DType

    idx, bin_ = prefix + ".idx", prefix + ".bin"
    size = os.path.getsize(idx)

    def bad(path, why):
        return DatasetFileError(f"{path} is corrupt: {why} (rebuild it with preprocess_data.py)")

    with open(idx, "rb") as f:
        head = f.read(_PREAMBLE)
        if len(head) < _PREAMBLE or head[: len(_HEADER)] != _HEADER:
            raise bad(idx, "not a megatron-core index (bad header)")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(_HEADER) :])
        if version != 1:
            raise bad(idx, f"index version {version}, expected 1")
        try:
            itemsize = DType.size(DType.dtype_from_code(code))
        except (KeyError, ValueError):
            raise bad(idx, f"unknown token dtype code {code}") from None
        expected = _PREAMBLE + 12 * sequences + 8 * documents
        if size != expected:
            raise bad(
                idx,
                f"{size} bytes, but its header ({sequences} sequences, {documents} documents) "
                f"needs {expected}",
            )
        if documents == 0 or sequences == 0:
            return 0
        f.seek(_PREAMBLE + 4 * (sequences - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(_PREAMBLE + 4 * sequences + 8 * (sequences - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
        f.seek(size - 8)
        (last_document,) = struct.unpack("<q", f.read(8))
    if last_length < 0 or last_pointer < 0 or last_document != sequences:
        raise bad(idx, "its sequence table is inconsistent")
    needed = last_pointer + last_length * itemsize
    have = os.path.getsize(bin_)
    if have < needed:
        raise bad(bin_, f"{have} bytes, but {idx} indexes {needed}")
    return needed


def sequence_lengths(prefix: str):
    """The tokens of each sequence of a checked `prefix`.idx (what --split divides), mapped
    from the file rather than read."""
    import numpy as np

    with open(prefix + ".idx", "rb") as f:
        f.seek(len(_HEADER) + 9)
        (sequences,) = struct.unpack("<Q", f.read(8))
    if sequences == 0:
        return np.zeros(0, dtype=np.int32)
    return np.memmap(
        prefix + ".idx", dtype=np.int32, mode="r", offset=_PREAMBLE, shape=(sequences,)
    )


def sampled_token_range(
    prefix: str, indexed_bytes: int, windows: int = 4, window_bytes: int = 1 << 16
) -> tuple[int, int]:
    """The smallest and largest token id in `windows` evenly spaced stretches of the first
    `indexed_bytes` of a checked `prefix`.bin (what check_indexed_dataset returns: bytes past
    it are no sequence's; 256 KiB read by default, whatever the dataset's size), so that a
    corpus tokenized with another tokenizer than the run's is found at start, where
    megatron-core would index past the embedding (an error at TP=1) or silently embed zeros
    (TP > 1). (0, -1) for an empty file."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType

    with open(prefix + ".idx", "rb") as f:
        f.seek(len(_HEADER) + 8)
        (code,) = struct.unpack("<B", f.read(1))
    dtype = np.dtype(DType.dtype_from_code(code))
    tokens = indexed_bytes // dtype.itemsize
    if tokens == 0:
        return 0, -1
    data = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(tokens,))
    span = max(1, window_bytes // dtype.itemsize)
    starts = {int(i) for i in np.linspace(0, max(0, tokens - span), windows)}
    stretches = [data[start : start + span] for start in starts]
    return min(int(s.min()) for s in stretches), max(int(s.max()) for s in stretches)

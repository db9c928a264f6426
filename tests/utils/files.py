"""Files tests build and then damage: a tiny indexed corpus, bytes overwritten or cut off."""

from __future__ import annotations

import contextlib
import io
import json
import os

from tests.utils.scripts import load_script


def make_corpus(folder, documents: int = 4) -> str:
    """A byte-level indexed dataset of a few short documents; returns its prefix. Written by
    scripts/preprocess_data.py's own main(), in this process (a fresh interpreter would spend
    seconds importing torch and megatron-core for a file of a few bytes)."""
    src = os.path.join(folder, "in.jsonl")
    with open(src, "w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": f"document {i} " * 5}) + "\n")
    prefix = os.path.join(folder, "c")
    with contextlib.redirect_stdout(io.StringIO()):
        load_script("preprocess_data").main(
            ["--input", src, "--output-prefix", prefix, "--append-eod"]
        )
    return prefix + "_text_document"


def damage(path: str, how: str, offset: int | None = None) -> None:
    """truncate: drop the last 3 bytes; header: overwrite the first 4; flip: xor one byte (at
    `offset`, default the middle); ff: 4 KiB of 0xFF from the middle (or `offset`)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    middle = len(data) // 2 if offset is None else offset
    if how == "truncate":
        data = data[: len(data) - 3]
    elif how == "header":
        data[:4] = b"\xff" * 4
    elif how == "flip":
        data[middle] ^= 0x40
    elif how == "ff":
        end = min(len(data), middle + 4096)
        data[middle:end] = b"\xff" * (end - middle)
    else:
        raise ValueError(how)
    with open(path, "wb") as f:
        f.write(bytes(data))

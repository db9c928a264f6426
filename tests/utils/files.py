"""Files tests build and then damage: a tiny indexed corpus, bytes overwritten or cut off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.utils.paths import ROOT


def make_corpus(folder, documents: int = 4) -> str:
    """A byte-level indexed dataset of a few short documents; returns its prefix."""
    src = os.path.join(folder, "in.jsonl")
    with open(src, "w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": f"document {i} " * 5}) + "\n")
    prefix = os.path.join(folder, "c")
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "preprocess_data.py"),
            "--input",
            src,
            "--output-prefix",
            prefix,
            "--append-eod",
        ],
        check=True,
        capture_output=True,
        text=True,
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

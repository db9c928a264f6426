"""Machine-readable run metrics: one JSON object per line, flushed as written.

Benchmarks and plots read these files instead of parsing log text. Every record has a `kind`
("run", "train", "eval", ...) so readers can pick what they need.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings so the file stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        self._file.write(json.dumps(_clean({"kind": kind, **fields}), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path: str, kind: str | None = None) -> Iterator[dict]:
    """Records of a metrics file, optionally only those of one kind."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if kind is None or record.get("kind") == kind:
                    yield record

"""scripts/*.py as modules, for tests of their pure parts (the scripts are not a package)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

from tests.utils.paths import ROOT


@functools.cache
def load_script(name: str):
    """scripts/<name>.py, imported once and registered under `name` (its dataclasses look
    their module up in sys.modules), with scripts/ importable as when it runs (the scripts
    import their shared modules, e.g. gloo_ranks, by name)."""
    folder = os.path.join(ROOT, "scripts")
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

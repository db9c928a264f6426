"""Upstream Megatron-LM trees for the tests of the patch and the upstream route."""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.utils.paths import ROOT

PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1.patch")


def fresh_megatron_lm(dest: str) -> str:
    """A copy of $HETTP_MEGATRON_LM at `dest` as extracted: the patch is taken out again when
    the given tree was patched already."""
    shutil.copytree(os.environ["HETTP_MEGATRON_LM"], dest, symlinks=True)
    reverse = ["git", "apply", "-R", "--check", PATCH]
    if subprocess.run(reverse, cwd=dest, capture_output=True).returncode == 0:
        subprocess.run(["git", "apply", "-R", PATCH], cwd=dest, check=True)
    return dest

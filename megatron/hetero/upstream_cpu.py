"""Upstream Megatron-LM's own pretrain_gpt.py on a CPU-only torch build, for development and CI.

megatron-core's CUDA-only spots are covered by cpu_compat.py (the same shims this project's
trainer runs under). Upstream's training package (megatron/training, megatron/legacy) and two
spots of the checkout's megatron-core that only its entry script reaches (dist-checkpointing's
spawned Manager, the datasets helper build) need ten more; each is covered here by one
`TreeShim` that names the upstream file and line it
covers and the source text expected there. `check(tree)` reads every one of those lines before
anything is imported, so a Megatron-LM version that moves one fails at start with the file and
line, instead of running half-shimmed. GPU runs never use this module (scripts/upstream_cpu.py
refuses to start where CUDA is available).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import sysconfig
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cpu_compat import CompatError


@dataclass(frozen=True)
class TreeShim:
    name: str
    file: str  # relative to the Megatron-LM checkout
    line: int  # 1-based
    text: str  # expected (stripped) at that line
    why: str
    apply: Callable[[], None]


def _patch(module_name: str, attr: str, make: Callable):
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, make(original))


# -- the shims ----------------------------------------------------------------------------------


def _batch_invariant_stand_in():
    """initialize.py imports megatron-core's batch-invariant kernels, which import triton at
    module level; triton is a GPU package. The stand-in module raises if the mode is asked for."""
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    module = types.ModuleType(name)

    def enable_batch_invariant_mode(*args, **kwargs):
        raise SystemExit("upstream_cpu: error: --batch-invariant-mode needs triton (a GPU)")

    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    module.__file__ = "<upstream_cpu stand-in: needs triton>"
    sys.modules[name] = module


def _allow_no_cuda():
    def make(original):
        def initialize_megatron(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return original(*args, **kwargs)

        return initialize_megatron

    _patch("megatron.training.initialize", "initialize_megatron", make)
    _patch("megatron.training.training", "initialize_megatron", make)


@contextlib.contextmanager
def _cpu_as_one_device():
    """Inside: torch.cuda.device_count() answers 1 and set_device is a no-op, so upstream's
    `if device_count > 0:` branches (model-parallel groups, the RNG tracker) run; the devices
    they name map to the CPU under cpu_compat."""
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def _one_device_in(attr: str):
    def apply():
        def make(original):
            def shimmed(*args, **kwargs):
                with _cpu_as_one_device():
                    return original(*args, **kwargs)

            return shimmed

        _patch("megatron.training.initialize", attr, make)

    return apply


def _device_arch():
    # a CPU is no Blackwell: the pre-Blackwell branch asks for CUDA_DEVICE_MAX_CONNECTIONS=1,
    # which the launcher sets (it means nothing on the CPU)
    _patch("megatron.training.arguments", "get_device_arch_version", lambda original: lambda: 0)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _no_fused_kernels():
    _patch("megatron.legacy.fused_kernels", "load", lambda original: lambda args: None)


class _CpuStream:
    """torch.cuda.Stream's interface for code that orders work on streams: the CPU runs in
    program order, so waiting and switching are no-ops."""

    def wait_stream(self, other):
        return None

    def synchronize(self):
        return None

    def wait_event(self, event):
        return None


def _streams():
    stream = _CpuStream()
    torch.cuda.Stream = lambda *args, **kwargs: _CpuStream()
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()


def _rng_state():
    # the CPU has no CUDA generator; upstream saves the CPU one beside it (torch_rng_state)
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None


def _entry_script_workers():
    """dist-checkpointing starts a Manager with the spawn start method; a spawned process
    re-imports the parent's __main__, here upstream's pretrain_gpt.py, whose imports need the
    shims it does not have. Its workers need no main module (their targets live in
    megatron.core), so they start without one."""
    from multiprocessing import spawn

    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    spawn.get_preparation_data = get_preparation_data


def _dataset_helpers():
    """The datasets Makefile runs whatever `python3`/`python3-config` is first on PATH; build
    the helper for this interpreter instead."""

    def make(original):
        def compile_helpers():
            folder = os.path.dirname(importlib.import_module("megatron.core.datasets").__file__)
            includes = subprocess.run(
                [sys.executable, "-m", "pybind11", "--includes"],
                capture_output=True,
                text=True,
            )
            if includes.returncode != 0:
                raise SystemExit(
                    "upstream_cpu: error: building megatron/core/datasets' helper needs pybind11 "
                    f"in {sys.executable}: " + includes.stderr.strip()
                )
            command = [
                "make",
                "-C",
                folder,
                "CPPFLAGS=" + includes.stdout.strip(),
                "LIBEXT=" + sysconfig.get_config_var("EXT_SUFFIX"),
            ]
            if subprocess.run(command).returncode != 0:
                raise SystemExit("upstream_cpu: error: " + " ".join(command) + " failed")

        return compile_helpers

    _patch("megatron.core.datasets.utils", "compile_helpers", make)


SHIMS: tuple[TreeShim, ...] = (
    TreeShim(
        "batch_invariant_kernels",
        "megatron/training/initialize.py",
        25,
        "from megatron.core.transformer.custom_layers.batch_invariant_kernels import "
        "enable_batch_invariant_mode",
        "imports triton at module level (a GPU package)",
        _batch_invariant_stand_in,
    ),
    TreeShim(
        "allow_no_cuda",
        "megatron/training/initialize.py",
        62,
        'assert torch.cuda.is_available(), "Megatron requires CUDA."',
        "initialize_megatron asserts CUDA unless allow_no_cuda, which pretrain() does not pass",
        _allow_no_cuda,
    ),
    TreeShim(
        "model_parallel_groups",
        "megatron/training/initialize.py",
        360,
        "if device_count > 0:",
        "_initialize_distributed creates no model-parallel groups without a CUDA device",
        _one_device_in("_initialize_distributed"),
    ),
    TreeShim(
        "rng_tracker",
        "megatron/training/initialize.py",
        422,
        "if torch.cuda.device_count() > 0:",
        "_set_random_seed seeds no model-parallel RNG tracker without a CUDA device",
        _one_device_in("_set_random_seed"),
    ),
    TreeShim(
        "device_arch",
        "megatron/training/arguments.py",
        928,
        "and get_device_arch_version() < 10:",
        "validate_args reads the GPU's compute capability when TP > 1 or CP > 1",
        _device_arch,
    ),
    TreeShim(
        "fused_kernels",
        "megatron/training/initialize.py",
        224,
        "fused_kernels.load(args)",
        "builds CUDA kernels with nvcc (legacy/fused_kernels); megatron-core does not use them",
        _no_fused_kernels,
    ),
    TreeShim(
        "ddp_stream",
        "megatron/training/training.py",
        1325,
        "ddp_stream = torch.cuda.Stream()",
        "get_model creates DDP on a side CUDA stream",
        _streams,
    ),
    TreeShim(
        "checkpoint_rng",
        "megatron/training/checkpointing.py",
        343,
        "'cuda_rng_state': torch.cuda.get_rng_state(),",
        "checkpoints (and rerun_state_machine.py:957) save the CUDA generator's state",
        _rng_state,
    ),
    TreeShim(
        "worker_processes",
        "megatron/core/dist_checkpointing/strategies/filesystem_async.py",
        54,
        'ctx = mp.get_context("spawn")',
        "dist-checkpointing worker processes would re-import the entry script unshimmed",
        _entry_script_workers,
    ),
    TreeShim(
        "dataset_helpers",
        "megatron/core/datasets/Makefile",
        2,
        "CPPFLAGS += $(shell python3 -m pybind11 --includes)",
        "the datasets helper is built with whatever python3 is on PATH",
        _dataset_helpers,
    ),
)

_TREE_ONLY = {"batch_invariant_kernels"}  # applied before megatron.training is imported


SLACK = 8  # lines: hettp's patch adds a few above some of them


def _near(lines: list[str], line: int, text: str) -> bool:
    low, high = max(0, line - 1 - SLACK), min(len(lines), line + SLACK)
    return any(lines[i].strip() == text for i in range(low, high))


def check(tree: str) -> None:
    """Every shim's upstream line is where it should be; CompatError naming each one that is not."""
    moved = []
    for shim in SHIMS:
        path = os.path.join(tree, shim.file)
        try:
            with open(path) as handle:
                lines = handle.read().splitlines()
        except OSError as err:
            moved.append(f"{shim.file}: {err.strerror}")
            continue
        if not _near(lines, shim.line, shim.text):
            found = lines[shim.line - 1].strip() if shim.line <= len(lines) else "past the end"
            moved.append(f"{shim.file}:{shim.line} is {found!r}, expected {shim.text!r}")
    if moved:
        raise CompatError(
            "this Megatron-LM is not the one the CPU shims cover (core_v0.16.1): "
            + "; ".join(moved)
        )


def activate(tree: str) -> None:
    """Check the tree, then install cpu_compat's shims and every TreeShim (CPU builds only)."""
    if torch.cuda.is_available():
        raise SystemExit("upstream_cpu: error: CUDA is available; run upstream directly")
    check(tree)
    for shim in SHIMS:
        if shim.name in _TREE_ONLY:
            shim.apply()
    from . import cpu_compat

    cpu_compat.activate()
    for shim in SHIMS:
        if shim.name not in _TREE_ONLY:
            shim.apply()

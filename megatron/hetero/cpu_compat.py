"""Shims that let megatron-core 0.16.1's GPT training path run on a CPU-only torch build.

megatron-core assumes CUDA in a few dozen places. On a machine without it (dev boxes, CI) we
redirect those places to the CPU, so the very same megatron-core code (GPTModel, DDP,
get_megatron_optimizer, the forward-backward schedule, dist_checkpointing) runs over gloo.

Rules:
- `activate()` is the only entry point and does nothing when CUDA is available: a GPU run
  never sees these shims.
- Every shim names the upstream symbol(s) it covers. Before patching, `activate()` checks each
  of them still exists and raises `CompatError` otherwise, so an upgrade of megatron-core that
  moves a symbol fails loudly at start instead of silently running unshimmed.
- tests/hetero/test_cpu_compat.py exercises each covered upstream path; it fails when a shim stops
  covering it.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode


class CompatError(RuntimeError):
    """An upstream symbol a CPU shim relies on is missing (megatron-core changed)."""


@dataclass(frozen=True)
class Shim:
    name: str
    covers: tuple[str, ...]  # "module:attribute" of the upstream symbols it replaces or fixes
    why: str


SHIMS = (
    Shim(
        "current_device",
        ("torch.cuda:current_device",),
        "~175 megatron-core call sites allocate with device=torch.cuda.current_device() "
        "(tensor_parallel.layers/mappings, DDP buffers, GPTModel, attention); "
        "on a CPU build that call raises 'Torch not compiled with CUDA enabled'.",
    ),
    Shim(
        "synchronize",
        (
            "torch.cuda:synchronize",
            "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync",
        ),
        "dist_checkpointing's filesystem writer calls torch.cuda.synchronize() before reading "
        "tensors; CPU work is already synchronous, so it becomes a no-op.",
    ),
    Shim(
        "cuda_literals",
        (
            "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
            "megatron.core.optimizer.optimizer:FP32Optimizer",
            "megatron.core.optimizer.clip_grads:get_grad_norm_fp32",
            "megatron.core.rerun_state_machine:RerunStateMachine",
            "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params",
        ),
        "hard-coded device='cuda' tensors and .cuda() calls (e.g. total_num_tokens in the "
        "schedule, FP32Optimizer._scale, the grad-norm buffer), and type-string checks such "
        "as Float16OptimizerWithFloat16Params' param.type() == 'torch.cuda.BFloat16Tensor': "
        "a torch-function mode maps devices to the CPU and answers Tensor.type() with the "
        "CUDA type name, for the whole process.",
    ),
    Shim(
        "rng_tracker",
        (
            "megatron.core.tensor_parallel.random:CudaRNGStatesTracker",
            "megatron.core.tensor_parallel.random:_CUDA_RNG_STATE_TRACKER",
            "megatron.core.tensor_parallel.random:_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        ),
        "model_parallel_cuda_manual_seed and the dropout fork keep CUDA generator states; "
        "the replacement tracker keeps CPU generator states instead.",
    ),
    Shim(
        "recompute_rng",
        (
            "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
            "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        ),
        "activation recomputation (tensor_parallel.checkpoint, --recompute-granularity) saves "
        "and restores the CUDA generator around the recomputed forward; the CPU has none (the "
        "CPU generator and the tracker's CPU states are saved beside it), so its state is an "
        "empty tensor and setting it does nothing.",
    ),
    Shim(
        "clip_grads",
        (
            "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
            "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
        ),
        "clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor'; "
        "the replacement scales the same gradients by the same coefficient on the CPU.",
    ),
)

_active = False


def _to_cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Maps device='cuda' arguments and Tensor.cuda() to the CPU; Tensor.type() answers with
    the CUDA type name (megatron-core checks those strings)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_cpu(kwargs["device"]))
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch.") :]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def _cpu_current_device():
    return torch.device("cpu")


def _no_op(*args, **kwargs):
    return None


def _no_cuda_rng_state(*args, **kwargs):
    return torch.empty(0, dtype=torch.uint8)


def _check_symbols():
    missing = []
    for shim in SHIMS:
        for target in shim.covers:
            module_name, attr = target.split(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                missing.append(f"{target} (module not importable) for shim '{shim.name}'")
                continue
            if not hasattr(module, attr):
                missing.append(f"{target} for shim '{shim.name}'")
    if missing:
        raise CompatError(
            "megatron-core changed: the CPU shims cannot cover "
            + "; ".join(missing)
            + ". hettp pins megatron-core==0.16.1."
        )


def _make_cpu_rng_tracker(base):
    class CpuRNGStatesTracker(base):
        """CudaRNGStatesTracker's bookkeeping with CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=None):
            name = name or _random()._MODEL_PARALLEL_RNG_TRACKER_NAME
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    return CpuRNGStatesTracker


def _random():
    return importlib.import_module("megatron.core.tensor_parallel.random")


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def is_active() -> bool:
    return _active


@contextlib.contextmanager
def suspended():
    """Run torch-only code (no megatron-core inside) without the device mode's per-call cost."""
    if not _active:
        yield
        return
    from torch.overrides import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield


def activate() -> bool:
    """Install the shims if this torch has no CUDA. Returns True when they are active."""
    global _active
    if _active:
        return True
    if torch.cuda.is_available():
        return False
    _check_symbols()

    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _no_op
    CudaToCpuMode().__enter__()  # process-wide, never exited

    rnd = _random()
    rnd.CudaRNGStatesTracker = _make_cpu_rng_tracker(rnd.CudaRNGStatesTracker)
    rnd._CUDA_RNG_STATE_TRACKER = None
    rnd._CUDA_RNG_STATE_TRACKER_INITIALIZED = False

    rnd._get_cuda_rng_state = _no_cuda_rng_state
    rnd._set_cuda_rng_state = _no_op

    for module_name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(module_name)
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu

    _active = True
    return True

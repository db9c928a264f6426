"""--profile: iterations --profile-step-start to --profile-step-end on the --profile-ranks.

With --use-pytorch-profiler, torch.profiler records them (CPU and CUDA activity) and writes a
trace per rank into --tensorboard-dir (or logs/profile); without it, as Megatron-LM, they are
an nsys capture range (cudaProfilerStart/Stop, NVTX ranges per op), which needs CUDA.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class StepProfiler:
    def __init__(self, args):
        self.args = args
        self.active = args.profile and dist.get_rank() in set(args.profile_ranks)
        self._torch = None
        self._nvtx = None
        self.trace_dir = None
        if self.active and args.use_pytorch_profiler:
            self.trace_dir = args.tensorboard_dir or os.path.join("logs", "profile")
            start, end = args.profile_step_start, args.profile_step_end
            self._torch = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start
                ),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir),
                record_shapes=True,
            )
            self._torch.start()

    def before_step(self, iteration: int) -> None:
        """Before the step that will be `iteration` (1-based)."""
        if self.active and self._torch is None and iteration == self.args.profile_step_start + 1:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        if not self.active:
            return
        if self._torch is not None:
            self._torch.step()
            if iteration >= self.args.profile_step_end:
                self.close()
        elif self._nvtx is not None and iteration >= self.args.profile_step_end:
            self.close()

    def close(self) -> None:
        if self._torch is not None:
            self._torch.stop()
            self._torch = None
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            self._nvtx = None
        self.active = False

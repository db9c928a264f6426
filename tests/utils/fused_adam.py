"""An Adam that counts steps per parameter group, as Transformer Engine's and apex's FusedAdam
do (megatron-core picks those wherever one is installed), for CPU tests of what that changes."""

from __future__ import annotations

import torch


class GroupStepAdam(torch.optim.Optimizer):
    """FusedAdam's arithmetic and state layout: `group["step"]`, moments per parameter."""

    def __init__(self, params, lr, weight_decay, betas, eps, adam_w_mode=True):
        super().__init__(
            params, {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
        )
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue  # as FusedAdam: an empty group counts no steps
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), t = group["betas"], group["step"]
            lr, decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                grad = param.grad
                if decay and not self.adam_w_mode:
                    grad = grad.add(param, alpha=decay)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
                if decay and self.adam_w_mode:
                    param.mul_(1 - lr * decay)
                param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**t))


def using_group_step_adam(fn, *args):
    """Worker `fn(*args)` with megatron-core building GroupStepAdam where it would build a fused
    Adam (call inside a rank process)."""
    import megatron.core.optimizer as optimizers
    import megatron.core.optimizer.distrib_optimizer as distributed

    optimizers.Adam, optimizers.USING_PYTORCH_OPTIMIZER = GroupStepAdam, False
    distributed.Adam = GroupStepAdam  # the class the distributed optimizer accepts
    return fn(*args)

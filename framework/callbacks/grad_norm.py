"""The gradients' norm at each logging step, per parameter group and total (`grad_norm/...`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from framework.callbacks.base import Callback, Trainer

if TYPE_CHECKING:
    from framework.task.task import Task

log = logging.getLogger(__name__)


class GradNormMonitor(Callback):
    """Log the gradient norm of each parameter group (`grad_norm/<group>`) and of all of them
    (`grad_norm/total`), before clipping and after AMP unscaling, at the trainer's logging steps. The norms stay
    on the device and are read with the loss, so monitoring adds no host sync."""

    def __init__(self, norm_type: float = 2.0) -> None:
        self.norm_type = float(norm_type)

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: "Trainer", task: "Task", optimizer: torch.optim.Optimizer) -> None:
        if (trainer.global_step + 1) % trainer.log_every_n_steps:
            return  # the step about to be taken is not a logging step
        norms = []
        for name, group in zip(trainer.param_group_names, optimizer.param_groups):
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if not grads:
                continue
            norm = torch.nn.utils.get_total_norm(grads, self.norm_type, foreach=True)  # what clipping computes
            trainer.log(f"grad_norm/{name}", norm)
            norms.append(norm)
        if norms:
            trainer.log("grad_norm/total", torch.linalg.vector_norm(torch.stack(norms), self.norm_type))

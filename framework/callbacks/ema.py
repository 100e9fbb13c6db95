"""An exponential moving average of the weights (`decay`, `warmup`), evaluated, tested and exported in place of the
raw weights with `use_for_eval`; saved in the checkpoint, resumed exactly."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Optional

import torch

from framework.callbacks.base import Callback, Trainer

if TYPE_CHECKING:
    from framework.task.task import Task

log = logging.getLogger(__name__)


class EMA(Callback):
    """An exponential moving average of the weights, updated after every optimizer step:
    `ema = decay_t * ema + (1 - decay_t) * weights`, with `decay_t = min(decay, (1 + n) / (10 + n))` after n
    updates when `warmup` (early averages then follow the fast-moving weights instead of the random start).

    `use_for_eval`: validation and test run on the averaged weights (so `val/*`, top-k and `best` rank them, and
    `python -m framework export` exports them); the raw weights are swapped back before training goes on, so a
    resumed run continues exactly. Floating-point buffers (BatchNorm statistics) are averaged too; others are
    copied. The averages live in the checkpoint's state (`callbacks/<name>/weights`). Under parallel=fsdp each
    rank averages its own shards (the averages are DTensors like the weights), and saves them."""

    def __init__(self, decay: float = 0.999, warmup: bool = True, use_for_eval: bool = True) -> None:
        if not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"decay={decay!r}: expected a number between 0 and 1 (exclusive), e.g. 0.999")
        self.decay, self.warmup, self.use_for_eval = float(decay), warmup, use_for_eval
        self.updates = 0
        self.weights: dict[str, torch.Tensor] = {}
        self._live: list[torch.Tensor] = []  # the model's tensors the averages follow, in self.weights' order
        self._averaged: list[torch.Tensor] = []
        self._float_live: list[torch.Tensor] = []
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._raw: Optional[list[torch.Tensor]] = None

    def setup(self, trainer: "Trainer", task: "Task") -> None:
        live = trainer.module.state_dict(keep_vars=True)
        self.weights = {name: t.detach().clone() for name, t in live.items()}  # a resume loads over these
        # The arithmetic runs on local tensors: a sharded weight's is a view of this rank's shard.
        self._live = [_local(live[name].detach()) for name in self.weights]
        pairs = list(zip(map(_local, self.weights.values()), self._live))
        self._averaged = [ema for ema, t in pairs if t.is_floating_point()]
        self._float_live = [t for _, t in pairs if t.is_floating_point()]
        self._copied = [(ema, t) for ema, t in pairs if not t.is_floating_point()]

    @torch.no_grad()
    def on_before_zero_grad(self, trainer: "Trainer", task: "Task", optimizer: torch.optim.Optimizer) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay
        torch._foreach_lerp_(self._averaged, self._float_live, 1.0 - decay)
        for ema, t in self._copied:
            ema.copy_(t)

    @torch.no_grad()
    def _swap_in(self) -> None:
        if self.use_for_eval and self._live:
            self._raw = [t.clone() for t in self._live]
            torch._foreach_copy_(self._live, [_local(t) for t in self.weights.values()])

    @torch.no_grad()
    def _swap_out(self) -> None:
        if self._raw is not None:
            torch._foreach_copy_(self._live, self._raw)
            self._raw = None

    def on_validation_start(self, trainer: "Trainer", task: "Task") -> None:
        self._swap_in()

    def on_validation_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        self._swap_out()

    def on_test_start(self, trainer: "Trainer", task: "Task") -> None:
        self._swap_in()

    def on_test_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        self._swap_out()

    def on_exception(self, trainer: "Trainer", task: "Task", exception: BaseException) -> None:
        self._swap_out()

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "use_for_eval": self.use_for_eval, "weights": dict(self.weights)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                self.weights[name].copy_(tensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a weight sharded by FSDP), a view that in-place updates reach; any other
    tensor as it is. Without torch.distributed.tensor imported, no DTensor exists (and the import is not paid)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor

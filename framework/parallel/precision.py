"""Numeric precision of a run: fp32, or autocast in bf16/fp16 with a GradScaler for fp16.

The optimizer step follows the GradScaler's required order: unscale -> clip -> step -> update, so that
clipping sees true gradients and a step with inf/NaN gradients is skipped (and reported as skipped).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch


def _bf16_supported(device: torch.device) -> bool:
    """Native bf16 on the run's own device. Not torch.cuda.is_bf16_supported(): it counts emulation (V100, T4:
    bf16 there is slow) and asks the current device, which need not be the run's."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


class Precision:
    def __init__(self, mode: str, device: torch.device) -> None:
        if mode == "amp":
            mode = "bf16" if _bf16_supported(device) else "fp16"
        self.device_type = device.type
        self.dtype: Optional[torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
        self.scaler = torch.amp.GradScaler(device.type) if self.dtype is torch.float16 else None
        # The scale after the last update, read once per step (get_scale() syncs the host with the device).
        # Before the first step the scaler holds no tensor yet, so this read is free.
        self._scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        self.skipped_steps = 0

    @property
    def scale(self) -> Optional[float]:
        """The GradScaler's scale after the last optimizer step, for logging (no host sync); None without one."""
        return self._scale if self.scaler is not None else None

    @property
    def name(self) -> str:
        """What runs, as reported in summary.json: fp32, bf16-autocast or fp16-autocast+gradscaler."""
        if self.dtype is None:
            return "fp32"
        name = "bf16-autocast" if self.dtype is torch.bfloat16 else "fp16-autocast"
        return name + ("+gradscaler" if self.scaler is not None else "")

    def autocast(self) -> ContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """`loss.backward(...)`, scaled by the GradScaler under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(*args, **kwargs)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer`'s gradients as true ones under fp16 (once per step: `step` is then told `unscaled`)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        params: Iterable[torch.nn.Parameter],
        clip_norm: Optional[float],
        clip_value: Optional[float],
        before_step: Optional[Callable[[], None]] = None,
        unscaled: bool = False,
    ) -> bool:
        """Clip and step; returns False when the GradScaler skipped the step (inf/NaN gradients).
        `before_step` runs where the gradients are true ones: after unscaling, before clipping. `unscaled`: the
        caller unscaled them already (manual optimization's clip_gradients)."""
        if self.scaler is not None and not unscaled:
            self.scaler.unscale_(optimizer)  # clipping must see true gradients, not scaled ones
        if before_step is not None:
            before_step()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, clip_value)
        if self.scaler is None:
            optimizer.step()
            return True
        self.scaler.step(optimizer)
        self.scaler.update()
        before, self._scale = self._scale, self.scaler.get_scale()  # the step's one host sync of its own
        stepped = self._scale >= before  # update() lowers the scale exactly when it skipped
        self.skipped_steps += not stepped
        return stepped

    def state_dict(self) -> dict[str, Any]:
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._scale = self.scaler.get_scale()
        self.skipped_steps = state.get("skipped_steps", 0)

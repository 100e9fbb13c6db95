"""Callbacks: behaviour added to the loop by config, with Lightning's hook names.

A callback is a `Callback` subclass built by `_target_` from the `callbacks` config group, a dict of nodes:

    callbacks:
      early_stopping: {_target_: framework.callbacks.base.EarlyStopping, monitor: val/loss, patience: 3}

`callbacks.NAME=null` turns one off, `+callbacks.mine={_target_: ...}` (or a yaml file in conf/callbacks/) adds
one. Every hook gets the trainer and the task first, as in Lightning. A hook a callback does not override is
never called (`CallbackList` keeps, per hook, only the callbacks that implement it), so an unused hook costs
nothing per step.

State: `state_dict()`/`load_state_dict()` as in Lightning; it is saved in the pickle-free checkpoint under
the callback's config name (tensors and plain values only), and restored on resume before training goes on.

What a callback may do with the trainer: read `global_step`, `current_epoch`, `callback_metrics`,
`is_global_zero`, `run_dir`, `max_steps`, `max_epochs`; ask it to stop with `trainer.request_stop(reason)`
(the loop stops at the next optimizer-step boundary, every rank at the same one, saves `last`, then validates,
tests and writes the summary naming the reason); log a scalar with `trainer.log(name, value)` (a tensor stays
on the device until the next logging step: no host sync).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from framework.config.validate import parse_duration

if TYPE_CHECKING:  # the trainer imports this module, never the other way round
    from framework.loop.trainer import Trainer
    from framework.task.task import Task

log = logging.getLogger(__name__)

# Every hook, in the order a run calls them. Per-step hooks are in STEP_HOOKS.
HOOKS = (
    "setup",
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_train_end",
    "on_fit_end",
    "on_exception",
)
STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_train_batch_end",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)


class Callback:
    """Override the hooks you need; the others cost nothing."""

    def setup(self, trainer: "Trainer", task: "Task") -> None:
        """Once, when the trainer has built everything, before a resume's state is loaded into it."""

    def on_fit_start(self, trainer: "Trainer", task: "Task") -> None:
        """Once, before the first step (after a resume's state is restored)."""

    def on_train_start(self, trainer: "Trainer", task: "Task") -> None:
        """Once, after on_fit_start, before the first (possibly resumed) training epoch."""

    def on_train_epoch_start(self, trainer: "Trainer", task: "Task") -> None:
        """Before each (possibly resumed) training epoch."""

    def on_train_batch_start(self, trainer: "Trainer", task: "Task", batch: Any, batch_idx: int) -> None:
        """Before each batch's training_step (each micro-batch when accumulating)."""

    def on_before_backward(self, trainer: "Trainer", task: "Task", loss: Any) -> None:
        """Before each batch's backward, with the loss backward is called on."""

    def on_after_backward(self, trainer: "Trainer", task: "Task") -> None:
        """After each batch's backward, before the optimizer step (gradients still scaled under fp16)."""

    def on_train_batch_end(self, trainer: "Trainer", task: "Task", outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each batch's backward (each micro-batch when accumulating), and after the optimizer step when
        that batch completed one. `outputs` is the task's StepOutput."""

    def on_before_optimizer_step(self, trainer: "Trainer", task: "Task", optimizer: torch.optim.Optimizer) -> None:
        """Before each optimizer step, with the true (unscaled, unclipped) gradients."""

    def on_before_zero_grad(self, trainer: "Trainer", task: "Task", optimizer: torch.optim.Optimizer) -> None:
        """Right after each optimizer step, before the gradients are cleared (Lightning clears them later, before
        the next backward: the gradients are the same either way)."""

    def on_train_epoch_end(self, trainer: "Trainer", task: "Task") -> None:
        """After each completed training epoch and its validation, with the epoch's means in callback_metrics
        (Lightning 2's order); current_epoch is still this epoch's."""

    def on_validation_start(self, trainer: "Trainer", task: "Task") -> None:
        """Before each validation (by epoch or by step)."""

    def on_validation_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        """After each validation, with its metrics (reduced over every rank: the same on each)."""

    def on_test_start(self, trainer: "Trainer", task: "Task") -> None:
        """Before the test split is evaluated."""

    def on_test_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        """After the test split is evaluated, with its metrics."""

    def on_train_end(self, trainer: "Trainer", task: "Task") -> None:
        """Once, after the last training step and the final validation, before the test."""

    def on_fit_end(self, trainer: "Trainer", task: "Task") -> None:
        """Once, after training, validation and test (not when the run fails or is stopped by a signal)."""

    def on_exception(self, trainer: "Trainer", task: "Task", exception: BaseException) -> None:
        """When the run ends by an error or a signal; `last` is already saved for a signal."""

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs: tensors and plain values (saved without pickle)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(Callback, hook)


class CallbackList:
    """The run's callbacks by config name, and per hook the bound methods of those that implement it. `first`
    (the task's own Lightning hooks, framework/task/hooks.py) runs before them and has no state."""

    def __init__(self, callbacks: dict[str, Callback], first: Optional[Callback] = None) -> None:
        self.callbacks = dict(callbacks)
        every = ([first] if first is not None else []) + list(self.callbacks.values())
        self.hooks: dict[str, list[Callable[..., None]]] = {
            hook: [getattr(cb, hook) for cb in every if _overrides(cb, hook)] for hook in HOOKS
        }

    def __iter__(self) -> Iterator[tuple[str, Callback]]:
        return iter(self.callbacks.items())

    def call(self, hook: str, *args: Any) -> None:
        for fn in self.hooks[hook]:
            fn(*args)

    def bound(self, hook: str) -> Optional[Callable[..., None]]:
        """One callable running every implementation of a per-step hook, or None when there is none (the loop
        then skips the call altogether)."""
        fns = self.hooks[hook]
        if not fns:
            return None
        if len(fns) == 1:
            return fns[0]

        def every(*args: Any) -> None:
            for fn in fns:
                fn(*args)

        return every

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self.callbacks.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, cb in self.callbacks.items():
            if name in state:
                cb.load_state_dict(state[name])


# ---------------------------------------------------------------------------------------------- built-ins
class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` validations in a row, or as
    soon as it passes `stopping_threshold`, or when it is not finite (`check_finite`). Lightning's arguments."""

    def __init__(
        self,
        monitor: str = "val/loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        stopping_threshold: Optional[float] = None,
        check_finite: bool = True,
        verbose: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: expected 'min' or 'max'")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"patience={patience!r}: expected a whole number >= 1")
        if not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"min_delta={min_delta!r}: expected a number >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.stopping_threshold, self.check_finite, self.verbose = stopping_threshold, check_finite, verbose
        self.wait_count = 0
        self.best_score: Optional[float] = None
        self.best_step = -1
        self.stopped = ""  # why it stopped the run: kept, so a resumed run stops again (see on_fit_start)
        self.by_patience = False

    def _better(self, value: float, than: float) -> bool:
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta

    def on_validation_end(self, trainer: "Trainer", task: "Task", metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:  # the trainer checked the name at start: a task that changed its metrics
            raise RuntimeError(
                f"EarlyStopping: monitor {self.monitor!r} is not among this validation's metrics ({', '.join(metrics)})"
            )
        value = metrics[self.monitor]
        reason, self.stopped = None, ""
        if self.check_finite and not math.isfinite(value):
            reason = f"{self.monitor} = {value} is not finite"
        elif self.stopping_threshold is not None and (
            value <= self.stopping_threshold if self.mode == "min" else value >= self.stopping_threshold
        ):
            reason = f"{self.monitor} = {value:.6g} reached stopping_threshold {self.stopping_threshold}"
        elif self.best_score is None or self._better(value, self.best_score):
            self.best_score, self.best_step, self.wait_count = value, trainer.global_step, 0
            return
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                reason = (
                    f"{self.monitor} did not improve by more than {self.min_delta:g} for {self.patience} "
                    f"validation{'s' if self.patience > 1 else ''} (best {self.best_score:.6g} at step "
                    f"{self.best_step})"
                )
        if reason is not None:
            self.stopped, self.by_patience = f"early stopping: {reason}", self.wait_count >= self.patience
            trainer.request_stop(self.stopped)

    def on_fit_start(self, trainer: "Trainer", task: "Task") -> None:
        # A resumed run that this callback stopped stops again, unless its patience was raised on resume.
        if self.stopped and not (self.by_patience and self.wait_count < self.patience):
            trainer.request_stop(self.stopped)

    def state_dict(self) -> dict[str, Any]:
        # JSON has no infinity: "no best yet" is the step -1.
        return {
            "wait_count": self.wait_count,
            "best_score": self.best_score if self.best_score is not None else 0.0,
            "best_step": self.best_step,
            "stopped": self.stopped,
            "by_patience": self.by_patience,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count, self.best_step = int(state["wait_count"]), int(state["best_step"])
        self.best_score = float(state["best_score"]) if self.best_step >= 0 else None
        self.stopped, self.by_patience = str(state["stopped"]), bool(state["by_patience"])


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


class Timer(Callback):
    """Lightning's Timer (what `trainer.max_time` adds): stop cleanly once training has taken `duration`. The loop
    stops at the next optimizer-step boundary, saves `last`, then validates, tests and reports as usual.

    `scope="job"` (what `trainer.max_time` uses) counts this job only, like a cluster's time limit: set it a little
    under the job's limit, and each start of the same command (a requeued or restarted job, `resume=`) gets the
    whole budget again and continues where the last one stopped. `scope="run"` (Lightning's) counts the time of
    every job of the run, so a resumed run gets only what is left. Either way the total time trained is kept in
    the checkpoint and reported."""

    SCOPES = ("job", "run")

    def __init__(self, duration: Any, scope: str = "job") -> None:
        seconds = parse_duration(duration)
        if seconds is None:
            raise ValueError(
                f"duration={duration!r}: expected DD:HH:MM:SS (e.g. 00:12:00:00) or a number of seconds > 0"
            )
        if scope not in self.SCOPES:
            raise ValueError(f"scope={scope!r}: expected one of {', '.join(self.SCOPES)}")
        self.duration = seconds
        self.scope = scope
        self.elapsed_before = 0.0  # seconds trained by the jobs this one resumes
        self._started = time.monotonic()

    def elapsed(self) -> float:
        """Seconds trained in all, across resumes."""
        return self.elapsed_before + self.job_elapsed()

    def job_elapsed(self) -> float:
        """Seconds trained by this job."""
        return time.monotonic() - self._started

    def on_fit_start(self, trainer: "Trainer", task: "Task") -> None:
        self._started = time.monotonic()
        self._check(trainer)

    def on_train_batch_end(self, trainer: "Trainer", task: "Task", outputs: Any, batch: Any, batch_idx: int) -> None:
        self._check(trainer)

    def _check(self, trainer: "Trainer") -> None:
        used = self.job_elapsed() if self.scope == "job" else self.elapsed()
        if used >= self.duration:
            where = "in this job" if self.scope == "job" else "in this run"
            trainer.request_stop(
                f"time limit: trained for {used:.0f} s {where} of trainer.max_time="
                f"{self.duration:.0f} s ({self.elapsed():.0f} s in all)"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elapsed_before = float(state["elapsed"])


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

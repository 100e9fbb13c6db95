"""The learning-rate range test (Smith 2017; fastai's `lr_find`, Lightning's `Tuner.lr_find`): `python run.py lr_find`.

It trains the run's own config (its optimizer and parameter groups with their `lr_mult`s, `accumulate_grad_batches`,
precision, gradient clipping and parallel strategy) for `lr_find.num_steps` optimizer steps, the learning rate
growing exponentially from `lr_find.min_lr` to `lr_find.max_lr`: each group's lr is its configured lr scaled by
`lr / optimizer.lr`, so the multipliers hold. Each step's loss is the mean over its micro-batches and, under DDP,
over the ranks (one all-reduce), so every rank draws the same curve and stops at the same step: when the smoothed
loss exceeds `lr_find.early_stop_threshold` times its minimum, or is not finite. The suggestion is fastai's `lr_min`: a
tenth of the lr where the smoothed loss is lowest, past the first steps. The model, optimizer and
precision states are put back afterwards and no checkpoint is written; rank 0 writes `lr_find.json` (the curve),
`lr_find.png` (the plot; matplotlib's when installed, else drawn with Pillow) and the curve to TensorBoard
(`lr_find/*`), and prints the suggestion as an override to copy: `optimizer.lr=...`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from framework.callbacks import task_hooks
from framework.core import reproducibility
from framework.core.errors import ConfigError
from framework.core.files import write_json
from framework.loop.evaluate import move_to
from framework.loop.preflight import check_first_batches
from framework.loop.run import Run, assemble
from framework.observe.summary import SUMMARY_LOGGER
from framework.task.task import StepOutput, as_step_output, swapped

log = logging.getLogger(__name__)
RECORD, PLOT = "lr_find.json", "lr_find.png"
SKIP_BEGIN, SKIP_END = 10, 1  # Lightning's: the first steps' loss barely moves, the last may have diverged


@dataclass
class Curve:
    """The range test's result: each step's lr, raw and smoothed loss, and the suggested lr (None: too short)."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    suggestion: Optional[float] = None
    steepest: Optional[float] = None  # Lightning's rule's lr, for comparison
    stopped: str = ""  # why it ended before num_steps, if it did


def schedule(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """`steps` learning rates growing exponentially from `min_lr` to `max_lr`, both included."""
    if steps == 1:
        return [min_lr]
    return [min_lr * (max_lr / min_lr) ** (i / (steps - 1)) for i in range(steps)]


def suggest(lrs: list[float], smoothed: list[float]) -> Optional[float]:
    """A tenth of the lr where the smoothed loss is lowest, past the first SKIP_BEGIN steps (fastai's `lr_min`);
    None when no step past them has a finite loss. (Lightning's rule, the steepest descent, lands where the moving
    average's lag puts it: on the digits MLP at 0.25, next to where training diverges; docs/lr_find.md.)"""
    losses = np.asarray(smoothed[SKIP_BEGIN:], dtype=np.float64)
    if not np.isfinite(losses).any():
        return None
    return lrs[SKIP_BEGIN + int(np.nanargmin(np.where(np.isfinite(losses), losses, np.nan)))] / 10


def steepest(lrs: list[float], smoothed: list[float]) -> Optional[float]:
    """Lightning's suggestion, for comparison (in lr_find.json): the lr of the steepest descent of the smoothed loss
    per step (steps are equal in log-lr), skipping the first SKIP_BEGIN and last SKIP_END steps."""
    losses = np.asarray(smoothed[SKIP_BEGIN : len(smoothed) - SKIP_END], dtype=np.float64)
    finite = np.flatnonzero(np.isfinite(losses))
    if len(finite) < 2:
        return None
    return lrs[SKIP_BEGIN + int(finite[int(np.argmin(np.gradient(losses[finite])))])]


def find_lr(cfg: DictConfig, run_dir: Path, choices: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The `lr_find` stage, on every rank: the run built as fit builds it (its task's setup sees "fit", as in
    Lightning's tuner), the range test, the states put back; rank 0 writes and prints the result."""
    start = time.perf_counter()
    fit_cfg = copy.deepcopy(cfg)
    with open_dict(fit_cfg):
        fit_cfg.stage = "fit"
    run = assemble(fit_cfg, run_dir, choices=choices)
    finished, curve = False, None
    if cfg.trainer.max_steps > 0 and run.strategy.is_rank_zero:
        log.info(  # as in Lightning's tuner the length is the test's own; said, so it is not taken for a cap
            "lr_find: trainer.max_steps=%d is fit's length, not the range test's: it takes lr_find.num_steps=%d "
            "optimizer steps",
            cfg.trainer.max_steps,
            cfg.lr_find.num_steps,
        )
    try:
        if not run.optimizers.single or not run.task.automatic_optimization:
            raise ConfigError(
                f"lr_find: {type(run.task).__name__} has {len(run.optimizers)} optimizer(s) under "
                f"{'automatic' if run.task.automatic_optimization else 'manual'} optimization; lr_find sweeps one "
                "optimizer that the loop steps (automatic optimization)"
            )
        check_first_batches(run.task, run.model_attr, run.evaluator, {}, ("train",))  # a mismatch: one line
        if not cfg.trainer.dry_run:  # (a dry run: built and checked, nothing trained)
            with kept_states(run), swapped(run.task, run.model_attr, run.model):
                curve = range_test(run, cfg.lr_find)
        finished = True
    finally:
        run.data.close()
        task_hooks.call_if_defined(run.task, "teardown", "fit")
        if curve is not None and run.strategy.is_rank_zero:
            _write(run, curve, cfg.lr_find)
        run.metric_logger.close()
        run.strategy.teardown(finished)
    if curve is None:
        if run.strategy.is_rank_zero:
            log.info("trainer.dry_run: the run was built and its first batch checked; no range test was run")
        return {}
    summary: dict[str, Any] = {
        "suggested_lr": curve.suggestion,  # null in summary.json (and summary.csv's cell empty) when there is none
        **({"no_suggestion": no_suggestion(curve)} if curve.suggestion is None else {}),
        "status": "ok",
        "stage": "lr_find",
        "step": len(curve.lrs),
        "seconds": round(time.perf_counter() - start, 3),
        "world_size": run.strategy.world_size,
        "precision": run.precision.name,
    }
    if run.strategy.is_rank_zero:
        write_json(run_dir / "summary.json", summary)
        _report(curve, cfg, run_dir, summary)
    return summary


@contextlib.contextmanager
def kept_states(run: Run) -> Iterator[None]:
    """The model (buffers included), optimizer (its lrs and momenta), precision (GradScaler) and RNG states as they
    were before, whatever happens inside: the range test leaves the run as it found it."""
    saved = [copy.deepcopy(part.state_dict()) for part in (run.module, run.optimizers, run.precision)]
    rng = reproducibility.rng_state(run.device)
    try:
        yield
    finally:
        run.module.load_state_dict(saved[0])
        run.optimizers.load_state_dict(saved[1])
        run.precision.load_state_dict(saved[2])
        run.optimizers.only.zero_grad(set_to_none=True)
        reproducibility.set_rng_state(rng, run.device)


def range_test(run: Run, settings: DictConfig) -> Curve:
    """Train `settings.num_steps` optimizer steps at exponentially growing lrs; the curve every rank agrees on."""
    lrs = schedule(settings.min_lr, settings.max_lr, settings.num_steps)
    base = float(run.cfg.optimizer.lr)
    group_lrs = [float(g.get("initial_lr", g["lr"])) for g in run.optimizers.only.param_groups]  # a scheduler's start
    beta, threshold = settings.smoothing, settings.early_stop_threshold
    curve, average, best = Curve(), 0.0, math.inf
    batches = _train_batches(run)
    run.task.train()
    for i, lr in enumerate(lrs):
        for group, group_lr in zip(run.optimizers.only.param_groups, group_lrs):
            group["lr"] = group_lr * lr / base  # the groups' multipliers hold
        loss = _optimizer_step(run, batches, i)
        average = beta * average + (1 - beta) * loss
        smoothed = average / (1 - beta ** (i + 1))  # bias-corrected, as fastai's and Lightning's
        curve.lrs.append(lr)
        curve.losses.append(loss)
        curve.smoothed.append(smoothed)
        run.tensorboard.log_metrics({"lr_find/loss": smoothed, "lr_find/raw_loss": loss, "lr_find/lr": lr}, i)
        if not math.isfinite(smoothed):
            curve.stopped = f"the loss is not finite at lr {lr:.3g}"
            break
        best = min(best, smoothed)
        if threshold is not None and i > 0 and smoothed > threshold * best:
            curve.stopped = f"the loss passed {threshold:g} x its minimum at lr {lr:.3g}"
            break
    _check_ranks_agree(run, curve)
    curve.suggestion = suggest(curve.lrs, curve.smoothed)
    curve.steepest = steepest(curve.lrs, curve.smoothed)
    return curve


def _train_batches(run: Run) -> Iterator[Any]:
    """The training batches of epoch after epoch (trainer.limit_train_batches of each), as fit draws them."""
    for epoch in itertools.count():
        yield from itertools.islice(run.data.batches("train", epoch), run.train_batches)


def _optimizer_step(run: Run, batches: Iterator[Any], step: int) -> float:
    """One optimizer step as fit takes it (accumulate micro-batches, gradient sync on the last, autocast, the
    GradScaler's order, clipping); its loss, averaged over the micro-batches and the ranks."""
    accumulate, precision = run.limits.accumulate, run.precision
    no_sync = run.strategy.no_sync(run.model) if accumulate > 1 else None
    total = torch.zeros((), device=run.device)
    for k in range(accumulate):
        batch = next(batches)
        if run.device.type != "cpu":
            batch = move_to(batch, run.device)
        run.metric_logger.begin_batch(run.task.batch_size(batch))
        with no_sync() if no_sync is not None and k < accumulate - 1 else contextlib.nullcontext():
            with precision.autocast():
                out = run.training_step(batch, step * accumulate + k)
            if type(out) is not StepOutput:
                out = as_step_output(out, f"{type(run.task).__name__}.training_step", training=True)
            precision.backward(out.loss / accumulate if accumulate > 1 else out.loss)
        total += out.loss.detach().float()
    optimizer = run.optimizers.only
    precision.step(optimizer, run.params, run.limits.grad_clip_norm, run.limits.grad_clip_value)
    optimizer.zero_grad(set_to_none=True)
    total = run.strategy.all_reduce_sum(total) / (accumulate * run.strategy.world_size)
    return float(total)  # the stop is decided on it: one host sync per step (this is no training loop)


def _check_ranks_agree(run: Run, curve: Curve) -> None:
    """Every rank averaged the same losses: their curves are one. A difference is a bug of ours, not the user's."""
    curves = run.strategy.gather_objects(curve.smoothed)
    if any(other != curves[0] for other in curves):
        raise RuntimeError(f"lr_find: the ranks' curves differ ({[len(c) for c in curves]} steps)")


def _write(run: Run, curve: Curve, settings: DictConfig) -> None:
    """lr_find.json, lr_find.png, and the plot to TensorBoard beside the scalars."""
    from framework.stages import lr_plot

    write_json(run.run_dir / RECORD, {**asdict(curve), "settings": dict(settings)})
    image = lr_plot.plot(curve.lrs, curve.smoothed, curve.losses, curve.suggestion, run.run_dir / PLOT)
    if run.tensorboard.writer is not None:
        run.tensorboard.writer.add_image("lr_find/curve", image, 0, dataformats="HWC")


def no_suggestion(curve: Curve) -> str:
    """Why a curve gives no suggestion, and what gives one."""
    return (
        f"no finite loss after the first {SKIP_BEGIN} steps ({len(curve.lrs)} ran); expected a longer test "
        "(lr_find.num_steps) or a smaller lr_find.min_lr"
    )


def _report(curve: Curve, cfg: DictConfig, run_dir: Path, summary: dict[str, Any]) -> None:
    """The closing lines: what ran, why it stopped, the suggestion as an override line, where the plot is."""
    t, s = cfg.trainer, cfg.lr_find
    lines = [
        f"LR range test done in {summary['seconds']:.1f} s: {len(curve.lrs)} of {s.num_steps} steps from "
        f"{s.min_lr:g} to {s.max_lr:g} ({cfg.optimizer._target_.rsplit('.', 1)[-1]}, accumulate "
        f"{t.accumulate_grad_batches}, {summary['precision']}, world size {summary['world_size']})"
        + (f"; stopped: {curve.stopped}" if curve.stopped else "")
    ]
    if curve.suggestion is None:
        lines.append(f"  no suggestion: {summary['no_suggestion']}")
    else:
        if min(curve.smoothed) == curve.smoothed[-1]:
            lines.append(
                f"  the smoothed loss was lowest at the last step (lr {curve.lrs[-1]:g}): a longer test "
                "(lr_find.num_steps) or a larger lr_find.max_lr shows where it turns"
            )
        lines += [
            "Suggested learning rate (a tenth of the lowest loss's), to copy:",
            f"optimizer.lr={curve.suggestion:.3g}",
        ]
    lines.append(f"Curve: {run_dir / PLOT}  (and TensorBoard: tensorboard --logdir {run_dir})")
    logger = logging.getLogger(SUMMARY_LOGGER)
    for line in lines:
        if logger.hasHandlers():
            logger.info(line)
        else:  # logging not configured (called directly): still shown
            print(line)

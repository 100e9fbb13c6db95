"""The Lightning-style Task: it holds the model and says what one training, validation or test step computes.

A port of a LightningModule changes its imports and base class: steps take `(batch)` or `(batch, batch_idx)`,
whichever they declare; `training_step` returns a `StepOutput`, a loss tensor or a dict with `"loss"`; a
validation or test step may return nothing and log with `self.log` instead; `predict_step` returns the columns a
predict run writes (a dict of per-sample tensors). `self.log` takes a tensor, a number or
a torchmetrics `Metric` with Lightning's keyword arguments. Lightning's hooks (`on_train_start`,
`on_validation_epoch_end`, `on_save_checkpoint`, ...) are called where Lightning calls them (framework/
task_hooks.py); the ones whose job a config group does here (`configure_optimizers`, ...) are refused at start
with what replaces them.

A step's loss and `StepOutput.metrics` are averaged over the epoch by the trainer, weighted by batch size, and
named `<stage>/<name>`. Metrics that a batch average gets wrong (macro-F1, AUROC) are stateful (torchmetrics):
updated per batch and returned by `epoch_metrics` at the end of the evaluation, or logged as Metric objects.

`check_batch` runs a step once on the first batch of each split before training, on a throw-away copy of the
task that shares its model, so that data of the wrong kind, a model that does not fit it or a loss that does not
fit the model is one line naming `data`, `model` or `task` with the shapes seen, not a traceback from inside the
first step, and the task's own state (metrics, buffers) never sees the check; the steps themselves trust their
inputs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from framework.config.instantiate import FULL_ERROR_HINT, error_line
from framework.core.errors import ConfigError, UserError
from framework.task.describe import describe

# A batch metric `(output, target) -> scalar tensor`, or a stateful torchmetrics.Metric (an nn.Module).
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

REDUCE_FX = ("mean", "sum", "max", "min")
STEPS = {"train": "training_step", "val": "validation_step", "test": "test_step"}  # the step each split runs


@dataclass
class StepOutput:
    """A step's loss and batch metrics. It reads as Lightning's step output dict too (`outputs["loss"]` in
    on_train_batch_end), each metric by its name."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.loss if key == "loss" else self.metrics[key]

    def __contains__(self, key: object) -> bool:
        return key == "loss" or key in self.metrics

    def keys(self) -> list[str]:
        return ["loss", *self.metrics]


class AttributeDict(dict):
    """Lightning's `self.hparams`: a dict whose keys read as attributes."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class Task(nn.Module):
    """Holds the model: `self.model` (given to the constructor), or, in a port of a LightningModule, the one
    attribute the built `model` group was given to (`self.net`). The parallel strategy may replace it by a
    wrapper (DDP) for training only."""

    def __init__(self, model: Optional[nn.Module] = None) -> None:
        super().__init__()
        if model is not None:
            self.model = model
        self.trainer: Any = None  # the Trainer running this task (set by it); None outside a run
        self.hparams = AttributeDict()

    def save_hyperparameters(self, *names: str, ignore: Sequence[str] | str = (), logger: bool = True) -> None:
        """Lightning's: the calling constructor's arguments (or those named) in `self.hparams`. The run's
        config is what is logged and saved here, so `logger` changes nothing."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            return
        info = inspect.getargvalues(caller)
        ignored = {ignore} if isinstance(ignore, str) else set(ignore)
        wanted = set(names) or set(info.args[1:]) | ({info.keywords} if info.keywords else set())
        for name in info.args[1:]:
            if name in wanted and name not in ignored:
                self.hparams[name] = info.locals[name]
        if info.keywords and info.keywords in wanted:
            self.hparams.update({k: v for k, v in info.locals[info.keywords].items() if k not in ignored})

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: Optional[bool] = None,
        on_step: Optional[bool] = None,
        on_epoch: Optional[bool] = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: Optional[int] = None,
        metric_attribute: Optional[str] = None,
        rank_zero_only: bool = False,
        *,
        best: Optional[str] = None,
    ) -> None:
        """Lightning's `self.log`, from a step or a hook: a tensor (kept on the device: no sync per step), a
        number, or a torchmetrics `Metric` (computed, over every rank, and reset at the epoch's or the
        evaluation's end; at a training logging step, its value over the epoch so far). `name` is logged as given
        (say `train/foo`); during a test, a `val/` name becomes `test/`. Defaults as in Lightning: in a training
        step, every logging step (`on_step`) and not as an epoch mean; in training epoch hooks and in validation and
        test, the epoch's mean, weighted by `batch_size` (by default the batch's). `reduce_fx`: mean, sum, max or
        min over the epoch. `logger=False`: not written to TensorBoard, but in the summary, the progress bar and
        what callbacks and monitors see. Evaluation values are always reduced over every rank (`sync_dist` is
        what happens anyway); `sync_dist_group`, `rank_zero_only`, `enable_graph` and `metric_attribute` change
        nothing here (see docs/coming_from_lightning.md). In a step of a set other than the default one
        (`data.val_sets`, `data.test_sets`), the name gets `/<set>` (Lightning's `/dataloader_idx_N`) unless
        `add_dataloader_idx=False` (docs/logging.md). `best` (not Lightning's):
        "min" where lower is better, "max" where higher is; a validation metric gets `best/<name>`, its best value
        over the run, only where its direction is declared (here, by a monitor's mode, a Metric's
        `higher_is_better` or `metric_modes`; framework/observe/best.py). Outside a run it does nothing."""
        if self.trainer is not None:
            self.trainer.log_from_task(
                name,
                value,
                on_step=on_step,
                on_epoch=on_epoch,
                prog_bar=prog_bar,
                logger=logger is not False,
                reduce_fx=reduce_fx,
                batch_size=batch_size,
                best=best,
                add_dataloader_idx=add_dataloader_idx,
            )

    def log_dict(self, dictionary: Mapping[str, Any], **kwargs: Any) -> None:
        """Lightning's `self.log_dict`: `self.log` of each item, with the same keyword arguments."""
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    @property
    def logger(self) -> Any:
        """The run's TensorBoard logger (`self.logger.experiment` is the SummaryWriter, for images, histograms
        and text; None on ranks other than 0 and when TensorBoard is off), or None outside a run."""
        return self.trainer.logger if self.trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        """Lightning's `self.loggers`: the run's TensorBoard logger (when on) and its open trackers (CSV, MLflow,
        W&B), on rank 0; an empty list outside a run."""
        return self.trainer.loggers if self.trainer is not None else []

    @property
    def device(self) -> torch.device:
        """Lightning's `self.device`: where the task's parameters (else its buffers) are; the CPU without any."""
        for tensor in itertools.chain(self.parameters(), self.buffers()):
            return tensor.device
        return torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self.trainer.global_step if self.trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    # ------------------------------------------------------------------ optimizers (framework/loop/manual.py)
    # Lightning's switch: False, and training_step zeroes, back-propagates (manual_backward) and steps the optimizers
    # it gets from self.optimizers() itself. Several optimizers need it.
    automatic_optimization: bool = True

    def _optimizers(self, call: str) -> Any:
        if self.trainer is None:
            raise UserError(f"{type(self).__name__}.{call}: the task is not in a run (its trainer is None)")
        return self.trainer.task_optimizers

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The run's optimizer, or the list of its named optimizers in config order (Lightning's); each steps
        through the run's precision (the GradScaler under fp16)."""
        return self._optimizers("optimizers()").optimizers()

    def lr_schedulers(self) -> Any:
        """The optimizers' torch schedulers: one, a list in config order, or None (Lightning's). Under manual
        optimization the task steps them."""
        return self._optimizers("lr_schedulers()").lr_schedulers(self.trainer.scheduler)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's: `loss.backward()` as the run's precision does it (scaled under fp16)."""
        self._optimizers("manual_backward").backward(loss, *args, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Lightning's: only `optimizer`'s parameters require gradients until `untoggle_optimizer`."""
        self._optimizers("toggle_optimizer").toggle(optimizer)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        self._optimizers("untoggle_optimizer").untoggle(optimizer)

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Lightning's: clip `optimizer`'s gradients by norm (default) or value, unscaled first under fp16."""
        self._optimizers("clip_gradients").clip(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def epoch_metrics(self, split: str) -> dict[str, Any]:
        """Stateful metrics (e.g. torchmetrics) of the evaluation of `split` ("val" or "test") that just ended,
        computed over every batch and every rank, then reset; or a torchmetrics `Metric` itself, which the trainer
        computes (over every rank), resets, and whose `higher_is_better` is its direction. The trainer calls it on
        every rank after the last batch, and logs each as `<split>/<name>`. None by default."""
        return {}

    def metric_modes(self) -> dict[str, str]:
        """Whether each metric this task's steps return (`StepOutput.metrics`) or `epoch_metrics` computes is
        better lower ("min") or higher ("max"), by its name without the split (`{"acc": "max"}`): what
        `best/val/<name>` is kept by. A metric whose direction nothing declares (this, `self.log(..., best=)`, a
        monitor's mode, a Metric's `higher_is_better`) gets no `best/*`. None by default."""
        return {}

    def on_validation_epoch_end(self) -> None:
        """After each validation's last batch, on every rank (log images or histograms here through
        self.logger, or a best-so-far with self.log)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int = 0) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch[, batch_idx])")

    def validation_step(self, batch: Any, batch_idx: int = 0) -> Any:
        """Not the task's unless it defines it: as in Lightning, a task without a validation_step of its own is not
        validated at all (framework/loop/run.py decides it once, `evaluates`)."""
        raise NotImplementedError(f"{type(self).__name__} defines no validation_step: it is not validated")

    def test_step(self, batch: Any, batch_idx: int = 0, *dataloader_idx: int) -> Any:
        """`validation_step` by default (Lightning requires a test_step of its own), given the dataloader_idx this is
        given (several test sets); a task that defines neither is not tested."""
        return step_function(self, "validation_step")(batch, batch_idx, *dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int = 0) -> Any:
        """What a predict run writes for a batch (framework/stages/predictions.py): a dict of column name to a tensor
        with one row per sample (or a list of N str/int/float). By default the model's output for the batch's
        inputs, as column "output". The caller runs it in eval mode under inference_mode."""
        return {"output": self(batch_inputs(batch))}

    def batch_size(self, batch: Any) -> int:
        """Samples in a batch, used to weight epoch averages; the first tensor's length by default."""
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        if isinstance(first, Mapping):
            first = next(iter(first.values()), None)
        return len(first) if hasattr(first, "__len__") else 1

    def check_batch(
        self,
        batch: Any,
        split: str,
        *,
        input_shape: Optional[Sequence[int]] = None,
        num_classes: Optional[int] = None,
        dataloader_idx: Optional[int] = None,
    ) -> Optional[StepOutput]:
        """Run the step of `split` on its first batch (`training_step`, `validation_step` or `test_step`; the
        trainer calls this on a throw-away copy of the task, in eval mode under no_grad) and report
        what fails as the task's. `input_shape` and `num_classes` are what `data` declares; `dataloader_idx`, the
        set's, where the split has several (passed to the step then only, as Lightning does). Returns the step's
        output (None when a validation step returns nothing), whose metric names the trainer checks the monitors
        against."""
        method = STEPS[split]
        name = f"{type(self).__name__}.{method}"
        try:
            index = () if dataloader_idx is None else (dataloader_idx,)
            out = step_function(self, method)(batch, 0, *index)
        except UserError:
            raise
        except Exception as err:
            raise ConfigError(
                f"task: {name} on the first {split} batch ({describe(batch)}) raised "
                f"{error_line(err)}; expected a batch it takes {FULL_ERROR_HINT}"
            ) from err
        return as_step_output(out, name, training=split == "train" and self.automatic_optimization)


def batch_inputs(batch: Any) -> Any:
    """A batch's inputs: the first item of an `(inputs, labels)` pair (or of a 1-tuple), else the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _accepts_batch_idx(fn: Callable[..., Any], where: str) -> bool:
    """Whether a step takes `(batch, batch_idx)` (Lightning's) or `(batch)`; anything else is refused."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    positional = [
        p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    method = where.rsplit(".", 1)[-1]
    evaluates = method in ("validation_step", "test_step")  # may take a dataloader_idx: several sets give one
    if not positional or len(required) > (3 if evaluates else 2):
        shown = ", ".join(p.name for p in params)
        also = f", or {method}(self, batch, batch_idx, dataloader_idx=0)" if evaluates else ""
        raise ConfigError(
            f"task: {where}({shown}): expected {method}(self, batch) or {method}(self, batch, batch_idx){also}"
        )
    return len(positional) >= 2


def check_dataloader_idx(task: nn.Module, method: str, sets: int, which: str) -> None:
    """`task.<method>` takes a third argument, the dataloader_idx its steps are given when its split has several sets
    (`sets`; `which`: those, in words, by their config keys), and needs none with one set; else one line."""
    try:
        params = list(inspect.signature(getattr(task, method)).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [
        p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    takes = len(positional) >= 3 or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    needs = len([p for p in positional if p.default is inspect.Parameter.empty]) >= 3
    if (sets > 1 and not takes) or (sets == 1 and needs):
        shown = ", ".join(p.name for p in params)
        given = "so each of its steps is given a dataloader_idx" if sets > 1 else "so its steps are given none"
        raise ConfigError(
            f"task: {type(task).__name__}.{method}({shown}): {which}, {given}; expected "
            f"{method}(self, batch, batch_idx, dataloader_idx=0), as Lightning does"
        )


def step_function(task: nn.Module, method: str) -> Callable[[Any, int], Any]:
    """`task.<method>` as a callable of `(batch, batch_idx)`, whichever of the two the method declares."""
    fn = getattr(task, method)
    if _accepts_batch_idx(fn, f"{type(task).__name__}.{method}"):
        return fn
    return lambda batch, _batch_idx: fn(batch)


def as_step_output(out: Any, where: str, *, training: bool) -> Optional[StepOutput]:
    """A step's return as a StepOutput: a StepOutput, a loss tensor, or a dict with "loss" (Lightning's; its other
    keys go to no metric); in evaluation, also None (the step logged what it computes). Anything else, or a loss
    that is not one floating-point number, is a ConfigError naming the step."""
    if isinstance(out, StepOutput):
        result: Optional[StepOutput] = out
    elif isinstance(out, torch.Tensor):
        result = StepOutput(out)
    elif isinstance(out, Mapping) and "loss" in out:
        result = StepOutput(out["loss"])
    elif out is None or isinstance(out, Mapping):
        result = None
    else:
        result = StepOutput(out)  # (refused below: not a tensor)
    if result is None:
        if training:
            raise ConfigError(
                f"task: {where} returned {describe(out)}; expected the loss: a tensor, a dict with "
                "'loss', or a StepOutput(loss, metrics)"
            )
        return None
    loss = result.loss
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"task: {where} returned {describe(out)}; expected the loss: a tensor, a dict with 'loss', "
            "or a StepOutput(loss, metrics)"
        )
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ConfigError(
            f"task: {where} gave a loss of {describe(loss)}; expected one floating-point "
            "number, the loss reduced over the batch"
        )
    return result


@contextlib.contextmanager
def swapped(task: nn.Module, attr: str, value: Any) -> Iterator[None]:
    """`value` as `task.<attr>` for the block, the task's own put back afterwards: the one place a run changes what
    the task holds (its model as the loop runs it, wrapped by DDP or set for evaluation; the handle a check's logs go
    to). Outside every such block the task holds what the user gave it. `attr` "": the task is its own model (it
    built several nets itself), which nothing replaces: `value` must be the task."""
    own = getattr(task, attr) if attr else task
    if own is value:
        yield
        return
    assert attr, "a task that is its own model runs unwrapped (framework/loop/build.py refuses the rest)"
    setattr(task, attr, value)
    try:
        yield
    finally:
        setattr(task, attr, own)


def throwaway_copy(task: Task, model: nn.Module, handle: Any) -> Task:
    """A copy of `task` whose steps leave no trace in it: its own metrics, buffers and attributes, but the same
    `model` (`model` is the task's model attribute's value in the copy) and parameters (a check runs under
    no_grad in eval mode: neither changes), and `handle` for `task.trainer`. A task that cannot be copied
    (it holds a lock or an open file) is returned itself, with its `trainer` swapped for the handle by the
    caller."""
    memo: dict[int, Any] = {id(model): model} if model is not task else {}  # (a task that is its own model)
    if task.trainer is not None:
        memo[id(task.trainer)] = handle
    for param in task.parameters():
        memo[id(param)] = param
    shadow = copy.deepcopy(task, memo)
    shadow.trainer = handle
    return shadow

"""The Lightning-style Task: it holds the model and says what one training, validation or test step computes.

A step returns a `StepOutput`: the loss (for backward) and a dict of metric tensors, averaged over the batch.
The trainer prefixes metric names with the stage (`train/`, `val/`, `test/`) and averages them over the
epoch weighted by batch size. Metrics that a batch average gets wrong (macro-F1, AUROC) are stateful
(torchmetrics): updated per batch and returned by `epoch_metrics` at the end of the evaluation. Subclass
`Task` (or `ClassificationTask`) in `experiments/` to go further.

`check_batch` runs a step once on the first batch of each split before training, so that data of the wrong
kind, a model that does not fit it or a loss that does not fit the model is one line naming `data`, `model`
or `task` with the shapes seen, not a traceback from inside the first step; the steps themselves trust their
inputs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from framework.errors import ConfigError, UserError
from framework.instantiate import FULL_ERROR_HINT, error_line
from framework.metrics import Accuracy, is_stateful

# A batch metric `(output, target) -> scalar tensor`, or a stateful torchmetrics.Metric (an nn.Module).
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(nn.Module):
    """Holds `self.model`; the parallel strategy may replace it by a wrapper (DDP) for training only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.trainer: Any = None  # the Trainer running this task (set by it); None outside a run

    def log(self, name: str, value: Any, *, on_step: Optional[bool] = None, on_epoch: Optional[bool] = None,
            prog_bar: bool = False) -> None:
        """Lightning's `self.log`, from a step or a hook: a scalar (a tensor stays on the device; no sync per
        step). `name` is logged as given (say `train/foo`). Defaults as in Lightning: in training, every
        logging step (`on_step`) and not as an epoch mean; in validation and test, the epoch mean only.
        `prog_bar`: also shown in the progress bar. Outside a run it does nothing."""
        if self.trainer is not None:
            self.trainer.log_from_task(name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar)

    @property
    def logger(self) -> Any:
        """The run's TensorBoard logger (`self.logger.experiment` is the SummaryWriter, for images, histograms
        and text; None on ranks other than 0 and when TensorBoard is off), or None outside a run."""
        return self.trainer.logger if self.trainer is not None else None

    def epoch_metrics(self, split: str) -> dict[str, torch.Tensor]:
        """Stateful metrics (e.g. torchmetrics) of the evaluation of `split` ("val" or "test") that just ended,
        computed over every batch and every rank, then reset. The trainer calls it on every rank after the
        last batch, and logs each as `<split>/<name>`. None by default."""
        return {}

    def on_validation_epoch_end(self) -> None:
        """After each validation, on every rank (log images or histograms here through self.logger)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: Any) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch)")

    def validation_step(self, batch: Any) -> StepOutput:
        return self.training_step(batch)

    def test_step(self, batch: Any) -> StepOutput:
        return self.validation_step(batch)

    def batch_size(self, batch: Any) -> int:
        """Samples in a batch, used to weight epoch averages; the first tensor's length by default."""
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        return len(first)

    def check_batch(self, batch: Any, split: str, *, input_shape: Optional[Sequence[int]] = None,
                    num_classes: Optional[int] = None) -> StepOutput:
        """Run `validation_step` on the first batch of `split` (the trainer calls this once per split, in eval
        mode under no_grad; never `training_step`, which may have effects of its own) and report what fails
        as the task's. `input_shape` and `num_classes` are what `data` declares. Returns the step's output,
        whose metric names the trainer checks the monitors against."""
        name = f"{type(self).__name__}.validation_step"
        try:
            out = self.validation_step(batch)
        except UserError:
            raise
        except Exception as err:
            raise ConfigError(f"task: {name} on the first {split} batch ({describe(batch)}) raised "
                              f"{error_line(err)}; expected a batch it takes {FULL_ERROR_HINT}") from err
        if not isinstance(out, StepOutput) or not isinstance(out.loss, torch.Tensor):
            raise ConfigError(f"task: {name} returned {describe(out)}; expected a StepOutput(loss, metrics)")
        if out.loss.numel() != 1 or not out.loss.is_floating_point():
            raise ConfigError(f"task: {name} gave a loss of {describe(out.loss)}; expected one floating-point "
                              "number, the loss reduced over the batch")
        return out


class ClassificationTask(Task):
    """`(inputs, labels)` batches, a loss (cross-entropy by default) and metrics (accuracy by default).

    A metric is a batch metric (a callable, averaged by the trainer) or a stateful `torchmetrics.Metric`,
    which gets the model's scores as float32 (its classification metrics turn logits into probabilities
    themselves) and is computed over the whole split in `epoch_metrics`.
    """

    def __init__(self, model: nn.Module, loss: Optional[nn.Module] = None,
                 metrics: Optional[Mapping[str, Metric]] = None) -> None:
        super().__init__(model)
        self.loss = loss if loss is not None else nn.CrossEntropyLoss()
        configured = dict(metrics) if metrics is not None else {"acc": Accuracy()}
        self.metrics = {name: metric for name, metric in configured.items() if not is_stateful(metric)}
        stateful = {name: metric for name, metric in configured.items() if is_stateful(metric)}
        # One copy per split, so that a test never mixes with validation state. Submodules, so .to(device)
        # moves them; their states are not persistent and the checkpoint saves only the model.
        self.stateful_metrics = nn.ModuleDict({split: nn.ModuleDict(copy.deepcopy(stateful))
                                               for split in ("val", "test")})

    def training_step(self, batch: Any) -> StepOutput:
        # Training metrics are left out on purpose: the hot path computes only what backward needs.
        inputs, target = batch
        return StepOutput(self.loss(self.model(inputs), target))

    def validation_step(self, batch: Any) -> StepOutput:
        return self.evaluation_step(batch, "val")

    def test_step(self, batch: Any) -> StepOutput:
        return self.evaluation_step(batch, "test")

    def evaluation_step(self, batch: Any, split: str) -> StepOutput:
        """A validation ("val") or test ("test") step: override this to change both."""
        inputs, target = batch
        output = self.model(inputs)
        return StepOutput(self.loss(output, target), self.step_metrics(output, target, split))

    def step_metrics(self, output: torch.Tensor, target: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """The batch metrics' values for this batch; the stateful metrics of `split` are updated with it."""
        stateful = self.stateful_metrics[split]
        if len(stateful):
            scores = output.detach().float()  # under bf16/fp16 autocast too, so AUROC ranks as in float32
            for metric in stateful.values():
                metric.update(scores, target)
        return {name: metric(output, target) for name, metric in self.metrics.items()}

    def epoch_metrics(self, split: str) -> dict[str, torch.Tensor]:
        """Each stateful metric of `split` over every batch since the last call, synchronised over the ranks
        by torchmetrics (every rank must call this), then reset."""
        stateful = self.stateful_metrics[split]
        values = {name: metric.compute() for name, metric in stateful.items()}
        for metric in stateful.values():
            metric.reset()
        return values

    def check_batch(self, batch: Any, split: str, *, input_shape: Optional[Sequence[int]] = None,
                    num_classes: Optional[int] = None) -> StepOutput:
        """Batch, model output, loss and metrics in turn, each failure named by the key to change."""
        data = f"data.{split}"
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(f"{data}: its first batch is {describe(batch)}; expected (inputs, labels) pairs for "
                              f"{type(self).__name__}, i.e. a dataset whose samples are (input, label) tuples")
        inputs, target = batch
        if not (isinstance(inputs, torch.Tensor) and isinstance(target, torch.Tensor)):
            raise ConfigError(f"{data}: its first batch is ({describe(inputs)}, {describe(target)}); expected a "
                              "tensor of inputs and one of labels: samples of tensors or numbers (e.g. an int "
                              "label, images through a ToTensor transform)")
        if inputs.dim() == 0 or target.dim() == 0 or len(inputs) != len(target):
            raise ConfigError(f"{data}: its first batch has inputs of {describe(inputs)} and labels of "
                              f"{describe(target)}; expected one label per input, batch first")
        sample = list(inputs.shape[1:])
        if input_shape is not None and sample != list(input_shape):
            raise ConfigError(f"data.input_shape={list(input_shape)}: the first {split} batch has inputs of "
                              f"{describe(inputs)}, samples of shape {sample}; expected "
                              f"data.input_shape={_cli(sample)} (the model is built for it)")
        try:
            output = self.model(inputs)
        except UserError:
            raise
        except Exception as err:
            raise self._forward_failed(inputs, split, err) from err
        if not isinstance(output, torch.Tensor):
            raise ConfigError(f"model: returned {describe(output)} for inputs of {describe(inputs)}; expected a "
                              "tensor of scores, batch first, for task.loss and task.metrics")
        if output.dim() == 0 or len(output) != len(inputs):
            raise ConfigError(f"model: output of {describe(output)} for inputs of {describe(inputs)}; expected "
                              "one row of scores per input, batch first")
        shaped = output.dim() >= 2 and target.shape == output.shape[:1] + output.shape[2:]  # (N,) for (N, C)
        if shaped and not target.is_floating_point() and target.dtype != torch.bool:  # class indices
            self._check_labels(output, target, split, num_classes)
        try:
            loss = self.loss(output, target)
        except UserError:
            raise
        except Exception as err:
            if shaped and target.dtype != torch.long and hasattr(self.loss, "ignore_index"):  # takes indices
                raise ConfigError(f"{data}: labels of {describe(target)} for the model's output of "
                                  f"{describe(output)}: {_name(self.loss)} raised {error_line(err)}; expected "
                                  "class indices of dtype int64 (torch.long)") from err
            raise ConfigError(f"task.loss: {_name(self.loss)} on the model's output of {describe(output)} and "
                              f"labels of {describe(target)} raised {error_line(err)}; expected a loss that "
                              f"takes them {FULL_ERROR_HINT}") from err
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(f"task.loss: {_name(self.loss)} returned {describe(loss)}; expected one number, "
                              "the loss reduced over the batch (e.g. reduction='mean')")
        metrics = {**self.metrics, **self.stateful_metrics["val"]}
        for name, metric in metrics.items():
            try:
                if is_stateful(metric):  # on a copy: the step below updates the metric itself
                    copy.deepcopy(metric).update(output.detach().float(), target)
                else:
                    metric(output, target)
            except UserError:
                raise
            except Exception as err:
                raise ConfigError(f"task.metrics.{name}: {_name(metric)} on the model's output of "
                                  f"{describe(output)} and labels of {describe(target)} raised "
                                  f"{error_line(err)}; expected a metric that takes them {FULL_ERROR_HINT}") from err
        out = super().check_batch(batch, split)
        if split != "val":  # the trainer resets after the val check (epoch_metrics); no other check leaves state
            for metric in self.stateful_metrics["val"].values():
                metric.reset()
        return out

    def _forward_failed(self, inputs: torch.Tensor, split: str, err: Exception) -> ConfigError:
        """Inputs of another dtype than the weights are the data's fault; anything else, with inputs of the
        declared shape, the model's."""
        weights = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        embeds = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in self.model.modules())
        if weights is not None and inputs.dtype != weights and not embeds:
            return ConfigError(f"data.{split}: inputs of {describe(inputs)}, but the model's weights are "
                               f"{_dtype(weights)} and its forward raised {error_line(err)}; expected "
                               f"{_dtype(weights)} inputs (convert them in the dataset, e.g. with a transform)")
        return ConfigError(f"model: forward on the first {split} batch, inputs of {describe(inputs)}, raised "
                           f"{error_line(err)}; expected a model built for these inputs (model.input_shape="
                           f"${{data.input_shape}} and its other sizes) {FULL_ERROR_HINT}")

    def _check_labels(self, output: torch.Tensor, target: torch.Tensor, split: str,
                      num_classes: Optional[int]) -> None:
        """Class indices out of range, before the loss sees them: on the CPU the loss raises an IndexError, on
        CUDA a device-side assert ends the process."""
        ignore = getattr(self.loss, "ignore_index", None)
        labels = target[target != ignore] if ignore is not None else target
        if labels.numel() == 0:
            return
        low, high = int(labels.min()), int(labels.max())
        classes = output.shape[1]
        seen = f"labels of {describe(target)} with values {low}..{high}"
        if low < 0:
            ignored = f" (or {ignore}, task.loss.ignore_index)" if ignore is not None else ""
            raise ConfigError(f"data.{split}: its first batch has {seen}; expected class indices "
                              f"0..{classes - 1}{ignored}")
        if high < classes:
            return
        where = f"in the first {split} batch (task.loss: {_name(self.loss)})"
        if num_classes is not None and high >= num_classes:
            raise ConfigError(f"data.num_classes={num_classes}: the model's output of {describe(output)} does not "
                              f"fit {seen} {where}; expected data.num_classes >= {high + 1}, one score per class")
        raise ConfigError(f"model: output of {describe(output)} does not fit {seen} {where}; expected "
                          f"{num_classes or f'at least {high + 1}'} scores per sample, one per class "
                          "(model.num_classes=${data.num_classes})")


def describe(value: Any) -> str:
    """A batch, an output or a loss in a few words for messages: `shape (64, 1, 8, 8) float32`, `a tuple of
    (shape (64,) int64, a list of 64 str)`."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {_dtype(value.dtype)}"
    if isinstance(value, (tuple, list)):
        if len(value) <= 4 and not all(isinstance(item, (str, int, float)) for item in value):
            return f"a {type(value).__name__} of ({', '.join(describe(item) for item in value)})"
        kinds = sorted({type(item).__name__ for item in value})
        return f"a {type(value).__name__} of {len(value)} {'/'.join(kinds)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(str, value))}"
    return "None" if value is None else f"a {type(value).__name__}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cli(values: Sequence[int]) -> str:
    """A list as typed on the command line (no spaces to quote)."""
    return f"[{','.join(map(str, values))}]"


def _name(obj: Any) -> str:
    """A loss or metric by name: its class, or its function (also under functools.partial)."""
    function = getattr(obj, "func", obj)
    return getattr(function, "__name__", None) or type(obj).__name__

"""The ready-made task for `(inputs, labels)` batches: a loss (cross-entropy by default), batch metrics and
torchmetrics' stateful ones, and a pre-flight check of the first batch that names data, model or loss in one line."""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from framework.config.instantiate import FULL_ERROR_HINT, error_line
from framework.core.errors import ConfigError, UserError
from framework.task.describe import as_override, describe, dtype_name, type_name
from framework.task.metrics import Accuracy, is_stateful
from framework.task.task import Metric, StepOutput, Task, batch_inputs


class ClassificationTask(Task):
    """`(inputs, labels)` batches, a loss (cross-entropy by default) and metrics (accuracy by default).

    A metric is a batch metric (a callable, averaged by the trainer) or a stateful `torchmetrics.Metric`,
    which gets the model's scores as float32 (its classification metrics turn logits into probabilities
    themselves) and is computed over the whole split in `epoch_metrics`.
    """

    def __init__(
        self, model: nn.Module, loss: Optional[nn.Module] = None, metrics: Optional[Mapping[str, Metric]] = None
    ) -> None:
        super().__init__(model)
        self.loss = loss if loss is not None else nn.CrossEntropyLoss()
        configured = dict(metrics) if metrics is not None else {"acc": Accuracy()}
        self.metrics = {name: metric for name, metric in configured.items() if not is_stateful(metric)}
        stateful: dict[str, Any] = {name: metric for name, metric in configured.items() if is_stateful(metric)}
        # One copy per split, so that a test never mixes with validation state. Submodules, so .to(device)
        # moves them (and the task's state, framework/checkpoint/state.py TaskState, saves them).
        self.stateful_metrics: Any = nn.ModuleDict(
            {split: nn.ModuleDict(copy.deepcopy(stateful)) for split in ("val", "test")}
        )

    def metric_modes(self) -> dict[str, str]:
        """Each metric's own `higher_is_better` (torchmetrics' name; framework.task.metrics' have it too): a metric
        without one (a plain function) gets no best/*."""
        metrics: dict[str, Any] = {**self.metrics, **self.stateful_metrics["val"]}
        declared = {name: getattr(metric, "higher_is_better", None) for name, metric in metrics.items()}
        return {name: "max" if higher else "min" for name, higher in declared.items() if isinstance(higher, bool)}

    def training_step(self, batch: Any, batch_idx: int = 0) -> StepOutput:
        # Training metrics are left out on purpose: the hot path computes only what backward needs.
        inputs, target = batch
        return StepOutput(self.loss(self.model(inputs), target))

    def validation_step(self, batch: Any, batch_idx: int = 0, dataloader_idx: int = 0) -> StepOutput:
        return self.evaluation_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int = 0, *dataloader_idx: int) -> StepOutput:
        return self.evaluation_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int = 0) -> dict[str, torch.Tensor]:
        """Each sample's class (int64) and the probabilities of every class (float32, softmax of the scores)."""
        scores = self(batch_inputs(batch))
        return {"prediction": scores.argmax(-1), "probabilities": scores.float().softmax(-1)}

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

    def check_batch(
        self,
        batch: Any,
        split: str,
        *,
        input_shape: Optional[Sequence[int]] = None,
        num_classes: Optional[int] = None,
        dataloader_idx: Optional[int] = None,
    ) -> Optional[StepOutput]:
        """Batch, model output, loss and metrics in turn, each failure named by the key to change."""
        inputs, target = self._check_pair(batch, split, input_shape)
        output = self._check_output(inputs, split)
        shaped = output.dim() >= 2 and target.shape == output.shape[:1] + output.shape[2:]  # (N,) for (N, C)
        if shaped and not target.is_floating_point() and target.dtype != torch.bool:  # class indices
            self._check_labels(output, target, split, num_classes)
        self._check_loss(output, target, split, shaped)
        self._check_metrics(output, target)
        return super().check_batch(batch, split, dataloader_idx=dataloader_idx)

    def _check_pair(
        self, batch: Any, split: str, input_shape: Optional[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch is (inputs, labels) of tensors, one label per input, inputs of the declared shape."""
        data = f"data.{split}"
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(
                f"{data}: its first batch is {describe(batch)}; expected (inputs, labels) pairs for "
                f"{type(self).__name__}, i.e. a dataset whose samples are (input, label) tuples"
            )
        inputs, target = batch
        if not (isinstance(inputs, torch.Tensor) and isinstance(target, torch.Tensor)):
            raise ConfigError(
                f"{data}: its first batch is ({describe(inputs)}, {describe(target)}); expected a "
                "tensor of inputs and one of labels: samples of tensors or numbers (e.g. an int "
                "label, images through a ToTensor transform)"
            )
        if inputs.dim() == 0 or target.dim() == 0 or len(inputs) != len(target):
            raise ConfigError(
                f"{data}: its first batch has inputs of {describe(inputs)} and labels of "
                f"{describe(target)}; expected one label per input, batch first"
            )
        sample = list(inputs.shape[1:])
        if input_shape is not None and sample != list(input_shape):
            raise ConfigError(
                f"data.input_shape={list(input_shape)}: the first {split} batch has inputs of "
                f"{describe(inputs)}, samples of shape {sample}; expected "
                f"data.input_shape={as_override(sample)} (the model is built for it)"
            )
        return inputs, target

    def _check_output(self, inputs: torch.Tensor, split: str) -> torch.Tensor:
        """The model takes the inputs and returns one row of scores per input."""
        try:
            output = self.model(inputs)
        except UserError:
            raise
        except Exception as err:
            raise self._forward_failed(inputs, split, err) from err
        if not isinstance(output, torch.Tensor):
            raise ConfigError(
                f"model: returned {describe(output)} for inputs of {describe(inputs)}; expected a "
                "tensor of scores, batch first, for task.loss and task.metrics"
            )
        if output.dim() == 0 or len(output) != len(inputs):
            raise ConfigError(
                f"model: output of {describe(output)} for inputs of {describe(inputs)}; expected "
                "one row of scores per input, batch first"
            )
        return output

    def _check_loss(self, output: torch.Tensor, target: torch.Tensor, split: str, shaped: bool) -> None:
        """task.loss takes the output and the labels and returns one number."""
        data = f"data.{split}"
        try:
            loss = self.loss(output, target)
        except UserError:
            raise
        except Exception as err:
            if shaped and target.dtype != torch.long and hasattr(self.loss, "ignore_index"):  # takes indices
                raise ConfigError(
                    f"{data}: labels of {describe(target)} for the model's output of "
                    f"{describe(output)}: {type_name(self.loss)} raised {error_line(err)}; expected "
                    "class indices of dtype int64 (torch.long)"
                ) from err
            raise ConfigError(
                f"task.loss: {type_name(self.loss)} on the model's output of {describe(output)} and "
                f"labels of {describe(target)} raised {error_line(err)}; expected a loss that "
                f"takes them {FULL_ERROR_HINT}"
            ) from err
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(
                f"task.loss: {type_name(self.loss)} returned {describe(loss)}; expected one number, "
                "the loss reduced over the batch (e.g. reduction='mean')"
            )

    def _check_metrics(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Every metric takes the output and the labels (a stateful one on a copy: the step updates the metric)."""
        metrics: dict[str, Any] = {**self.metrics, **self.stateful_metrics["val"]}
        for name, metric in metrics.items():
            try:
                if is_stateful(metric):  # on a copy: the step below updates the metric itself
                    copy.deepcopy(metric).update(output.detach().float(), target)
                else:
                    metric(output, target)
            except UserError:
                raise
            except Exception as err:
                raise ConfigError(
                    f"task.metrics.{name}: {type_name(metric)} on the model's output of "
                    f"{describe(output)} and labels of {describe(target)} raised "
                    f"{error_line(err)}; expected a metric that takes them {FULL_ERROR_HINT}"
                ) from err

    def _forward_failed(self, inputs: torch.Tensor, split: str, err: Exception) -> ConfigError:
        """Inputs of another dtype than the weights are the data's fault; anything else, with inputs of the
        declared shape, the model's."""
        weights = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        embeds = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in self.model.modules())
        if weights is not None and inputs.dtype != weights and not embeds:
            return ConfigError(
                f"data.{split}: inputs of {describe(inputs)}, but the model's weights are "
                f"{dtype_name(weights)} and its forward raised {error_line(err)}; expected "
                f"{dtype_name(weights)} inputs (convert them in the dataset, e.g. with a transform)"
            )
        return ConfigError(
            f"model: forward on the first {split} batch, inputs of {describe(inputs)}, raised "
            f"{error_line(err)}; expected a model built for these inputs (model.input_shape="
            f"${{data.input_shape}} and its other sizes) {FULL_ERROR_HINT}"
        )

    def _check_labels(self, output: torch.Tensor, target: torch.Tensor, split: str, num_classes: Optional[int]) -> None:
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
            raise ConfigError(
                f"data.{split}: its first batch has {seen}; expected class indices 0..{classes - 1}{ignored}"
            )
        if high < classes:
            return
        where = f"in the first {split} batch (task.loss: {type_name(self.loss)})"
        if num_classes is not None and high >= num_classes:
            raise ConfigError(
                f"data.num_classes={num_classes}: the model's output of {describe(output)} does not "
                f"fit {seen} {where}; expected data.num_classes >= {high + 1}, one score per class"
            )
        raise ConfigError(
            f"model: output of {describe(output)} does not fit {seen} {where}; expected "
            f"{num_classes or f'at least {high + 1}'} scores per sample, one per class "
            "(model.num_classes=${data.num_classes})"
        )

"""The example batch an export is traced on and checked with: real inputs of the run's data (the first batch of its
val split, else test, else train, at most EXAMPLE_SIZE samples), or the model's or task's `example_input_array`
(Lightning's name) where the data cannot be built; and the batches each exported file is checked on."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, open_dict

from framework.config.instantiate import build, error_line
from framework.core.errors import ConfigError, UserError
from framework.data.module import DataModule
from framework.loop.build import build_task

EXAMPLE_SIZE = 16  # samples of the first batch exported on: tracing time does not grow with data.eval_batch_size
SPLITS = ("val", "test", "train")  # where the example batch is taken from, in this order


@dataclass
class Example:
    """What the model is exported on, and further real inputs to check the export on."""

    batch: torch.Tensor
    spare: Optional[torch.Tensor]  # more samples (never empty), e.g. of the second batch; None: none
    source: str  # in words, e.g. "the first batch of data.val"
    warnings: list[str] = field(default_factory=list)


def example_input(
    cfg: DictConfig, model: torch.nn.Module, task_config: Callable[[], DictConfig], given: bool = False
) -> Example:
    """A real batch of the run's data (`data_example`); where the data cannot be built, or with `given`
    (`--example-input-array`), the model's or the task's (built from `task_config()`) `example_input_array`; else one
    line naming what is missing."""
    if given:
        chosen = example_input_array(model, task_config)
        if chosen is None:
            raise UserError(
                "--example-input-array: neither the model nor the task has an example_input_array; expected one "
                "(a tensor, as in Lightning), or no flag to export on a batch of the run's data"
            )
        return chosen
    try:
        example = data_example(cfg)
    except UserError as err:
        reason = str(err)
    else:
        if example is not None:
            return example
        reason = f"none of data.{', data.'.join(SPLITS)} gives a batch"
    found = example_input_array(model, task_config)
    if found is None:
        raise UserError(
            f"no example batch to export on: the run's data could not be built ({reason}); expected its files "
            "where the saved config says (run export from the folder the run was trained in, or put them back), "
            "or an example_input_array on the model"
        )
    note = f"the run's data could not be built ({reason}); exported on the {found.source} instead"
    found.warnings.append(note)
    return found


def data_example(cfg: DictConfig) -> Optional[Example]:
    """The inputs of the first batch of the first split of val, test and train the data has (at most EXAMPLE_SIZE
    samples of it), with the next ones (of that batch or the next) as spare; None if no split gives a batch."""
    if "data" not in cfg:
        return None
    node = copy.deepcopy(cfg.data)
    with open_dict(node):  # in this process: no worker processes to start for two batches
        node.update(num_workers=0, persistent_workers=False, prefetch_factor=None, pin_memory=False)
    data = build(node, "data")
    if not isinstance(data, DataModule):
        raise ConfigError(f"data._target_={node.get('_target_')!r}: expected a framework.data.module.DataModule")
    data.setup(seed=int(cfg.get("seed", 0)))
    for split in (s for s in SPLITS if data.has(s)):
        try:
            batches = iter(data.batches(split))
            first = next(batches, None)
            second = next(batches, None) if first is not None and len(inputs_of(first, split)) <= EXAMPLE_SIZE else None
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001  (whatever the dataset or collate raises)
            raise ConfigError(f"data.{split}: making its first batches raised {error_line(err)}") from None
        if first is None:
            continue
        inputs = inputs_of(first, split)
        spare = inputs[EXAMPLE_SIZE : 2 * EXAMPLE_SIZE] if second is None else inputs_of(second, split)[:EXAMPLE_SIZE]
        return Example(inputs[:EXAMPLE_SIZE], spare if len(spare) else None, f"first batch of data.{split}")
    return None


def inputs_of(batch: Any, split: str) -> torch.Tensor:
    """A batch's inputs: the batch itself if a tensor, the first element of an (inputs, labels) pair."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not isinstance(inputs, torch.Tensor):
        raise UserError(
            f"data.{split}: its batches are {type(batch).__name__}s whose inputs are not one tensor; export "
            "expects a tensor or an (inputs, labels) pair, or an example_input_array on the model"
        )
    return inputs


def example_input_array(model: torch.nn.Module, task_config: Callable[[], DictConfig]) -> Optional[Example]:
    """The model's `example_input_array` (Lightning's name), else the task's (the saved task, built around a
    model of the saved config), else None."""
    given, owner = getattr(model, "example_input_array", None), "model"
    cfg = task_config() if given is None else None
    if cfg is not None and "task" in cfg:
        task, _ = build_task(cfg)
        given, owner = getattr(task, "example_input_array", None), "task"
    if given is None:
        return None
    if not isinstance(given, torch.Tensor):
        raise UserError(
            f"the {owner}'s example_input_array is a {type(given).__name__}; export expects one tensor (the "
            "batch the model is exported and verified on)"
        )
    return Example(given, None, f"{owner}'s example_input_array")


def batches_to_check(model: torch.nn.Module, example: Example, dynamic: bool) -> tuple[list[torch.Tensor], bool]:
    """`check_batches`, and whether the batch dimension is dynamic: not where the model itself refuses a batch of
    another size (its code fixes the size, which an export may not see)."""
    batches = check_batches(example, dynamic)
    if dynamic:
        try:
            with torch.no_grad():
                model(batches[1])
        except Exception:  # noqa: BLE001  (whatever the model's forward raises on another size)
            return check_batches(example, dynamic=False), False
    return batches, dynamic


def check_batches(example: Example, dynamic: bool) -> list[torch.Tensor]:
    """The example and a second batch: another size where the batch dimension is `dynamic`, the same where not
    (none if no spare samples fill one)."""
    batch, spare, n = example.batch, example.spare, len(example.batch)
    if not dynamic:
        return [batch, spare[:n]] if spare is not None and len(spare) >= n else [batch]
    if spare is not None and len(spare) != n:
        return [batch, spare]
    if spare is not None and n > 1:
        return [batch, spare[: n - 1]]
    return [batch, torch.cat([batch, batch[:1]])]  # no other samples: the example's and one of them again

"""Several validation and test sets (`data.val_sets`, `data.test_sets`; Lightning's several loaders): each step is given
its set's dataloader_idx (only when there are several, as Lightning does), each set's metrics are named
`<name>/<set>` and averaged over that set's own samples (the default set's names unchanged), a monitor and `best/*`
work on any set, and what cannot work is one line. DDP exactness: tests/test_parallel.py; a kill and resume:
tests/test_resume.py; the worked example: tests/test_autoencoder.py."""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest
import torch
from conftest import evaluator_for, one_error_line, output, read_scalars, run_cli
from torch import nn
from torch.utils.data import TensorDataset

from framework.app import api
from framework.core.errors import ConfigError
from framework.data.module import DataModule
from framework.loop.run import check_set_steps
from framework.task.task import StepOutput, Task

pytestmark = pytest.mark.unit

HELD = "+data.val_sets.held={_target_: framework.zoo.datasets.digits, split: test}"
SHORT = ("trainer.max_epochs=3", "trainer.limit_train_batches=3", "trainer.test=false")


def split(n: int, offset: float) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1) + offset, torch.zeros(n, dtype=torch.long))


def two_sets(test_sets: Optional[dict[str, Any]] = None) -> DataModule:
    """val: 0..9 (batches of 4, 4, 2); val_sets.b: 200..206 (4, 3); test: 50..59."""
    data = DataModule(
        split(12, 100.0),
        split(10, 0.0),
        split(10, 50.0),
        val_sets={"b": split(7, 200.0), "off": None},
        test_sets=test_sets,
        batch_size=3,
        eval_batch_size=4,
    )
    data.setup(seed=0)
    return data


class Sets(Task):
    """Records (first input, dataloader_idx) of every step and batch hook; logs its mean as given and, without the
    set's suffix, under a name of its own per set."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(1, 1))
        self.steps: list[tuple[float, int]] = []
        self.hooks: list[int] = []
        self.batches = 0

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.model(batch[0]).mean()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> StepOutput:
        x = batch[0]
        self.steps.append((float(x[0]), dataloader_idx))
        self.batches += 1
        self.log("val/logged", x.mean())
        self.log("val/own_b" if dataloader_idx else "val/own", x.mean(), add_dataloader_idx=False)
        return StepOutput(x.mean(), {"square": (x**2).mean()})

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.hooks.append(dataloader_idx)

    def epoch_metrics(self, split: str) -> dict[str, torch.Tensor]:
        counted, self.batches = self.batches, 0
        return {"batches": torch.tensor(float(counted))}


def test_each_step_and_batch_hook_is_given_its_sets_dataloader_idx():
    task = Sets()
    evaluator_for(task, two_sets()).run("val", 0)
    assert task.steps == [(0.0, 0), (4.0, 0), (8.0, 0), (200.0, 1), (204.0, 1)]  # the default set first; `off`: none
    assert task.hooks == [0, 0, 0, 1, 1]


def test_with_one_set_the_step_is_given_no_dataloader_idx():
    given: list[tuple[Any, ...]] = []

    class One(Sets):
        def validation_step(self, batch: Any, batch_idx: int, *rest: int) -> None:  # type: ignore[override]
            given.append(rest)

    data = DataModule(split(12, 100.0), split(10, 0.0), batch_size=3, eval_batch_size=4)
    data.setup(seed=0)
    evaluator_for(One(), data).run("val", 0)
    assert given == [(), (), ()]


def test_each_sets_metrics_are_named_by_its_suffix_and_averaged_over_its_own_samples(tmp_path):
    task = Sets()
    metrics = evaluator_for(task, two_sets(), run_dir=tmp_path).run("val", 7)
    b = torch.arange(200.0, 207.0)
    assert metrics == pytest.approx(
        {
            "val/loss": 4.5,
            "val/square": 28.5,
            "val/logged": 4.5,
            "val/own": 4.5,
            "val/batches": 3.0,  # as with one set
            "val/loss/b": 203.0,
            "val/square/b": float((b**2).mean()),
            "val/logged/b": 203.0,
            "val/batches/b": 2.0,
            "val/own_b": 203.0,  # add_dataloader_idx=False: the name as the task gave it
        }
    )
    task.logger.flush()
    assert read_scalars(tmp_path)["val/loss/b"] == [(7, 203.0)]


def test_a_test_runs_every_test_set_and_the_default_test_step_passes_the_index_on():
    task = Sets()
    metrics = evaluator_for(task, two_sets(test_sets={"c": split(3, 300.0)})).run("test", 0)
    assert task.steps == [(50.0, 0), (54.0, 0), (58.0, 0), (300.0, 1)]  # Task.test_step runs validation_step
    assert metrics["test/loss"] == 54.5 and metrics["test/loss/c"] == 301.0 and metrics["test/logged/c"] == 301.0


def test_a_name_two_sets_log_without_their_suffix_is_one_line():
    class Same(Sets):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:  # type: ignore[override]
            self.log("val/mean", batch[0].mean(), add_dataloader_idx=False)

    with pytest.raises(
        ConfigError,
        match=r"self.log\('val/mean', ..., add_dataloader_idx=False\) in the sets 'val' "
        r"and 'b': one name would hold both; expected a name per set",
    ):
        evaluator_for(Same(), two_sets()).run("val", 0)


def test_a_step_that_takes_no_dataloader_idx_is_refused_where_there_are_several_sets():
    class NoIndex(Sets):
        def validation_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            pass

    with pytest.raises(
        ConfigError,
        match=r"task: NoIndex.validation_step\(batch, batch_idx\): data.val and "
        r"data.val_sets.b are 2 sets, so each of its steps is given a dataloader_idx; "
        r"expected validation_step\(self, batch, batch_idx, dataloader_idx=0\)",
    ):
        check_set_steps(two_sets(), NoIndex())


@pytest.mark.e2e  # (a run records its provenance with git)
def test_a_monitor_on_a_second_set_ranks_the_checkpoints_and_its_best_is_the_series_minimum(tmp_path):
    done = run_cli(
        tmp_path, *SHORT, HELD, "checkpoint.monitor=val/loss/held", "checkpoint.mode=min", "checkpoint.save_top_k=1"
    )
    assert done.returncode == 0, output(done)
    summary = json.loads((tmp_path / "summary.json").read_text())
    series = read_scalars(tmp_path)["val/loss/held"]
    assert len(series) == 3 and "val/loss" in read_scalars(tmp_path)  # the default set's name as before
    step, lowest = min(series, key=lambda point: point[1])
    # (TensorBoard keeps float32)
    assert summary["best/val/loss/held"] == pytest.approx(lowest, rel=1e-6)
    assert summary["val/loss/held"] == pytest.approx(series[-1][1], rel=1e-6)
    best = json.loads((tmp_path / "checkpoints" / "best" / "meta.json").read_text())
    assert best["step"] == step


@pytest.mark.e2e  # (a run records its provenance with git)
def test_a_monitor_naming_a_set_there_is_not_is_one_line_listing_the_sets(tmp_path):
    line = one_error_line(
        run_cli(
            tmp_path,
            *SHORT,
            HELD,
            "checkpoint.monitor=val/loss/nosuch",
            "checkpoint.mode=min",
            "checkpoint.save_top_k=1",
        )
    )
    assert line.startswith("Error: checkpoint.monitor='val/loss/nosuch': no such metric; expected one of val/loss, ")
    assert "val/loss/held" in line and "the other sets' end in /held" in line


@pytest.mark.e2e  # (a run records its provenance with git)
@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ("data.val=null", "checkpoint.save_top_k=0", HELD),
            "data.val=None: expected a dataset node beside data.val_sets (held): data.val is the default set",
        ),
        (("+data.val_sets.held=5",), "data.val_sets.held=5: expected a dataset node with a _target_"),
        (("+data.test_sets=[1]",), "data.test_sets=[1]: expected a mapping of set name to dataset"),
    ],
    ids=["no-default-set", "not-a-dataset", "not-a-mapping"],
)
def test_a_set_config_that_cannot_work_is_one_line(tmp_path, overrides, says):
    assert says in one_error_line(run_cli(tmp_path, *SHORT, *overrides))


def test_a_set_name_given_twice_is_refused_where_it_is_written(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "twice.yaml").write_text(
        "# @package _global_\ndata:\n  val_sets:\n"
        "    noisy: {_target_: framework.zoo.datasets.digits, split: test}\n"
        "    noisy: {_target_: framework.zoo.datasets.digits, split: val}\n"
    )
    with pytest.raises(ConfigError, match=r"twice.yaml line 5: invalid YAML \(found duplicate key noisy"):
        api.compose(["experiment=twice"], config_dir=tmp_path)


def test_a_set_name_that_is_no_path_component_is_refused(compose):
    from omegaconf import open_dict

    from framework.config.validate import validate

    cfg = compose()
    with open_dict(cfg):
        cfg.data.val_sets = {"a/b": None}
    with pytest.raises(ConfigError, match=r"data.val_sets='a/b': expected set names of letters, digits, _ and -"):
        validate(cfg)

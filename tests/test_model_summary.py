"""framework/observe/model_summary.py: the table of the task's parameters a fit starts with. On modules built
directly and on the tasks conf/ builds (the default run, experiment=lm, model=resnet18), at every depth, the rows
add up to the task's parameters exactly, each counted once (tied weights too); trainable and frozen are told apart;
a model on the meta device or one whose forward would fail is counted the same, with no forward pass. The printed
table says what the rows say. Then the run: the table on the console and in run.log as a fit starts, gone with
trainer.enable_model_summary=false, and a bad depth refused in one line."""
from __future__ import annotations

import re

import pytest
import torch
from conftest import one_error_line, output, run_cli
from torch import nn

from experiments.lm import TransformerLM
from framework.config.validate import validate
from framework.core.errors import ConfigError
from framework.loop.build import build_components
from framework.observe.model_summary import ModelSummary, format_summary, summarize
from framework.parallel.strategy import SingleDevice
from framework.task.task import Task

pytestmark = pytest.mark.unit

DEPTHS = (1, 2, 3, -1)


def params_of(module: nn.Module) -> int:
    """What the rows must add up to: every parameter once (nn.Module.parameters() skips a repeated one)."""
    return sum(p.numel() for p in module.parameters())


def check_rows_add_up(task: nn.Module) -> dict[int, ModelSummary]:
    """At every depth: the rows' params and trainable params are the task's, each parameter in one row."""
    summaries = {}
    for depth in DEPTHS:
        summary = summarize(task, depth)
        assert sum(r.params for r in summary.rows) == summary.total == params_of(task), depth
        trainable = sum(p.numel() for p in task.parameters() if p.requires_grad)
        assert sum(r.trainable for r in summary.rows) == summary.trainable == trainable, depth
        assert len({r.name for r in summary.rows}) == len(summary.rows), depth  # no row twice
        summaries[depth] = summary
    return summaries


def printed_rows(table: str) -> dict[str, tuple[str, int, int]]:
    """The table as printed: name -> (type, params, trainable), read back from its `i | name | type | n | n` lines."""
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows[cells[1]] = (cells[2], int(cells[3].replace(",", "")), int(cells[4].replace(",", "")))
    return rows


def printed_total(table: str, what: str) -> int:
    found = re.search(rf"^([\d,]+) +{re.escape(what)}$", table, re.MULTILINE)
    assert found is not None, table
    return int(found.group(1).replace(",", ""))


def built_task(compose, tmp_path, *overrides: str) -> nn.Module:
    cfg = compose(*overrides)
    return build_components(cfg, SingleDevice(torch.device("cpu")), tmp_path).task


# ---------------------------------------------------------------- the tasks conf/ builds
def test_the_default_run_has_a_row_per_child_of_the_task(compose, tmp_path):
    task = built_task(compose, tmp_path)
    summaries = check_rows_add_up(task)
    rows = {r.name: (r.type, r.params) for r in summaries[1].rows}
    assert rows == {"model": ("MLP", 85_002), "loss": ("CrossEntropyLoss", 0), "stateful_metrics": ("ModuleDict", 0)}


def test_the_transformer_lm_counts_its_attention(compose, tmp_path):
    """The forward-hook summary this replaces counted leaf modules a forward calls: nn.MultiheadAttention holds
    in_proj_weight itself and its out_proj is never called, so its rows came to 594,688 of 867,072."""
    task = built_task(compose, tmp_path, "experiment=lm")
    summaries = check_rows_add_up(task)
    assert summaries[1].total == 867_072
    assert [(r.name, r.type, r.params) for r in summaries[1].rows] == [("model", "TransformerLM", 867_072)]
    assert [r.params for r in summaries[3].rows if r.name.startswith("model.blocks.")] == [198_272] * 4
    every = {r.name: r for r in summaries[-1].rows}
    attention = ("self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj")
    assert [every[f"model.blocks.0.{name}"].params for name in attention] == [3 * 128 * 128, 3 * 128, 128 * 128 + 128]
    assert every["model.blocks.0.self_attn.in_proj_weight"].type == "Parameter"


def test_resnet18_at_every_depth(compose, tmp_path):
    task = built_task(compose, tmp_path, "model=resnet18")
    summaries = check_rows_add_up(task)
    assert summaries[1].total == 11_172_810
    assert {r.name for r in summaries[2].rows} >= {"model.conv1", "model.bn1", "model.layer1", "model.fc"}
    assert all(r.type != "Parameter" for r in summaries[-1].rows)  # every parameter of it is held by a leaf module


# ---------------------------------------------------------------- tasks and models built here
class TwoNets(Task):
    """A task holding a second net and a bare parameter beside its model."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        self.critic = nn.Linear(2, 1)
        self.temperature = nn.Parameter(torch.ones(3))


def test_a_second_net_and_a_bare_parameter_each_have_a_row():
    task = TwoNets()
    summaries = check_rows_add_up(task)
    rows = [(r.name, r.type, r.params) for r in summaries[1].rows]
    assert rows == [("temperature", "Parameter", 3), ("model", "Sequential", 58), ("critic", "Linear", 3)]
    assert [r.name for r in summaries[2].rows] == ["temperature", "model.0", "model.1", "model.2", "critic"]


def test_frozen_parameters_are_counted_but_not_trainable():
    task = TwoNets()
    task.model[0].requires_grad_(False)  # 4 * 8 + 8
    task.temperature.requires_grad_(False)
    summary = check_rows_add_up(task)[1]
    assert (summary.total, summary.trainable) == (64, 64 - 40 - 3)
    assert {r.name: r.trainable for r in summary.rows} == {"temperature": 0, "model": 18, "critic": 3}
    table = format_summary(summary)
    assert printed_total(table, "Trainable params") == 21 and printed_total(table, "Non-trainable params") == 43


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.tokens.weight  # tied: one parameter, two names


def test_tied_weights_are_counted_once_in_the_first_row_that_holds_them():
    task = Task(TiedLM())
    task.decoder = task.model.head  # the same module under a second name of the task too
    summaries = check_rows_add_up(task)
    assert summaries[1].total == 10 * 4 + 4 * 4 + 4
    rows = {r.name: r.params for r in summaries[2].rows}
    assert rows == {"model.tokens": 40, "model.body": 20, "model.head": 0, "decoder": 0}
    assert summaries[1].shared == 40
    assert "40        Shared params (tied weights), counted once" in format_summary(summaries[1])
    assert "Shared params" not in format_summary(summarize(TwoNets()))


def test_a_model_on_the_meta_device_is_counted_as_one_built_on_the_cpu():
    torch.manual_seed(0)
    on_cpu = summarize(Task(TransformerLM(block_size=16, d_model=32, num_layers=2)), -1)
    with torch.device("meta"):
        on_meta = summarize(Task(TransformerLM(block_size=16, d_model=32, num_layers=2)), -1)
    assert on_meta == on_cpu and on_meta.total > 0


class NoForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the summary ran a forward pass")


def test_nothing_is_run_to_count():
    assert summarize(Task(NoForward())).total == 12


def test_the_size_is_each_parameters_bytes_in_its_own_dtype():
    task = TwoNets()
    task.critic.to(torch.float64)  # 3 parameters of 8 bytes, the other 61 of 4
    assert summarize(task).size_mb == pytest.approx((61 * 4 + 3 * 8) / 1e6)


@pytest.mark.parametrize("depth", DEPTHS)
def test_the_printed_table_says_what_the_rows_say(compose, tmp_path, depth):
    task = built_task(compose, tmp_path, "experiment=lm")
    summary = summarize(task, depth)
    table = format_summary(summary)
    header = table.splitlines()[0]
    assert [c.strip() for c in header.split("|")] == ["", "Name", "Type", "Params", "Trainable"]
    assert printed_rows(table) == {r.name: (r.type, r.params, r.trainable) for r in summary.rows}
    assert sum(params for _, params, _ in printed_rows(table).values()) == printed_total(table, "Total params")
    assert printed_total(table, "Total params") == 867_072
    assert "3.468     Total estimated model params size (MB)" in table  # 867,072 float32 parameters


# ---------------------------------------------------------------- in a run
@pytest.mark.e2e
def test_a_fit_prints_the_table_and_writes_it_to_run_log_unless_turned_off(tmp_path):
    short = ("trainer.max_steps=1", "trainer.limit_val_batches=1", "trainer.test=false")
    on = run_cli(tmp_path / "on", *short)
    assert on.returncode == 0, output(on)
    table = on.stderr.split("Model summary:\n", 1)[1]
    assert printed_rows(table) == {"model": ("MLP", 85_002, 85_002), "loss": ("CrossEntropyLoss", 0, 0),
                                   "stateful_metrics": ("ModuleDict", 0, 0)}
    assert printed_total(table, "Total params") == 85_002
    log = (tmp_path / "on" / "run.log").read_text()
    assert "Model summary:" in log and "| model            | MLP              | 85,002 |    85,002" in log
    off = run_cli(tmp_path / "off", *short, "trainer.enable_model_summary=false")
    assert off.returncode == 0, output(off)
    assert "Model summary" not in output(off) and "Total params" not in output(off)
    assert "Model summary" not in (tmp_path / "off" / "run.log").read_text()


@pytest.mark.e2e
def test_a_depth_of_zero_is_one_line_naming_the_key(tmp_path):
    line = one_error_line(run_cli(tmp_path / "run", "trainer.model_summary_max_depth=0"))
    assert line == ("Error: trainer.model_summary_max_depth=0: expected >= 1 (1: the task's children) or -1 (every "
                    "leaf module); trainer.enable_model_summary=false turns it off")


@pytest.mark.parametrize("depth", [1, 4, -1])
def test_depths_users_set_are_accepted(compose, depth):
    validate(compose(f"trainer.model_summary_max_depth={depth}"))


def test_a_negative_depth_other_than_minus_one_is_refused(compose):
    with pytest.raises(ConfigError, match=r"^trainer.model_summary_max_depth=-2: expected >= 1"):
        validate(compose("trainer.model_summary_max_depth=-2"))

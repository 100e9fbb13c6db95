"""Exact resume: a run killed at any instant and resumed ends with the same weights, bit for bit on CPU,
as a run never interrupted. The kill comes from inside the run, at a chosen training step, so the test
is deterministic: SIGKILL (nothing can be saved; the periodic checkpoint before it is the resume point)
or SIGTERM (checkpoint.on_signal saves `last` at that exact mid-epoch position)."""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    TESTS,
    assert_identical,
    final_state,
    on_pythonpath,
    one_error_line,
    output,
    read_scalars,
    run_cli,
    run_command_in_process,
    run_export,
    saved_config,
)

from framework.checkpoint import open_checkpoint
from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput

pytestmark = pytest.mark.e2e


class SelfSignalTask(ClassificationTask):
    """Plain classification, except that training step number $KILL_AT sends $KILL_SIGNAL to $KILL_PID
    (default: this process). Without $KILL_AT it is exactly ClassificationTask."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def training_step(self, batch: Any) -> StepOutput:
        self.calls += 1
        if str(self.calls) == os.environ.get("KILL_AT") and os.environ.get("RANK", "0") == "0":
            parent = multiprocessing.parent_process()  # run.py, whichever process forked this worker
            target = (parent.pid if parent else os.getppid()) if os.environ.get("KILL_PID") == "parent" else os.getpid()
            os.kill(target, getattr(signal, os.environ["KILL_SIGNAL"]))
        return super().training_step(batch)


def scenario(tmp_path: Path, *overrides: str, kill_at: int, kill_signal: str, kill_pid: str = "self"):
    # Dropout makes the global RNG matter: a resume that did not restore it would diverge.
    common = ("task._target_=test_resume.SelfSignalTask", "trainer.log_every_n_steps=10", "model.dropout=0.2",
              *overrides)
    env = {"PYTHONPATH": on_pythonpath(TESTS)}
    whole = run_cli(tmp_path / "whole", *common, env=env)
    assert whole.returncode == 0, output(whole)
    killed_dir = tmp_path / "killed"
    killed = run_cli(killed_dir, *common, env={**env, "KILL_AT": str(kill_at), "KILL_SIGNAL": kill_signal,
                                                "KILL_PID": kill_pid})
    resumed = run_cli(None, f"resume={killed_dir}", env=env, fast=False)  # continues in killed_dir itself
    assert resumed.returncode == 0, output(resumed)
    assert_identical(final_state(tmp_path / "whole"), final_state(killed_dir))
    return whole, killed, resumed, killed_dir


@pytest.mark.slow
def test_sigkill_after_a_periodic_checkpoint_resumes_bit_exact(tmp_path):
    whole, killed, resumed, run_dir = scenario(
        tmp_path, "trainer.max_steps=70", "checkpoint.every_n_steps=25", "checkpoint.keep_last=-1",
        # written inline: in the background, step 25's save may still be unfinished 12 steps (~20 ms) later, and
        # the run would rightly resume from step 20's (the SIGKILL cases of test_resume_matrix cover that)
        "checkpoint.async_save=false", kill_at=37, kill_signal="SIGKILL")
    assert killed.returncode == -signal.SIGKILL
    assert "Resumed from" in output(resumed) and "at step 25 (epoch 1, batch 5)" in output(resumed)
    assert (run_dir / "checkpoints" / "step-25").is_dir()  # keep_last=-1 keeps every periodic one
    # One TensorBoard run, no duplicated steps: what the killed run logged after step 25 was purged.
    steps = [s for s, _ in read_scalars(run_dir)["train/loss"]]
    assert steps == [10, 20, 30, 40, 50, 60, 70]
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 70


@pytest.mark.slow
def test_a_kill_mid_epoch_resumes_a_second_validation_sets_series_and_best_exactly(tmp_path):
    whole, killed, resumed, run_dir = scenario(
        tmp_path, "trainer.max_steps=70", "checkpoint.every_n_steps=25", "checkpoint.async_save=false",
        "+data.val_sets.held={_target_: framework.zoo.datasets.digits, split: test}",
        "checkpoint.monitor=val/loss/held", "checkpoint.mode=min", kill_at=37, kill_signal="SIGKILL")
    assert killed.returncode == -signal.SIGKILL
    uninterrupted, again = read_scalars(tmp_path / "whole"), read_scalars(run_dir)
    assert len(uninterrupted["val/loss/held"]) >= 2
    for name in ("val/loss", "val/loss/held", "val/acc/held"):
        assert again[name] == uninterrupted[name], name  # the same steps, the same values, none twice
    summaries = [json.loads((d / "summary.json").read_text()) for d in (tmp_path / "whole", run_dir)]
    for name in ("val/loss/held", "best/val/loss/held", "test/loss", "best_checkpoint"):
        assert summaries[1][name] == (summaries[0][name] if name != "best_checkpoint" else
                                      summaries[0][name].replace(str(tmp_path / "whole"), str(run_dir))), name


@pytest.mark.slow
def test_sigterm_mid_epoch_with_worker_processes_saves_last_and_resumes_bit_exact(tmp_path):
    whole, killed, resumed, run_dir = scenario(
        tmp_path, "trainer.max_epochs=3", "data.num_workers=2", "data.persistent_workers=true",
        kill_at=33, kill_signal="SIGTERM")
    assert killed.returncode == 128 + signal.SIGTERM, output(killed)
    assert "Stopped by SIGTERM at step 33 (epoch 1, batch 13)" in output(killed)
    assert "Traceback" not in output(killed)


# ---------------------------------------------------------------------------------------------- resume rules
# A resumed run is the saved run: its group choices, presets and `+` keys come back from the checkpoint, and
# this command line's overrides apply on top of it (never a mix with the default options' keys).
SHORT = ("trainer.max_steps=12", "trainer.limit_train_batches=4", "trainer.test=false")


@pytest.fixture(scope="module")
def warmup_run(tmp_path_factory) -> Path:
    """A run off the default path: a preset, other optimizer and scheduler options, and a `+` key."""
    run_dir = tmp_path_factory.mktemp("rules") / "run"
    proc = run_cli(run_dir, *SHORT, "experiment=digits_penalty", "scheduler=warmup_cosine", "scheduler.warmup_steps=4",
                   "+optimizer.dampening=0.1", "logger.tensorboard=false")
    assert proc.returncode == 0, output(proc)
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def test_resume_alone_rebuilds_the_saved_config_exactly(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)
    before = saved_config(run_dir)
    proc = run_cli(None, f"resume={run_dir}", "trainer.max_steps=16", fast=False)
    assert proc.returncode == 0, output(proc)
    after = saved_config(run_dir)
    assert after["trainer"]["max_steps"] == 16
    after["trainer"]["max_steps"] = before["trainer"]["max_steps"]
    assert after.pop("resume") == str(run_dir) and before.pop("resume") is None
    assert after == before  # cnn from the preset, its Task, warmup_cosine, the `+` key: nothing else changed
    assert "trainer.max_steps: 12 -> 16" in output(proc)


def test_a_value_override_of_a_key_only_the_saved_option_has_is_accepted(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)  # scheduler.warmup_steps exists in warmup_cosine, not the default
    proc = run_cli(None, f"resume={run_dir}", "scheduler.warmup_steps=6", "trainer.max_steps=16", fast=False)
    assert proc.returncode == 0, output(proc)
    assert saved_config(run_dir)["scheduler"]["warmup_steps"] == 6


def test_another_scheduler_option_replaces_the_saved_one_as_a_whole(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)
    proc = run_cli(None, f"resume={run_dir}", "scheduler=step", "trainer.max_steps=16", fast=False)
    assert proc.returncode == 0, output(proc)
    scheduler = saved_config(run_dir)["scheduler"]
    assert scheduler["_target_"] == "torch.optim.lr_scheduler.StepLR"
    assert "warmup_steps" not in scheduler and "total_steps" not in scheduler  # no key of the old option left
    assert "scheduler: warmup_cosine -> step" in output(proc)


@pytest.mark.parametrize("override, group, saved", [
    ("model=mlp", "model", "cnn"), ("optimizer=adamw", "optimizer", "sgd"), ("data=fake", "data", "digits"),
    ("experiment=resnet18_finetune", "experiment", "digits_penalty")])
def test_a_group_whose_state_cannot_carry_over_is_one_error_and_changes_nothing(warmup_run, tmp_path, override,
                                                                                group, saved):
    run_dir = copy_of(warmup_run, tmp_path)
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    line = one_error_line(run_cli(None, f"resume={run_dir}", override, fast=False))
    assert f"{override}: the run used {group}={saved}" in line and "cannot carry over" in line
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != "run.log") == \
        [p for p in before if not p.endswith("run.log")]  # not even a .hydra/resumed-* record


def test_another_optimizer_class_by_value_is_one_error(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)
    line = one_error_line(run_cli(None, f"resume={run_dir}", "optimizer._target_=torch.optim.Adam", fast=False))
    assert "optimizer._target_='torch.optim.Adam': the run used 'torch.optim.SGD'" in line


@pytest.mark.slow
def test_a_learning_rate_given_on_resume_takes_effect_and_is_logged(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(run_dir, *SHORT, "trainer.log_every_n_steps=4").returncode == 0
    proc = run_cli(None, f"resume={run_dir}", "optimizer.lr=0.05", "trainer.max_steps=20", fast=False)
    assert proc.returncode == 0, output(proc)
    assert "optimizer.lr: 0.1 -> 0.05" in output(proc)
    lrs = dict(read_scalars(run_dir)["lr/default"])
    assert lrs[12] == pytest.approx(0.1) and lrs[16] == pytest.approx(0.05) and lrs[20] == pytest.approx(0.05)


@pytest.mark.slow
def test_a_config_file_of_the_users_own_comes_back_from_the_checkpoint(tmp_path):
    extra = tmp_path / "myconf" / "model"
    extra.mkdir(parents=True)
    (extra / "tiny.yaml").write_text("_target_: framework.zoo.models.MLP\ninput_shape: ${data.input_shape}\n"
                                     "num_classes: ${data.num_classes}\nhidden: [16]\n")
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "--config-dir", str(tmp_path / "myconf"), "model=tiny", "logger.progress_bar=false", *SHORT,
                   fast=False)
    assert proc.returncode == 0, output(proc)
    proc = run_cli(None, f"resume={run_dir}", "trainer.max_steps=16", fast=False)  # no --config-dir this time
    assert proc.returncode == 0, output(proc)
    assert saved_config(run_dir)["model"]["hidden"] == [16]


# ---------------------------------------------------------------------------------------------- saved config is data
def poison(run_dir: Path, edit) -> None:
    """Rewrite every checkpoint's meta.json (a new inode: checkpoints share files by hard links)."""
    for meta_path in (run_dir / "checkpoints").glob("*/meta.json"):
        meta = json.loads(meta_path.read_text())
        edit(meta["config"])
        meta_path.unlink()
        meta_path.write_text(json.dumps(meta))


@pytest.mark.slow
@pytest.mark.parametrize("node", [
    {"_target_": "builtins.open", "file": "VICTIM", "mode": "w"},
    {"_target_": "shutil.rmtree", "path": "VICTIM_DIR"},
    {"_target_": "framework.app.resume.os.remove", "path": "VICTIM"},  # reached through a module of the project
    {"_target_": "torch.load", "f": "VICTIM", "weights_only": False},
])
def test_a_saved_config_naming_a_target_outside_the_users_code_is_refused_before_anything_is_built(
        warmup_run, tmp_path, node):
    run_dir = copy_of(warmup_run, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    node = {k: str(victim) if v == "VICTIM" else str(tmp_path) if v == "VICTIM_DIR" else v for k, v in node.items()}
    poison(run_dir, lambda config: config["task"]["metrics"].update(evil=node))
    line = one_error_line(run_cli(None, f"resume={run_dir}", fast=False))
    assert f"task.metrics.evil._target_={node['_target_']!r}" in line and "trust_saved_config=true" in line
    assert victim.read_text() == "precious"
    export = run_export(str(run_dir))
    assert export.returncode == 0  # export builds only the model, whose targets are the project's own
    poison(run_dir, lambda config: config["model"].update(_target_=node["_target_"]))
    export = run_export(str(run_dir))
    assert export.returncode == 1 and "model._target_" in export.stderr and "Traceback" not in export.stderr
    assert victim.read_text() == "precious"


def test_trust_saved_config_builds_a_target_the_project_does_not_name(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)
    poison(run_dir, lambda config: config["task"].update(loss={"_target_": "torch.nn.MultiMarginLoss"}))
    assert "torch.nn.MultiMarginLoss" in one_error_line(run_cli(None, f"resume={run_dir}", fast=False))
    proc = run_cli(None, f"resume={run_dir}", "trust_saved_config=true", "trainer.max_steps=16", fast=False)
    assert proc.returncode == 0, output(proc)
    assert saved_config(run_dir)["task"]["loss"]["_target_"] == "torch.nn.MultiMarginLoss"


def test_an_interpolation_inside_a_saved_config_stays_text(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)
    poison(run_dir, lambda config: config.update(name="${oc.env:HOME}"))
    proc = run_cli(None, f"resume={run_dir}", "trainer.max_steps=16", fast=False)
    assert proc.returncode == 0, output(proc)
    assert saved_config(run_dir)["name"] == "${oc.env:HOME}"


@pytest.mark.slow
def test_a_checkpoint_whose_state_does_not_fit_the_run_is_skipped_for_an_older_one(tmp_path):
    """Intact files (their checksums match) whose optimizer state has the wrong shape: resume=RUN_DIR names it,
    skips it and resumes from the newest checkpoint that restores; named explicitly, it is one error."""
    from framework.checkpoint import write_checkpoint

    run_dir = tmp_path / "run"
    assert run_cli(run_dir, *SHORT, "checkpoint.every_n_steps=4", "checkpoint.keep_last=-1").returncode == 0
    newest = open_checkpoint(run_dir / "checkpoints" / "step-12")
    state, weights = newest.state(), {k: v.clone() for k, v in newest.model_state().items()}
    momentum = state["optimizer"]["state"][0]["momentum_buffer"]
    state["optimizer"]["state"][0]["momentum_buffer"] = momentum.flatten()[:3].clone()
    meta = {k: v for k, v in newest.meta.items() if k not in ("format_version", "structure", "checksums")}
    for name in ("step-12", "last"):
        shutil.rmtree(run_dir / "checkpoints" / name)
        write_checkpoint(run_dir / "checkpoints" / name, weights, state, meta)
    line = one_error_line(run_cli(tmp_path / "new", f"resume={run_dir / 'checkpoints' / 'last'}", fast=False))
    assert "optimizer/state/0/momentum_buffer: the checkpoint holds shape (3,)" in line
    proc = run_cli(None, f"resume={run_dir}", "trainer.max_steps=16", fast=False)
    assert proc.returncode == 0, output(proc)
    assert "Skipping a damaged checkpoint" in output(proc) and "optimizer/state/0/momentum_buffer" in output(proc)
    assert "at step 8 (" in output(proc)


# ---------------------------------------------------------------------------------------------- the data and the config it came from
def test_a_resume_on_a_map_style_split_of_another_size_is_refused_in_one_line(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)
    before = json.loads((run_dir / "summary.json").read_text())["step"]
    line = one_error_line(run_cli(None, f"resume={run_dir}", "data.train.val_fraction=0.2", "trainer.max_steps=16",
                                  fast=False))
    assert "data.train.val_fraction=0.2" in line and "data.train.val_fraction=0.15" in line, line
    assert "resume_on_new_data=true" in line
    assert json.loads((run_dir / "summary.json").read_text())["step"] == before  # nothing trained


@pytest.mark.unit
def test_a_recorded_interpolation_comes_back_only_where_it_gives_the_value_saved(compose):
    """A checkpoint's record is data: an entry that does not give the saved value (`data.val.root`, saved null),
    or that calls a resolver (`name`), is not followed; the true ones are, so the new shards reach data.train."""
    from omegaconf import OmegaConf

    from framework.config.interpolation import interpolations
    from framework.config.saved import SavedRun, _saved_interpolations, as_data, resumed_config

    first = compose("data=webdataset", "data.train_shards='old'")
    values = OmegaConf.to_container(first, resolve=True)
    record = {**interpolations(first), "data.val.root": "${data.train_shards}", "name": "${oc.env:HOME}"}
    saved = SavedRun("c", Path("c"), as_data(values), values, {"data": "webdataset"}, True)
    saved.interpolations = _saved_interpolations(record)  # what a checkpoint's meta.json gives saved_run
    assert "name" not in saved.interpolations
    fresh = compose("data=webdataset", "data.train_shards='new'")
    cfg, _ = resumed_config(fresh, saved, {"data": "webdataset"}, ["data.train_shards='new'"])
    assert (cfg.data.train.shards, cfg.data.val.root, cfg.name) == ("new", None, values["name"])
    assert OmegaConf.to_container(cfg.data.val, resolve=False)["root"] is None  # kept as saved


@pytest.mark.slow
def test_an_override_of_a_key_other_keys_interpolate_reaches_them_after_a_resume(tmp_path):
    """The no_decay group's lr is written as ${optimizer.lr}: a new optimizer.lr on resume is its lr too."""
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *SHORT, "trainer.log_every_n_steps=4", "+optimizer.param_groups.0.lr=${optimizer.lr}")
    assert proc.returncode == 0, output(proc)
    proc = run_cli(None, f"resume={run_dir}", "optimizer.lr=0.05", "trainer.max_steps=20", fast=False)
    assert proc.returncode == 0, output(proc)
    assert "optimizer.lr: 0.1 -> 0.05" in output(proc) and "optimizer.param_groups: " in output(proc)
    assert saved_config(run_dir)["optimizer"]["param_groups"][0]["lr"] == 0.05
    lrs = dict(read_scalars(run_dir)["lr/no_decay"])
    assert lrs[12] == pytest.approx(0.1) and lrs[16] == pytest.approx(0.05) and lrs[20] == pytest.approx(0.05)


@pytest.mark.slow
def test_a_checkpoint_without_a_recorded_data_identity_resumes_and_records_it_from_then_on(warmup_run, tmp_path):
    run_dir = copy_of(warmup_run, tmp_path)
    for meta_path in (run_dir / "checkpoints").glob("*/meta.json"):  # as a checkpoint of an older version
        meta = json.loads(meta_path.read_text())
        assert meta.pop("data_identity") is not None
        meta_path.unlink()
        meta_path.write_text(json.dumps(meta))
    # Through the command line's entry point, here: Hydra's logging set-up turns hydra.verbose into debug lines.
    proc = run_command_in_process([f"resume={run_dir}", "trainer.max_steps=16", "hydra.verbose=framework.data.module"])
    assert proc.returncode == 0, output(proc)
    assert "records no data identity" in output(proc)  # said at debug level: nothing to compare with
    line = one_error_line(run_cli(None, f"resume={run_dir}", "data.train.val_fraction=0.2", "trainer.max_steps=20",
                                  fast=False))
    assert "data.train.val_fraction=0.2" in line and "data.train.val_fraction=0.15" in line, line


@pytest.mark.unit
def test_a_saved_config_naming_a_module_that_moved_reads_as_naming_where_it_is_now():
    """Checkpoints written before the framework's modules became packages name framework.shards.TarShards and
    framework.metrics.Accuracy: they resume, their targets read as today's paths (framework/config/saved.py MOVED)."""
    import types

    from framework.config.instantiate import locate
    from framework.config.saved import from_checkpoint

    old = {"data": {"train": {"_target_": "framework.shards.TarShards", "shards": "x-{000000..000001}.tar"}},
           "task": {"metrics": {"acc": {"_target_": "framework.metrics.Accuracy"}}},
           "model": {"_target_": "framework.zoo.models.MLP"}}
    checkpoint = types.SimpleNamespace(path=Path("ck"), meta={"config": old, "choices": {}})
    saved = from_checkpoint(checkpoint)
    assert saved.config["data"]["train"]["_target_"] == "framework.data.shards.TarShards"
    assert saved.values["task"]["metrics"]["acc"]["_target_"] == "framework.task.metrics.Accuracy"
    assert saved.config["model"]["_target_"] == "framework.zoo.models.MLP"
    for target in ("framework.data.shards.TarShards", "framework.task.metrics.Accuracy"):
        assert locate(target, "_target_") is not None

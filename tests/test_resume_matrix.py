"""Exact resume for every option in conf/: a run interrupted mid-epoch and continued with nothing but
`resume=RUN_DIR` ends with the same model and optimizer tensors, bit for bit on CPU, as a run never
interrupted, whichever option of whichever group (or experiment preset) it uses.

The matrix is read from conf/ at collection time: every yaml file of every group directory but hydra/,
experiment presets included, is one test, so an option added to conf/ is covered without editing this
file. Those whose option changes how a run stops or what it saves then (SIGNAL_GROUPS, SIGNAL_OPTIONS) are
stopped by SIGTERM (checkpoint.on_signal saves `last` at that exact step); the others resume from a periodic
checkpoint that the uninterrupted run wrote mid-epoch (`resume=CHECKPOINT_DIR`, a new run directory): the same
restore, one process fewer per option (the suite runs on 2 cores). The signal
comes from tests/killhook/sitecustomize.py after a chosen optimizer step, so it never depends on the task,
model or optimizer a preset brings. SIGKILL, with a periodic save possibly still being written, is here for
the combination of the original report and the callbacks killed twice; test_resume.py and test_fsdp.py kill
single, DDP and FSDP runs so too. An option that composes the same run as an earlier one with the same
interruption (it restates a default: model=mlp, optimizer=sgd, ...) is skipped, naming that one."""
from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import (
    CONF,
    KILLHOOK,
    ROOT,
    assert_identical,
    final_state,
    make_cifar10,
    make_image_folder,
    make_mnist,
    on_pythonpath,
    output,
    run_cli,
    signal_after_step,
)
from omegaconf import DictConfig, OmegaConf

pytestmark = pytest.mark.e2e

# Small runs on the CPU (where bit-exactness is promised): 10 batches of 4 per epoch, 24 steps (into a third epoch);
# periodic checkpoints every 6 steps, all kept. Clipping keeps every preset finite on random pixels (cifar10's
# 3072 inputs at sgd's lr 0.1 reach NaN by step 26 without it).
COMMON = ("logger.progress_bar=false", "trainer.device=cpu", "trainer.max_steps=24",
          "trainer.limit_train_batches=10", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=4",
          "trainer.test=false", "trainer.grad_clip_norm=1.0", "data.batch_size=4", "checkpoint.every_n_steps=6",
          "checkpoint.save_last=true", "checkpoint.keep_last=-1")
# One thread per run: under pytest-xdist the runs already fill the cores, and oversubscribed OpenMP threads
# spin (a ResNet-18 run takes four times as long). A run in the pytest process has one already (conftest.py).
ENV = {"OMP_NUM_THREADS": "1"}
# SIGTERM in the middle of the second epoch; the periodic checkpoint resumed from is in the middle of the second
# epoch too (batch 8 of 10), so both resumed runs cross epoch ends (validation, epoch schedulers, callbacks).
SIGTERM_AT, PERIODIC = 13, "step-18"


def conf_options() -> list[tuple[str, str]]:
    """(group, option) for every yaml file under conf/<group>/, for every group directory except hydra/."""
    return [(group.name, path.relative_to(group).with_suffix("").as_posix())
            for group in sorted(CONF.iterdir()) if group.is_dir() and group.name != "hydra"
            for path in sorted(group.rglob("*.yaml"))]


# Stopped by SIGTERM: the groups whose option changes what a stop does or saves (callbacks, checkpoint policies,
# trackers), the strategies that stop in this process (parallel=single, dp) and the presets that bring a
# strategy or a stream of their own; spawned DDP's and FSDP's own stops are tested in test_parallel.py,
# test_fsdp.py and test_requeue.py. The other options (a model, an optimizer, a scheduler, a precision, a data
# set read in this process) change what is restored, not how the run stops: a periodic checkpoint is that restore.
SIGNAL_GROUPS = ("callbacks", "checkpoint", "logger")
SIGNAL_OPTIONS = ("parallel=single", "parallel=dp", "experiment=lm_fsdp", "experiment=lm_stream")
MATRIX = [pytest.param(group, option, "SIGTERM" if group in SIGNAL_GROUPS or f"{group}={option}" in SIGNAL_OPTIONS
                       else "periodic", id=f"{group}={option}")
          for group, option in conf_options()]
# Settings that are not a conf/ option but change what is saved and restored: a compiled model (its checkpoint
# must hold the model's own keys, and a resume compiles afresh in a process of its own).
MATRIX += [pytest.param("trainer.compile", "true", "periodic", id="trainer.compile=true")]


@pytest.fixture(scope="session")
def data_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, ...]]:
    """Data options that read files: small ones written in the official formats, and the overrides that
    point the option at them (no loader worker processes, to keep each run quick)."""
    root = tmp_path_factory.mktemp("data")
    make_mnist(root / "mnist")
    make_cifar10(root / "cifar10")
    make_image_folder(root / "image_folder", {"train": ("cat", "dog", "emu"), "val": ("cat", "dog", "emu")},
                      per_class=12)
    local = ("data.num_workers=0", "data.persistent_workers=false", "data.pin_memory=false")
    return {
        "mnist": (f"data.root={root / 'mnist'}", *local),
        "cifar10": (f"data.root={root / 'cifar10'}", "data.train.dataset.verify_checksums=false", *local),
        "image_folder": (f"data.root={root / 'image_folder'}", "data.num_classes=3", "data.input_shape=[3,16,16]",
                         *local),
    }


@functools.cache  # each option is composed by first_of_its_kind, then by its test: once per worker
def composed(*overrides: str) -> DictConfig:
    """The job's config with `hydra.runtime.choices` (which option each group got), as run.py composes it (read
    only: the same object is returned to every caller)."""
    from hydra import compose, initialize_config_dir

    import framework.app.main  # noqa: F401  (the resolvers conf/config.yaml uses)
    import framework.config.schema

    framework.config.schema.register()  # the schemas conf/ is composed against

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def spawns(overrides: tuple[str, ...]) -> bool:
    """Does the run start worker processes (DDP, FSDP)? A signal then reaches them through their parent."""
    return composed(overrides[0]).parallel.strategy in ("ddp", "fsdp")


def uninterrupted_state(run_dir: Path, overrides: tuple[str, ...]) -> dict[str, torch.Tensor]:
    whole = run_cli(run_dir, *overrides, fast=False)
    assert whole.returncode == 0, output(whole)
    return final_state(run_dir)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[[tuple[str, ...]], tuple[dict[str, torch.Tensor], Path]]:
    """uninterrupted(overrides) -> (the final state, the run directory) of a run never interrupted, run once per
    distinct composed config: the options that restate a default (model=mlp, optimizer=sgd, ...) all compose
    the same run. `overrides` is the option, then the overrides its composed config calls for (the same for two
    options that compose alike)."""
    runs: dict[tuple[str, tuple[str, ...]], tuple[dict[str, torch.Tensor], Path]] = {}

    def run(overrides: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], Path]:
        key = job_key(composed(overrides[0])), overrides[1:]
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("whole")
            runs[key] = uninterrupted_state(run_dir, overrides), run_dir
        return runs[key]

    return run


def interrupted_and_resumed(run_dir: Path, overrides: tuple[str, ...], kill_at: int,
                            kill_signal: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """Run, interrupted by `kill_signal` after optimizer step `kill_at`; then resume with `resume=RUN_DIR`
    alone, which continues in `run_dir` itself. Returns both processes."""
    cfg = composed(overrides[0])
    if kill_signal == "SIGTERM" and cfg.checkpoint.on_signal and not spawns(overrides):  # caught: in this process
        with signal_after_step(kill_at, signal.SIGTERM):
            killed = run_cli(run_dir, *overrides, fast=False)
    else:
        pythonpath = on_pythonpath(KILLHOOK)
        killed = run_cli(run_dir, *overrides, fast=False, env={**ENV, "PYTHONPATH": pythonpath,
                                                               "KILL_AT_STEP": str(kill_at), "KILL_SIGNAL": kill_signal})
    assert not (run_dir / "summary.json").exists(), f"not interrupted before its end:\n{output(killed)}"
    resumed = run_cli(None, f"resume={run_dir}", fast=False)
    assert resumed.returncode == 0, output(resumed)
    return killed, resumed


def resumed_step(resumed: subprocess.CompletedProcess) -> int:
    found = re.search(r"Resumed from \S+ at step (\d+) \(", output(resumed))
    assert found, output(resumed)
    return int(found.group(1))


def test_issue_combination_killed_at_a_random_step_resumes_bit_exact(tmp_path):
    # The report: this run, SIGKILLed between its periodic checkpoints and resumed, must end identical.
    # (First in the file: the longest test here, it starts first under pytest-xdist.)
    overrides = ("logger.progress_bar=false", "model=cnn", "optimizer=adamw", "scheduler=cosine", "precision=bf16",
                 "experiment=digits_penalty", "trainer.max_steps=600", "checkpoint.every_n_steps=100")
    kill_at = random.Random(2024).randint(101, 599)
    whole = uninterrupted_state(tmp_path / "whole", overrides)
    killed, resumed = interrupted_and_resumed(tmp_path / "killed", overrides, kill_at, "SIGKILL")
    assert killed.returncode == -signal.SIGKILL, output(killed)
    assert 0 < resumed_step(resumed) <= kill_at
    assert_identical(whole, final_state(tmp_path / "killed"))


def callback_values(run_dir: Path) -> dict:
    """The callbacks' saved state without its tensors (those are in final_state): early stopping's counters."""
    from framework.checkpoint import open_checkpoint

    state = open_checkpoint(run_dir / "checkpoints" / "last").state()["callbacks"]
    return {name: {k: v for k, v in part.items() if not isinstance(v, (torch.Tensor, dict))}
            for name, part in state.items()}


# Runs whose callbacks hold state, killed twice at random steps (the second kill a number of steps into the
# resumed process) and resumed each time: they must end as the run never interrupted, EMA weights, early
# stopping counters and the step it stopped at included.
KILLED_TWICE = {
    # Early stopping ends this run around step 70 of 200 (no improvement of 0.02 for 2 validations).
    "ema+early_stopping": ("callbacks=[default,ema]", "callbacks.ema.decay=0.9", "callbacks.early_stopping.patience=2",
                           "callbacks.early_stopping.min_delta=0.02", "trainer.max_steps=200",
                           "trainer.limit_train_batches=10", "checkpoint.every_n_steps=7"),
    # Validation every 4 steps (epochs of 10): killed between two of them; top-k, a plateau scheduler and early
    # stopping act on those validations.
    "val_every_n_steps": ("trainer.val_every_n_steps=4", "checkpoint=best_k", "checkpoint.every_n_steps=3",
                          "scheduler=plateau", "scheduler.patience=0", "callbacks.early_stopping.patience=50",
                          "trainer.max_steps=60", "trainer.limit_train_batches=10"),
}


@pytest.mark.parametrize("case", list(KILLED_TWICE))
def test_callback_state_survives_two_kills_at_random_steps_bit_exact(case, tmp_path):
    overrides = ("logger.progress_bar=false", "trainer.device=cpu", "trainer.log_every_n_steps=5", "trainer.test=false",
                 "model.dropout=0.2", *KILLED_TWICE[case])
    whole = tmp_path / "whole"
    assert run_cli(whole, *overrides, fast=False).returncode == 0
    rng = random.Random(case)
    killed = tmp_path / "killed"
    pythonpath = on_pythonpath(KILLHOOK)
    first, second = rng.randint(5, 30), rng.randint(3, 20)
    for run_args, kill_at in (((killed, *overrides), first), ((None, f"resume={killed}"), second)):
        proc = run_cli(*run_args, fast=False, env={**ENV, "PYTHONPATH": pythonpath, "KILL_AT_STEP": str(kill_at),
                                                   "KILL_SIGNAL": "SIGKILL"})
        assert proc.returncode == -signal.SIGKILL, output(proc)
    resumed = run_cli(None, f"resume={killed}", fast=False)
    assert resumed.returncode == 0, output(resumed)
    assert_identical(final_state(whole), final_state(killed))
    assert callback_values(killed) == callback_values(whole)
    ends = [json.loads((run / "summary.json").read_text()) for run in (whole, killed)]
    assert [(e["step"], e["stopped"]) for e in ends[1:]] == [(ends[0]["step"], ends[0]["stopped"])]
    if case == "ema+early_stopping":
        assert ends[0]["stopped"].startswith("early stopping") and ends[0]["step"] < 200


def job_key(cfg: DictConfig) -> str:
    """The composed job config as text, Hydra's own node left out: equal keys, equal runs."""
    return OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))


@functools.cache
def first_of_its_kind() -> dict[tuple[str, str], str]:
    """(composed job config, interruption) -> the id of the first matrix item that tests it. The options that
    restate a default (model=mlp, optimizer=sgd, task=classification, ...) compose the default run: it is run
    once per kind of interruption, not once per option (computed the same way in every xdist worker)."""
    first: dict[tuple[str, str], str] = {}
    for param in MATRIX:
        group, option, interruption = param.values
        first.setdefault((job_key(composed(f"{group}={option}")), interruption), param.id)
    return first


@pytest.mark.slow
@pytest.mark.parametrize(("group", "option", "interruption"), MATRIX)
def test_every_conf_option_resumes_bit_exact_after_an_interruption(group, option, interruption, data_files,
                                                                     uninterrupted, tmp_path):
    cfg = composed(f"{group}={option}")
    same = first_of_its_kind()[job_key(cfg), interruption]
    if same != f"{group}={option}":
        pytest.skip(f"{group}={option} composes the same run as {same}, which this test runs")
    if cfg.trainer.fast_dev_run:
        pytest.skip(f"{group}={option} is a fast_dev_run: it saves no checkpoint, so there is nothing to resume")
    if "owns" in str(cfg.optimizer) or cfg.model.get("_target_", "").endswith(".Generator"):
        pytest.skip(f"{group}={option} is the GAN's (two optimizers, manual optimization, which clips by itself): "
                    "tests/test_manual_optimization.py kills and resumes it bit-exact")
    if group == "model" and cfg.model.get("_target_", "").endswith(".AutoEncoder"):
        pytest.skip(f"{group}={option} is the autoencoder's (its output is an image, which only its own task takes): "
                    "experiment=autoencoder is tested here")
    # Dropout makes the global RNG matter: a resume that did not restore it would diverge.
    dropout = ("model.dropout=0.2",) if "dropout" in cfg.model else ()
    # overfit_batches picks its own train and validation batches: the limits are refused beside it.
    common = tuple(o for o in COMMON if not (cfg.trainer.overfit_batches and o.startswith("trainer.limit_")))
    overrides = (f"{group}={option}", *common, *data_files.get(cfg.hydra.runtime.choices.data, ()), *dropout)
    whole, whole_dir = uninterrupted(overrides)
    if interruption == "SIGTERM":
        killed, resumed = interrupted_and_resumed(tmp_path, overrides, SIGTERM_AT, "SIGTERM")
        if cfg.checkpoint.on_signal:
            assert killed.returncode == 128 + signal.SIGTERM, output(killed)
            # A spawned DDP run stops when the signal its parent forwards arrives: possibly a step or two later.
            stopped = re.search(r"Stopped by SIGTERM at step (\d+) \(", output(killed))
            assert stopped and output(killed).count("Stopped by SIGTERM") == 1, output(killed)  # by rank 0 only
            assert resumed_step(resumed) == int(stopped.group(1))
        else:  # nothing saved at the signal: the newest periodic (or epoch-end) checkpoint before it
            ddp = cfg.parallel.strategy in ("ddp", "fsdp")  # a spawned DDP parent reports its killed rank 0
            assert killed.returncode == (1 if ddp else -signal.SIGTERM), output(killed)
            assert 0 < resumed_step(resumed) <= SIGTERM_AT
        assert_identical(whole, final_state(tmp_path))
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["world_size"] == (2 if cfg.parallel.strategy in ("ddp", "fsdp") else 1), summary
    else:
        resumed = run_cli(tmp_path, f"resume={whole_dir / 'checkpoints' / PERIODIC}", fast=False)
        assert resumed.returncode == 0, output(resumed)
        assert resumed_step(resumed) == int(PERIODIC.split("-")[1])
        assert_identical(whole, final_state(tmp_path))


def test_killhook_is_inert_without_kill_at_step_and_shadows_no_other_sitecustomize():
    others = [p for p in sys.path if Path(p or ".").resolve() != KILLHOOK]
    assert PathFinder.find_spec("sitecustomize", [str(ROOT), *others]) is None
    env = {k: v for k, v in os.environ.items() if k not in ("KILL_AT_STEP", "KILL_SIGNAL")}
    probe = subprocess.run([sys.executable, "-c", "import sys; print(sorted({'sitecustomize', 'torch'} & "
                                                  "set(sys.modules)))"],
                           env={**env, "PYTHONPATH": str(KILLHOOK)}, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "['sitecustomize']", output(probe)

"""Used as a library: a wheel of this project, installed in a fresh environment, runs a repository of one's own
(a "lab", outside this checkout) with its own conf/config.yaml, its own `experiments` package (the name this
repository's examples use) and an experiment preset. Its runs train, sweep, stop on SIGTERM and resume, and
export exactly as the same config run through this repository's run.py; `--help` lists the framework's groups
beside the lab's; one version number everywhere."""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, assert_identical, final_state, output
from safetensors.torch import load_file

import framework

pytestmark = pytest.mark.e2e

# This repository's example presets: they build experiments.*, which the wheel does not hold (pyproject.toml).
EXAMPLES = ("experiment/digits_penalty.yaml", "experiment/digits_misclassified.yaml", "callbacks/metric_history.yaml",
            "experiment/lm.yaml", "experiment/lm_fsdp.yaml", "experiment/lit_mnist.yaml", "experiment/readme.yaml",
            "experiment/lm_stream.yaml", "experiment/gan.yaml",
            "experiment/autoencoder.yaml", "model/autoencoder.yaml")

LAB = {
    # Named config.yaml on purpose: the framework's primary config has the same name.
    "conf/config.yaml": """
        defaults:
          - htf                        # the framework's defaults
          - _self_
          - override model: tiny
          - override data: small_digits
        name: lab
        """,
    "conf/model/tiny.yaml": """
        _target_: experiments.models.TinyMLP
        input_shape: ${data.input_shape}
        num_classes: ${data.num_classes}
        hidden: 16
        dropout: 0.1                   # the global RNG matters: a resume that did not restore it would differ
        """,
    "conf/data/small_digits.yaml": """
        _target_: framework.data.module.DataModule
        num_classes: 10
        input_shape: [1, 8, 8]
        batch_size: 16
        train: {_target_: experiments.datasets.small_digits, split: train, size: 96}
        val: {_target_: experiments.datasets.small_digits, split: val, size: 48}
        """,
    "conf/experiment/quick.yaml": """
        # @package _global_
        defaults:
          - override /optimizer: adamw
        optimizer:
          lr: 0.01
        trainer:
          max_steps: 12                # 6 batches an epoch: 2 epochs
          log_every_n_steps: 4
        checkpoint:
          every_n_steps: 4
        logger:
          progress_bar: false
        """,
    "experiments/__init__.py": "",
    "experiments/models.py": """
        import math

        from torch import nn


        class TinyMLP(nn.Module):
            def __init__(self, input_shape, num_classes, hidden=16, dropout=0.0):
                super().__init__()
                self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                                         nn.Dropout(dropout), nn.Linear(hidden, num_classes))

            def forward(self, x):
                return self.net(x)
        """,
    "experiments/datasets.py": """
        from torch.utils.data import TensorDataset

        from framework.zoo.datasets import digits


        def small_digits(split, size):
            images, labels = digits(split).tensors
            return TensorDataset(images[:size], labels[:size])
        """,
}


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PYTHONPATH")}
    full_env["OMP_NUM_THREADS"] = "1"  # as conftest.run_cli: runs compared with each other share it
    full_env.update(env or {})
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=180, env=full_env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A wheel built from a copy of the checkout, installed in a new virtual environment that borrows this one's
    packages (torch, hydra, ...) through a .pth file: the plain path, so this environment's own .pth files (the
    editable install of the framework among them) are not read there."""
    work = tmp_path_factory.mktemp("package")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("framework", "conf", "hydra_plugins"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                 "-w", str(work / "dist"), str(source)], cwd=work)
    assert built.returncode == 0, output(built)
    wheel = next((work / "dist").glob("*.whl"))

    env = work / "env"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(env)], cwd=work)
    assert made.returncode == 0, output(made)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    (purelib / "borrowed.pth").write_text("".join(f"{path}\n" for path in site.getsitepackages()))
    python = env / "bin" / "python"
    # --ignore-installed: this environment's record of the editable install is visible there, and left alone.
    pip = run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)],
              cwd=work)
    assert pip.returncode == 0, output(pip)
    return SimpleNamespace(wheel=wheel, python=python, htf=env / "bin" / "htf", purelib=purelib)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lab = tmp_path_factory.mktemp("lab")
    assert not lab.is_relative_to(ROOT)
    for name, text in LAB.items():
        (lab / name).parent.mkdir(parents=True, exist_ok=True)
        (lab / name).write_text(textwrap.dedent(text).lstrip())
    return lab


@pytest.fixture(scope="module")
def trained(installed: SimpleNamespace, lab: Path) -> Path:
    """The lab's preset, trained by the installed `htf`."""
    run_dir = lab / "outputs" / "trained"
    proc = run([str(installed.htf), "--config-dir", "conf", "experiment=quick", f"hydra.run.dir={run_dir}"], cwd=lab)
    assert proc.returncode == 0, output(proc)
    return run_dir


def test_the_wheel_holds_the_framework_and_its_config_tree_but_not_this_repositorys_examples(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    code = {p.relative_to(ROOT).as_posix() for folder in ("framework", "hydra_plugins")
            for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    configs = {f"framework/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert code <= names, f"missing from the wheel (pyproject.toml lists the packages): {sorted(code - names)}"
    assert {n for n in names if n.endswith(".yaml")} == configs - {f"framework/conf/{e}" for e in EXAMPLES}
    assert "framework/conf/__init__.py" in names
    assert not [n for n in names if n.startswith("experiments/")]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "htf = framework.app.cli:main" in zipfile.ZipFile(installed.wheel).read(entry_points).decode()


def test_the_framework_imports_from_the_wheel_and_reports_one_version(installed, lab):
    proc = run([str(installed.python), "-c", "import framework; print(framework.__file__)"], cwd=lab)
    assert proc.returncode == 0, output(proc)
    assert Path(proc.stdout.strip()).is_relative_to(installed.purelib)  # not this checkout (the editable install)
    version = f"hydra-torch-framework {framework.__version__}\n"
    commands = ([str(installed.htf)], [str(installed.python), "-m", "framework"], [sys.executable, str(ROOT / "run.py")])
    for command in commands:
        proc = run([*command, "--version"], cwd=lab)
        assert (proc.returncode, proc.stdout) == (0, version), output(proc)


def test_help_lists_the_frameworks_groups_and_the_labs(installed, lab):
    proc = run([str(installed.htf), "--config-dir", "conf", "--help"], cwd=lab)
    assert proc.returncode == 0, output(proc)
    listed = re.findall(r"^(\w+): (.*)$", proc.stdout.split("== Config ==")[0], re.MULTILINE)
    groups = {group: set(options.split(", ")) for group, options in listed}
    assert {"cnn", "mlp", "resnet18", "tiny"} <= groups["model"]
    assert {"digits", "fake", "mnist", "small_digits"} <= groups["data"]
    assert {"bench", "quick", "resnet18_finetune"} <= groups["experiment"]
    assert not {"digits_penalty", "digits_misclassified"} & groups["experiment"]  # this checkout's examples
    assert {"scheduler", "precision", "parallel", "checkpoint", "callbacks", "logger", "trainer", "task"} <= set(groups)


def test_every_target_the_installed_config_tree_names_imports_from_any_directory(installed, tmp_path):
    """No preset of the wheel needs this checkout (its `experiments` package, say): every `_target_` of the
    installed tree imports in the fresh environment, from a directory with nothing in it."""
    script = textwrap.dedent("""
        import json
        from framework.core.errors import ConfigError
        from framework.config.instantiate import locate
        from framework.config.trees import framework_conf_dir
        from framework.config.trust import conf_targets
        missing = []
        for target in sorted(conf_targets([framework_conf_dir()])):
            try:
                locate(target, "_target_")
            except ConfigError:
                missing.append(target)
        print(json.dumps(missing))
        """)
    proc = run([str(installed.python), "-c", script], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    missing = json.loads(proc.stdout.splitlines()[-1])
    assert not missing, f"presets of the installed tree name code the wheel does not hold: {missing}"


def test_a_mistake_in_a_lab_is_one_error_line(installed, lab):
    proc = run([str(installed.htf), "--config-dir", "conf", "model=tinyy"], cwd=lab)
    assert proc.returncode == 1 and "Traceback" not in output(proc), output(proc)
    assert proc.stderr.strip() == ("Error: model=tinyy: no such option in group 'model'; did you mean 'tiny'? "
                                   "expected one of: cnn, mlp, resnet18, tiny")


def test_a_lab_run_trains_as_this_repositorys_run_py_does(installed, lab, trained):
    """The lab's config.yaml (not the framework's), its models and data (not this repository's experiments/)."""
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["step"] == 12
    assert summary["framework_version"] == framework.__version__
    meta = json.loads((trained / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["framework_version"] == framework.__version__  # the checkpoint says which version wrote it
    assert "TinyMLP" in (trained / ".hydra" / "config.yaml").read_text()
    here = lab / "outputs" / "run_py"
    proc = run([sys.executable, str(ROOT / "run.py"), "--config-dir", "conf", "experiment=quick",
                f"hydra.run.dir={here}"], cwd=lab)
    assert proc.returncode == 0, output(proc)
    assert_identical(final_state(here), final_state(trained))
    again = json.loads((here / "summary.json").read_text())
    assert {k: v for k, v in again.items() if "/" in k} == {k: v for k, v in summary.items() if "/" in k}


def test_a_lab_multirun_sweeps_with_the_summary(installed, lab, trained):
    sweep_dir = lab / "outputs" / "sweep"
    proc = run([str(installed.htf), "--config-dir", "conf", "-m", "experiment=quick", "optimizer.lr=0.01,0.02",
                f"hydra.sweep.dir={sweep_dir}"], cwd=lab)
    assert proc.returncode == 0, output(proc)
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(row["status"] for row in rows) == ["ok", "ok"]
    first = next(p for p in sweep_dir.iterdir() if p.name.startswith("0_"))
    assert_identical(final_state(first), final_state(trained))  # lr=0.01 is the preset's own


def test_a_lab_run_stopped_by_sigterm_resumes_to_the_weights_of_one_never_stopped(installed, lab, trained):
    run_dir = lab / "outputs" / "stopped"
    killhook = {"PYTHONPATH": str(ROOT / "tests" / "killhook"), "KILL_AT_STEP": "9", "KILL_SIGNAL": "SIGTERM"}
    killed = run([str(installed.python), "-m", "framework", "--config-dir", "conf", "experiment=quick",
                  f"hydra.run.dir={run_dir}"], cwd=lab, env=killhook)
    assert killed.returncode == 128 + signal.SIGTERM, output(killed)
    # The saved config names the lab's targets and the framework's (torch.optim.AdamW by its conf tree): trusted.
    resumed = run([str(installed.htf), "--config-dir", "conf", f"resume={run_dir}"], cwd=lab)
    assert resumed.returncode == 0, output(resumed)
    assert "at step 9 (epoch 1, batch 3)" in output(resumed)
    assert_identical(final_state(run_dir), final_state(trained))


def test_export_from_a_lab(installed, lab, trained):
    proc = run([str(installed.python), "-m", "framework", "export", str(trained), "--which", "last"], cwd=lab)
    assert proc.returncode == 0, output(proc)
    exported = final_state(trained)
    weights = load_file(str(trained / "export" / "model.safetensors"))
    assert_identical(weights, {k: v for k, v in exported.items() if not k.startswith("state:")})

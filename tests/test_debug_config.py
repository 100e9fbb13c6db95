"""The `debug` config group (lightning-hydra-template's debug=default/fdr/limit/overfit), the checks of the
trainer's Lightning keys (min_epochs, min_steps, overfit_batches, test_ckpt), and the hints for a Lightning
argument typed as a key: each points to the key that does the job here, or says there is none and why."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import one_error_line, output, run_cli
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from framework.config.hints import LIGHTNING_NAMES, check_closed_keys
from framework.config.schema import TrainerConfig
from framework.config.validate import validate
from framework.core.errors import ConfigError

pytestmark = pytest.mark.unit

TRAINER_KEYS = {f.name for f in fields(TrainerConfig)}


# ---------------------------------------------------------------- the debug group
DEBUG = {"trainer.max_epochs": 1, "trainer.max_steps": -1, "trainer.device": "cpu", "trainer.detect_anomaly": True,
         "data.num_workers": 0, "data.pin_memory": False}
OPTIONS = {
    "default": DEBUG,
    "fdr": {**DEBUG, "trainer.fast_dev_run": True},
    "limit": {**DEBUG, "trainer.max_epochs": 3, "trainer.limit_train_batches": 5, "trainer.limit_val_batches": 2,
              "trainer.limit_test_batches": 2},
    "overfit": {**DEBUG, "trainer.max_epochs": 20, "trainer.overfit_batches": 3, "callbacks.early_stopping": None,
                "trainer.limit_train_batches": 1.0, "trainer.limit_val_batches": 1.0},
    "profiler": {**DEBUG, "trainer.profiler": "simple", "trainer.detect_anomaly": False},
}


@pytest.mark.parametrize("option", OPTIONS)
def test_each_debug_option_composes_its_settings_and_passes_validation(compose, option: str) -> None:
    cfg = compose(f"debug={option}")
    for key, value in OPTIONS[option].items():
        assert OmegaConf.select(cfg, key) == value, key
    assert "grad_norm" in cfg.callbacks  # overfit turns early stopping off, not the other callbacks
    hydra = HydraConfig.get()
    assert hydra.job_logging.root.level == "DEBUG"
    assert hydra.run.dir.startswith("outputs/debug/digits_mlp/"), hydra.run.dir
    assert hydra.sweep.dir.startswith("outputs/debug/digits_mlp/multirun/"), hydra.sweep.dir
    validate(cfg)


def test_debug_wins_over_an_experiment_and_the_command_line_over_both(compose) -> None:
    cfg = compose()  # debug: null
    assert cfg.trainer.detect_anomaly is False and cfg.trainer.device == "auto"
    assert HydraConfig.get().run.dir.startswith("outputs/digits_mlp/")
    cfg = compose("experiment=lm", "debug=overfit")  # lm: max_steps 200, limit_val_batches 8
    assert cfg.trainer.max_steps == -1 and cfg.trainer.limit_val_batches == 1.0 and cfg.trainer.overfit_batches == 3
    validate(cfg)
    cfg = compose("debug=limit", "trainer.max_epochs=1", "trainer.device=auto")
    assert cfg.trainer.max_epochs == 1 and cfg.trainer.device == "auto" and cfg.trainer.limit_train_batches == 5


@pytest.mark.e2e
@pytest.mark.parametrize("option", ["fdr", "limit"])
def test_debug_run_trains_and_exits_0(tmp_path: Path, option: str) -> None:
    proc = run_cli(tmp_path / "run", f"debug={option}", "logger.progress_bar=false", fast=False)
    assert proc.returncode == 0, output(proc)
    done = "1 epoch, 1 step" if option == "fdr" else "3 epochs, 15 steps"  # limit: 5 train batches an epoch
    assert done in proc.stdout, proc.stdout


# ---------------------------------------------------------------- checks of the new trainer keys
def refused(*overrides: str, says: str, id: str):
    return pytest.param(overrides, says, id=id)


REFUSED = [
    refused("trainer.min_epochs=-1", says="trainer.min_epochs=-1: expected a whole number >= 0", id="min_epochs"),
    refused("trainer.min_steps=-2", says="trainer.min_steps=-2: expected a whole number >= 0", id="min_steps"),
    refused("trainer.min_epochs=21", says="trainer.min_epochs=21: expected <= trainer.max_epochs (20), which ends "
            "the run first", id="min_epochs-over-max"),
    refused("trainer.max_steps=10", "trainer.min_steps=11", says="trainer.min_steps=11: expected <= "
            "trainer.max_steps (10), which ends the run first", id="min_steps-over-max"),
    refused("trainer.overfit_batches=1.5", says="trainer.overfit_batches=1.5: expected 0 (off), a whole number of "
            "batches >= 1 or a fraction in (0, 1]", id="overfit-fraction"),
    refused("trainer.overfit_batches=-1", says="trainer.overfit_batches=-1: expected 0 (off)", id="overfit-negative"),
    refused("trainer.overfit_batches=3", "trainer.limit_val_batches=5", says="trainer.limit_val_batches=5: "
            "expected 1.0 with trainer.overfit_batches=3 (which picks the train and validation batches itself), "
            "or trainer.overfit_batches=0", id="overfit-with-limit"),
    refused("trainer.test_ckpt=first", says="trainer.test_ckpt='first': expected best, last or null", id="test_ckpt"),
    refused("trainer.test_ckpt=best", "checkpoint=none", says="trainer.test_ckpt='best': expected a best checkpoint "
            "to test, which checkpoint.save_top_k=0 never keeps: set checkpoint.monitor=val/acc "
            "checkpoint.save_top_k=1, or trainer.test_ckpt=last", id="test_ckpt-best-none-kept"),
    refused("trainer.test_ckpt=best", "checkpoint=none", "data.val=null", says="trainer.test_ckpt='best': expected "
            "last with data.val=null (nothing is validated, so no checkpoint is best)", id="test_ckpt-best-no-val"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("overrides, says", REFUSED)
def test_a_bad_value_of_a_lightning_key_is_one_error_line(tmp_path: Path, overrides: tuple[str, ...],
                                                           says: str) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *overrides, "trainer.dry_run=true", fast=False)
    line = one_error_line(proc)
    assert output(proc).strip() == line  # all it printed
    assert line.startswith(f"Error: {says}"), line
    assert not run_dir.exists()  # a refused start leaves nothing behind


@pytest.mark.parametrize("overrides", [
    ("trainer.min_epochs=20", "trainer.min_steps=5"), ("trainer.max_steps=10", "trainer.min_steps=10"),
    ("trainer.max_steps=10", "trainer.min_epochs=50"),  # max_steps decides the length; max_epochs is ignored
    ("trainer.overfit_batches=1",), ("trainer.overfit_batches=1.0",), ("trainer.overfit_batches=0.0",),
    ("trainer.overfit_batches=0.1", "trainer.limit_test_batches=2"),  # overfit_batches leaves the test alone
    ("trainer.limit_train_batches=5",),  # with overfit_batches=0 (off) a limit is fine
    ("trainer.test_ckpt=best",), ("trainer.test_ckpt=last", "checkpoint=none", "data.val=null"),
    ("trainer.test_ckpt=null", "checkpoint=none"),
], ids=" ".join)
def test_values_at_the_edges_of_the_lightning_keys_are_accepted(compose, overrides: tuple[str, ...]) -> None:
    validate(compose(*overrides))


# ---------------------------------------------------------------- hints for Lightning's argument names
def hint_for(cfg: DictConfig, key: str, value: object = 1) -> str:
    """The message check_closed_keys gives for `+KEY=VALUE` (what `+` lets through Hydra)."""
    group, _, name = key.rpartition(".")
    node = cfg[group] if group else cfg
    with open_dict(node):
        node[name] = value
    try:
        with pytest.raises(ConfigError) as raised:
            check_closed_keys(cfg)
    finally:
        with open_dict(node):
            del node[name]
    return str(raised.value)


def key_exists(cfg: DictConfig, key: str) -> bool:
    root, key = (HydraConfig.get(), key.removeprefix("hydra.")) if key.startswith("hydra.") else (cfg, key)
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(root, parent) if parent else root
    return isinstance(node, DictConfig) and name in node


def test_the_table_holds_no_key_of_ours_and_its_keys_exist(compose) -> None:
    """A name the trainer defines is never hinted (min_epochs, overfit_batches, detect_anomaly: real now)."""
    cfg = compose("trainer.min_epochs=2", "trainer.overfit_batches=2", "trainer.detect_anomaly=true")
    validate(cfg)
    assert not set(LIGHTNING_NAMES) & TRAINER_KEYS
    for name, home in LIGHTNING_NAMES.items():
        for key in {home.key, *dict(home.by_value).values()} - {None}:
            assert key_exists(cfg, key), f"{name} -> {key}"
        assert home.why or home.key, f"{name}: no equivalent needs a reason"


@pytest.mark.parametrize("group", ["trainer", "checkpoint", ""])
def test_every_lightning_name_gets_its_hint_in_the_message(compose, group: str) -> None:
    """Generated from LIGHTNING_NAMES: the hint's key exists in the composed config, or the reason is given."""
    cfg = compose()
    for name, home in LIGHTNING_NAMES.items():
        if name in (cfg[group] if group else cfg):  # a key of that group (checkpoint.save_last, precision)
            continue
        key = f"{group}.{name}" if group else name
        message = hint_for(cfg, key)
        assert message.startswith(f"{key}=1: {group or 'the root config'} has no key '{name}'; "), message
        if home.key is None:
            assert f"; Lightning's {name} has no equivalent here: {home.why}; expected one of: " in message, message
        else:
            suggested = re.search(r"did you mean '([^']+)'", message)
            assert suggested is not None and suggested.group(1) == home.key, message
            assert key_exists(cfg, suggested.group(1)), message
            assert f"({home.why})? " in message if home.why else "'? expected one of: " in message, message


def test_a_value_can_pick_the_key(compose) -> None:
    cfg = compose()
    assert "did you mean 'trainer.grad_clip_value'" in hint_for(cfg, "trainer.gradient_clip_algorithm", "value")
    assert "did you mean 'trainer.grad_clip_norm'" in hint_for(cfg, "trainer.gradient_clip_algorithm", "norm")


HINTS = [
    ("trainer.num_sanity_val_steps=2", "trainer has no key 'num_sanity_val_steps'; Lightning's num_sanity_val_steps "
     "has no equivalent here: the pre-flight check runs one batch of each split and leaves no trace in the task; "
     "expected one of: "),
    ("+trainer.num_sanity_val_steps=2", "trainer has no key 'num_sanity_val_steps'; Lightning's "
     "num_sanity_val_steps has no equivalent here: the pre-flight check runs one batch of each split"),
    ("num_sanity_val_steps=2", "no config group or key 'num_sanity_val_steps'; Lightning's num_sanity_val_steps "
     "has no equivalent here"),
    ("trainer.gradient_clip_algorithm=value", "trainer has no key 'gradient_clip_algorithm'; did you mean "
     "'trainer.grad_clip_value' (the key you set picks the algorithm)? "),
    ("+trainer.gradient_clip_algorithm=value", "did you mean 'trainer.grad_clip_value'"),
    ("+trainer.weights_summary=full", "did you mean 'trainer.model_summary_max_depth' (top is 1, full is -1; null is "
     "trainer.enable_model_summary=false)? "),
    ("trainer.logger=false", "did you mean 'logger.tensorboard' (the logger group)? "),
    ("+trainer.benchmark=true", "Lightning's benchmark has no equivalent here: set torch.backends.cudnn.benchmark"),
    ("trainer.track_grad_norm=2", "did you mean 'callbacks.grad_norm'"),
    ("+trainer.patience=5", "did you mean 'callbacks.early_stopping.patience'? "),
]


@pytest.mark.e2e
@pytest.mark.parametrize("override, says", HINTS, ids=[override for override, _ in HINTS])
def test_both_ways_of_typing_a_lightning_name_print_its_hint(tmp_path: Path, override: str, says: str) -> None:
    """Without `+` Hydra refuses the key while composing (cli.py reports it); with `+` it composes, and
    validate refuses it: the same hint either way."""
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, override, fast=False)
    line = one_error_line(proc)
    assert output(proc).strip() == line  # all it printed
    assert line.startswith(f"Error: {override.lstrip('+').split('=')[0]}="), line
    assert says in line, line
    assert not run_dir.exists()

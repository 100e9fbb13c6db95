"""Parameter-group rules and LR schedulers, as declared in config."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from conftest import read_scalars
from omegaconf import OmegaConf
from torch import nn

from framework.core.errors import ConfigError
from framework.loop.trainer import Trainer
from framework.optim.groups import build_optimizer, describe_groups
from framework.optim.schedulers import build_scheduler, lr_plan

pytestmark = pytest.mark.unit


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.embed.weight.requires_grad_(False)
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(()))


def optimizer(rules: list | None, **options):
    node = OmegaConf.create({"_target_": "torch.optim.SGD", "lr": 0.1, "weight_decay": 1e-4, **options,
                             **({"param_groups": rules} if rules is not None else {})})
    return build_optimizer(node, Net())


def groups(opt) -> dict[str, dict]:
    return {g["name"]: g for g in describe_groups(opt)}


NO_DECAY = {"name": "no_decay", "params": ["bias", "*.bias"], "modules": ["framework.optim.groups.NORM_LAYERS"],
            "weight_decay": 0.0}


def test_no_decay_rule_catches_biases_and_every_norm_weight_and_leaves_the_rest_in_default():
    opt, frozen = optimizer([NO_DECAY])
    g = groups(opt)
    assert g["no_decay"]["params"] == ["conv.bias", "bn.weight", "bn.bias", "norm.weight", "norm.bias", "fc.bias"]
    assert g["no_decay"]["weight_decay"] == 0.0
    assert g["default"]["params"] == ["scale", "conv.weight", "fc.weight"]  # named_parameters() order
    assert g["default"]["weight_decay"] == 1e-4
    assert frozen == ["embed.weight"]  # left out and listed


def test_each_matcher_kind_glob_module_type_and_ndim():
    opt, _ = optimizer([{"name": "glob", "params": ["fc.*"], "lr": 0.5},
                        {"name": "by_type", "modules": ["torch.nn.Conv2d"], "lr": 0.3},
                        {"name": "scalars", "ndim": 0, "lr": 0.2}])
    g = groups(opt)
    assert g["glob"]["params"] == ["fc.weight", "fc.bias"] and g["glob"]["lr"] == 0.5
    assert g["by_type"]["params"] == ["conv.weight", "conv.bias"] and g["by_type"]["lr"] == 0.3
    assert g["scalars"]["params"] == ["scale"] and g["scalars"]["lr"] == 0.2
    assert g["default"]["lr"] == 0.1


def test_first_matching_rule_wins():
    opt, _ = optimizer([{"name": "head", "params": ["fc.*"], "lr_mult": 10}, NO_DECAY])
    g = groups(opt)
    assert "fc.bias" in g["head"]["params"] and "fc.bias" not in g["no_decay"]["params"]


def test_multipliers_scale_the_base_values():
    opt, _ = optimizer([{"name": "head", "params": ["fc.*"], "lr_mult": 10, "decay_mult": 0.5}])
    g = groups(opt)
    assert g["head"]["lr"] == pytest.approx(1.0) and g["head"]["weight_decay"] == pytest.approx(5e-5)


def test_any_optimizer_option_can_be_overridden_per_group():
    node = OmegaConf.create({"_target_": "torch.optim.AdamW", "lr": 1e-3,
                             "param_groups": [{"name": "slow", "params": ["conv.*"], "betas": [0.5, 0.6]}]})
    opt, _ = build_optimizer(node, Net())
    assert opt.param_groups[0]["betas"] == (0.5, 0.6) and opt.param_groups[1]["betas"] == (0.9, 0.999)


def test_rule_matching_nothing_is_a_warning_naming_it(caplog):
    optimizer([{"name": "ghost", "params": ["nothing.*"]}])
    assert "ghost" in caplog.text and "matches no" in caplog.text


@pytest.mark.parametrize("rule, expected", [
    ({"params": ["fc.*"]}, "optimizer.param_groups[0].name"),
    ({"name": "x"}, "optimizer.param_groups[0]: rule 'x' has no matcher"),
    ({"name": "x", "params": ["fc.*"], "lrr": 1}, "optimizer.param_groups[0].lrr=1"),
    ({"name": "x", "modules": ["torch.nn.NoSuchLayer"]}, "optimizer.param_groups[0].modules[0]"),
    ({"name": "x", "modules": ["torch.nn.functional.relu"]}, "expected an nn.Module class"),
    ({"name": "x", "params": ["fc.*"], "lr": 1, "lr_mult": 2}, "give either lr_mult or lr"),
    ({"name": "x", "ndim": "one"}, "optimizer.param_groups[0].ndim"),
])
def test_malformed_rule_is_a_clear_error_naming_index_and_key(rule, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        optimizer([{"name": "ok", "params": ["conv.*"]}, rule][1:])


# ------------------------------------------------------------------------------------------- schedulers
def scheduler_for(compose, preset: str, *overrides: str, max_steps: int = 40, steps_per_epoch: int = 10):
    cfg = compose(f"scheduler={preset}", *overrides)
    opt, _ = build_optimizer(cfg.optimizer, Net())
    return opt, build_scheduler(cfg.scheduler, opt, max_steps=max_steps, max_epochs=1,
                                steps_per_epoch=steps_per_epoch), cfg


def curve(opt, sched, n: int) -> list[list[float]]:
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            lrs.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step()
    return lrs


def reference(make, n: int) -> list[list[float]]:
    """The same schedule from torch's class, built by hand on a fresh two-group SGD."""
    params = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    return curve(opt, make(opt), n)


@pytest.mark.parametrize("preset, make", [
    ("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.1)),
    ("multistep", lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[10, 15], gamma=0.1)),
    ("exponential", lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)),
    ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40)),
    ("onecycle", lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=40)),
])
def test_scheduler_preset_follows_the_torch_scheduler_it_wraps(compose, preset, make):
    opt, sched, _ = scheduler_for(compose, preset, "scheduler.interval=step")
    assert sched.length == 40
    ours = sum(curve(opt, sched.scheduler, 40), [])
    assert ours == pytest.approx(sum(reference(make, 40), []), rel=1e-6)


def test_warmup_cosine_rises_linearly_then_decays_to_min_lr(compose):
    opt, sched, _ = scheduler_for(compose, "warmup_cosine", "scheduler.warmup_steps=10", "scheduler.min_lr=0.001",
                                  max_steps=100)
    lrs = [row[0] for row in curve(opt, sched.scheduler, 101)]
    assert lrs[:11] == pytest.approx([0.1 * i / 10 for i in range(11)])
    expected = [0.001 + (0.1 - 0.001) * 0.5 * (1 + math.cos(math.pi * (s - 10) / 90)) for s in range(10, 101)]
    assert lrs[10:] == pytest.approx(expected)


def test_lambda_preset_calls_the_configured_callable(compose):
    from framework.zoo.schedules import inverse_sqrt

    opt, sched, _ = scheduler_for(compose, "lambda", "scheduler.lr_lambda.warmup_steps=5")
    assert [r[0] for r in curve(opt, sched.scheduler, 20)] == pytest.approx(
        [0.1 * inverse_sqrt(s, 5) for s in range(20)])


def test_lr_plan_matches_the_real_schedule_and_leaves_the_optimizer_untouched(compose):
    opt, sched, _ = scheduler_for(compose, "cosine")
    before = [dict(g) for g in opt.param_groups]
    plan = lr_plan(sched, opt, steps_per_epoch=10)
    assert [dict(g) for g in opt.param_groups] == before and sched.scheduler.last_epoch == 0
    real = curve(opt, sched.scheduler, 41)
    assert [lr for _, lr in plan["default"]] == pytest.approx([r[1] for r in real])


def test_run_length_is_derived_from_max_epochs_times_steps_per_epoch(compose):
    cfg = compose("scheduler=cosine")
    opt, _ = build_optimizer(cfg.optimizer, Net())
    sched = build_scheduler(cfg.scheduler, opt, max_steps=-1, max_epochs=3, steps_per_epoch=7)
    assert sched.length == 21 and sched.scheduler.T_max == 21


def test_senseless_length_is_warned_about(compose, caplog):
    cfg = compose("scheduler=cosine", "scheduler.interval=epoch")
    opt, _ = build_optimizer(cfg.optimizer, Net())
    build_scheduler(cfg.scheduler, opt, max_steps=5, max_epochs=1, steps_per_epoch=10)
    assert "no whole epochs" in caplog.text


# ------------------------------------------------------------------------------------------- in the trainer
def train(compose, tmp_path, *overrides: str) -> dict[str, list[tuple[int, float]]]:
    cfg = compose("logger.progress_bar=false", "trainer.log_every_n_steps=1", "trainer.test=false", *overrides)
    Trainer(cfg, tmp_path).fit()
    return read_scalars(tmp_path)


def test_warmup_cosine_from_the_command_line_rises_for_warmup_then_decays_to_near_zero(compose, tmp_path):
    scalars = train(compose, tmp_path, "scheduler=warmup_cosine", "scheduler.warmup_steps=10",
                    "trainer.max_steps=100")
    lrs = [lr for _, lr in scalars["lr/default"]]  # lr after each optimizer step
    assert len(lrs) == 100
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))  # rising for 10 steps
    assert lrs[9] == pytest.approx(0.1) and lrs[-1] < 1e-6
    plan = [lr for _, lr in scalars["lr_plan/default"]]
    assert plan[1:] == pytest.approx(lrs)
    written = json.loads((tmp_path / "param_groups.json").read_text())
    assert [g["name"] for g in written] == ["no_decay", "default"] and written[0]["params"][0] == "net.1.bias"


def test_epoch_interval_steps_once_per_epoch(compose, tmp_path):
    scalars = train(compose, tmp_path, "scheduler=step", "scheduler.step_size=1", "scheduler.gamma=0.5",
                    "trainer.max_epochs=3", "trainer.limit_train_batches=4")
    lrs = [round(lr, 6) for _, lr in scalars["lr/default"]]
    assert lrs == [0.1] * 4 + [0.05] * 4 + [0.025] * 4  # logged during epochs 0, 1, 2


def test_step_interval_steps_after_every_optimizer_step(compose, tmp_path):
    scalars = train(compose, tmp_path, "scheduler=exponential", "scheduler.interval=step", "scheduler.gamma=0.5",
                    "trainer.max_steps=3")
    assert [lr for _, lr in scalars["lr/default"]] == pytest.approx([0.05, 0.025, 0.0125])


def test_plateau_reduces_lr_when_the_monitored_metric_stalls(compose, tmp_path):
    # An improvement must beat the best by 1e9: after the first epoch, every epoch counts as a stall.
    scalars = train(compose, tmp_path, "scheduler=plateau", "scheduler.patience=0", "scheduler.threshold=1e9",
                    "+scheduler.threshold_mode=abs", "trainer.max_epochs=3", "trainer.limit_train_batches=2")
    lrs = [round(lr, 8) for _, lr in scalars["lr/default"]]
    assert lrs == [0.1, 0.1, 0.1, 0.1, 0.01, 0.01]
    assert "lr_plan/default" not in scalars  # metric-driven: no plan


def test_plateau_on_a_metric_that_does_not_exist_is_a_clear_error(compose, tmp_path):
    with pytest.raises(ConfigError, match="scheduler.monitor='val/nope'"):
        train(compose, tmp_path, "scheduler=plateau", "scheduler.monitor=val/nope", "trainer.max_epochs=1",
              "trainer.limit_train_batches=1")


def test_dry_run_prints_summary_groups_and_plan_without_training(compose, tmp_path, caplog):
    caplog.set_level("INFO")
    cfg = compose("logger.progress_bar=false", "trainer.dry_run=true", "scheduler=cosine")
    trainer = Trainer(cfg, tmp_path)
    before = [p.detach().clone() for p in trainer.run.task.parameters()]
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.run.task.parameters()))
    assert trainer.run.view.global_step == 0 and not (tmp_path / "summary.json").exists()
    text = caplog.text
    assert "| model            | MLP" in text and "85,002    Total params" in text and "no_decay" in text
    assert "LR plan" in text


def test_resnet18_finetune_preset_puts_the_head_at_ten_times_the_backbone_lr(compose, tmp_path):
    cfg = compose("experiment=resnet18_finetune", "logger.progress_bar=false")
    trainer = Trainer(cfg, tmp_path)
    g = {x["name"]: x for x in describe_groups(trainer.run.optimizers)}
    assert g["head"]["params"] == ["fc.weight"] and g["head_no_decay"]["params"] == ["fc.bias"]
    assert g["head"]["lr"] == pytest.approx(10 * g["default"]["lr"])
    assert g["no_decay"]["weight_decay"] == 0 and "bn1.weight" in g["no_decay"]["params"]


# ---------------------------------------------------------------------------------------------- epoch schedulers
def epoch_presets() -> list[str]:
    """Every scheduler option in conf/ that steps per epoch on a plan (no monitored metric)."""
    from conftest import CONF

    presets = []
    for path in sorted((CONF / "scheduler").glob("*.yaml")):
        node = OmegaConf.load(path)
        if node.get("interval") == "epoch" and node.get("monitor") is None and node.get("_target_"):
            presets.append(path.stem)
    return presets


@pytest.mark.parametrize("preset", epoch_presets())
@pytest.mark.parametrize("validation", ["every epoch", "every second epoch", "no val split"])
def test_an_epoch_scheduler_follows_its_plan_whatever_the_validation_cadence(compose, tmp_path, preset, validation):
    """Stepped once per completed epoch, not inside validation: with StepLR(step_size=1, gamma=0.5) over 4 epochs
    the LR used to end at 0.00625, 0.025 or 0.1 depending on how often validation ran."""
    cadence = {"every epoch": ("trainer.val_every_n_epochs=1",), "every second epoch": ("trainer.val_every_n_epochs=2",),
               "no val split": ("data.val=null", "callbacks.early_stopping=null")}[validation]
    shape = ("scheduler.step_size=1", "scheduler.gamma=0.5") if preset == "step" else \
        ("scheduler.milestones=[1,3]",) if preset == "multistep" else ()
    cfg = compose(f"scheduler={preset}", *shape, *cadence, "trainer.max_epochs=4", "trainer.limit_train_batches=2",
                  "trainer.log_every_n_steps=1", "trainer.test=false", "checkpoint=none", "logger.progress_bar=false")
    Trainer(cfg, tmp_path).fit()
    scalars = read_scalars(tmp_path)
    plan = dict(scalars["lr_plan/default"])
    used = scalars["lr/default"]
    assert [step for step, _ in used] == list(range(1, 9))
    for step, lr in used:  # during epoch e (2 steps each), the LR after e scheduler steps
        assert lr == pytest.approx(plan[(step - 1) // 2 * 2], rel=1e-6), (step, lr, plan)
    if preset == "step":
        assert used[-1][1] == pytest.approx(0.1 * 0.5 ** 3)


def test_a_monitored_scheduler_without_a_val_split_is_refused_at_start(compose, tmp_path):
    with pytest.raises(ConfigError, match=r"scheduler.monitor='val/loss': this run has no validation split"):
        Trainer(compose("scheduler=plateau", "data.val=null", "checkpoint=none", "callbacks=none"), tmp_path)

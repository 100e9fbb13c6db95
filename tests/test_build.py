"""framework/loop/build.py built directly: which attribute of the task holds the model (given as `model`, as a port's
`net`, through **kwargs, or built by the task itself), one ConfigError when that cannot be told, the callbacks
group, and Lightning's batch limits."""
from __future__ import annotations

from typing import Any

import pytest
from omegaconf import OmegaConf
from torch import nn

from framework.callbacks.early_stopping import EarlyStopping
from framework.callbacks.timer import Timer
from framework.core.errors import ConfigError
from framework.loop.build import build_callbacks, build_task, limit
from framework.task.task import Task

pytestmark = pytest.mark.unit
MODEL = {"_target_": "torch.nn.Linear", "in_features": 4, "out_features": 2}


class Given(Task):
    """Takes the built model group as `model` (Task's own)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.head = nn.Identity()  # a submodule without parameters does not compete


class Port(Task):
    """A LightningModule port: lightning-hydra-template's name for the model is `net`."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


class Forwarding(Task):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class OwnModel(Task):
    """Builds its model itself; the model group is not built for it."""

    def __init__(self, hidden: int = 3) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


class TwoModels(Task):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Linear(4, 3), nn.Linear(3, 4)


class Built:
    """A model group whose construction is counted: proof of whether build_task built it."""

    count = 0

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:
        cls.count += 1
        return nn.Linear(4, 2)


def config(task: dict[str, Any], model: dict[str, Any] = MODEL) -> Any:
    return OmegaConf.create({"task": task, "model": model})


@pytest.mark.parametrize("task, holder", [(Given, "model"), (Port, "net"), (Forwarding, "model")])
def test_the_model_group_is_given_to_the_task_as_model_or_net_and_found_there(task, holder):
    built, attr = build_task(config({"_target_": f"{__name__}.{task.__name__}"}))
    assert type(built) is task and attr == holder
    assert isinstance(getattr(built, attr), nn.Linear) and getattr(built, attr).out_features == 2


def test_a_task_config_that_sets_net_itself_is_not_given_the_model_group_again():
    Built.count = 0
    built, attr = build_task(config({"_target_": f"{__name__}.Port", "net": {"_target_": f"{__name__}.Built"}},
                                    model={"_target_": f"{__name__}.Built"}))
    assert attr == "net" and Built.count == 1  # `task.net: ${model}` in a port's config: built once, by the task


def test_a_task_that_builds_its_own_model_holds_it_in_its_one_submodule_with_parameters():
    Built.count = 0
    built, attr = build_task(config({"_target_": f"{__name__}.OwnModel", "hidden": 5},
                                    model={"_target_": f"{__name__}.Built"}))
    assert attr == "backbone" and built.backbone[0].out_features == 5
    assert Built.count == 0  # the model group is left unbuilt


def test_a_task_that_builds_two_nets_itself_is_its_own_model_as_a_lightning_module_is():
    task, model_attr = build_task(config({"_target_": f"{__name__}.TwoModels"}))
    assert model_attr == "" and task.get_submodule(model_attr) is task


def test_a_task_target_that_is_not_a_task_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^task._target_='torch.nn.Linear': expected a framework.task.task.Task "
                                          r"subclass"):
        build_task(config({"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1}))


def test_the_callbacks_group_skips_a_null_node_refuses_a_non_callback_and_adds_a_timer_for_max_time():
    cfg = OmegaConf.create({"callbacks": {"early_stopping": {"_target_": "framework.callbacks.early_stopping.EarlyStopping",
                                                             "patience": 2},
                                          "off": None},
                            "trainer": {"max_time": "00:01:00:00"}})
    callbacks = build_callbacks(cfg)
    assert list(callbacks) == ["early_stopping", "timer"]
    assert isinstance(callbacks["early_stopping"], EarlyStopping) and callbacks["early_stopping"].patience == 2
    assert isinstance(callbacks["timer"], Timer)
    cfg.callbacks = {"bad": {"_target_": "torch.nn.Identity"}}
    with pytest.raises(ConfigError, match=r"^callbacks.bad._target_='torch.nn.Identity' built a Identity; expected a "
                                          r"framework.callbacks.base.Callback subclass"):
        build_callbacks(cfg)


@pytest.mark.parametrize("value, available, batches", [(5, 20, 5), (50, 20, 20), (0.25, 20, 5), (0.01, 20, 1),
                                                      (1.0, 0, 0)])
def test_a_limit_is_a_count_as_an_int_and_a_fraction_of_the_epoch_as_a_float(value, available, batches):
    assert limit(value, available) == batches


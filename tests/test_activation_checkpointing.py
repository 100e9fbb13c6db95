"""parallel.activation_checkpointing: the chosen modules run their forward again in backward, the gradients are the
same as without it, and nothing a checkpoint holds changes (parameter names, state-dict keys); single, DDP and FSDP
(two gloo processes) give the same gradients with it as without."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import RANK_PARALLEL, join_test_ranks, start_ranks
from omegaconf import OmegaConf
from torch import nn

from experiments.lm import TransformerLM
from framework.app.launch import free_port
from framework.config.validate import validate
from framework.core.errors import ConfigError
from framework.parallel import activation_checkpointing

pytestmark = pytest.mark.unit

SMALL = {"block_size": 16, "d_model": 32, "num_layers": 2, "num_heads": 2, "ff_mult": 2, "dropout": 0.1}


def parallel(mode: str = "full", modules=None, strategy: str = "single", shard_modules=None):
    return OmegaConf.create({"strategy": strategy, "activation_checkpointing": mode,
                             "activation_checkpointing_modules": modules, "shard_modules": shard_modules})


def grads(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # dropout's masks: the same draws in both runs
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_full_recomputes_every_block_with_the_same_gradients_names_and_keys():
    torch.manual_seed(0)
    plain = TransformerLM(**SMALL)
    checkpointed = TransformerLM(**SMALL)
    checkpointed.load_state_dict(plain.state_dict())
    # The blocks: the children with parameters, inside the ModuleList (2 embeddings, 2 layers, the norm, the head).
    assert activation_checkpointing.apply(checkpointed, parallel("full")) == 6
    assert all(isinstance(b, activation_checkpointing.Checkpointed) for b in checkpointed.blocks)
    assert isinstance(checkpointed.blocks[0], nn.TransformerEncoderLayer)  # optimizer rules by class still match
    calls = []
    checkpointed.blocks[0].linear1.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 256, (3, SMALL["block_size"] + 1), generator=torch.Generator().manual_seed(2))
    expected, got = grads(plain, tokens), grads(checkpointed, tokens)
    assert len(calls) == 2  # forward, then again in backward
    assert list(got) == list(expected)  # parameter names unchanged
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    TransformerLM(**SMALL).load_state_dict(checkpointed.state_dict())  # loads without it, and the reverse
    checkpointed.load_state_dict(plain.state_dict())
    activation_checkpointing.apply(checkpointed, parallel("full"))  # applying twice changes nothing
    assert type(checkpointed.blocks[0]).__mro__.count(activation_checkpointing.Checkpointed) == 1


def test_selective_covers_the_named_classes_outermost_only_and_none_is_off():
    model = TransformerLM(**SMALL)
    names = ["torch.nn.TransformerEncoderLayer", "torch.nn.Linear"]
    assert activation_checkpointing.apply(model, parallel("selective", names)) == 3  # 2 layers and the head
    assert not isinstance(model.blocks[0].linear1, activation_checkpointing.Checkpointed)  # inside a layer
    assert isinstance(model.head, activation_checkpointing.Checkpointed)
    plain = TransformerLM(**SMALL)
    assert activation_checkpointing.apply(plain, parallel("none")) == 0
    assert not any(isinstance(m, activation_checkpointing.Checkpointed) for m in plain.modules())
    with pytest.raises(ConfigError, match=r"^parallel.activation_checkpointing_modules=\['Conv2d'\]: the model has no"):
        activation_checkpointing.apply(TransformerLM(**SMALL), parallel("selective", ["torch.nn.Conv2d"]))
    with pytest.raises(ConfigError, match=r"^parallel.activation_checkpointing_modules\[0\]='torch.nn.Nope' cannot"):
        activation_checkpointing.apply(TransformerLM(**SMALL), parallel("selective", ["torch.nn.Nope"]))


def test_full_under_fsdp_covers_its_shard_units():
    model = TransformerLM(**SMALL)
    cfg = parallel("full", strategy="fsdp", shard_modules=["torch.nn.modules.linear.NonDynamicallyQuantizableLinear"])
    assert activation_checkpointing.apply(model, cfg) == 2  # each layer's attention output projection
    assert isinstance(model.blocks[1].self_attn.out_proj, activation_checkpointing.Checkpointed)


@pytest.mark.parametrize("overrides, message", [
    (("parallel.activation_checkpointing=some",), r"parallel.activation_checkpointing='some': expected none, full"),
    (("parallel.activation_checkpointing=selective",),
     r"parallel.activation_checkpointing_modules=None: expected a non-empty list"),
    (("parallel.activation_checkpointing_modules=[torch.nn.Linear]",),
     r"parallel.activation_checkpointing_modules=\['torch.nn.Linear'\]: expected a non-empty list .* null with"),
])
def test_a_wrong_setting_is_one_line(compose, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))


def _rank(rank: int, port: int, out: str) -> None:
    """Gradients of the whole model under ddp and fsdp, with and without full checkpointing."""
    join_test_ranks(rank, port)
    from framework.parallel.strategy import DDPStrategy, FSDPStrategy

    cfg = OmegaConf.create(RANK_PARALLEL)
    tokens = torch.randint(0, 256, (2, SMALL["block_size"] + 1), generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, cls in (("ddp", DDPStrategy), ("fsdp", FSDPStrategy)):
        strategy = cls(cfg, "cpu")
        for mode in ("none", "full"):
            torch.manual_seed(0)
            model = TransformerLM(**{**SMALL, "dropout": 0.0})
            activation_checkpointing.apply(model, parallel(mode, strategy=name, shard_modules=cfg.shard_modules))
            wrapped = strategy.wrap(model)
            logits = wrapped(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            results[name, mode] = {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in strategy.unwrap(wrapped).named_parameters()
            }
    if rank == 0:
        torch.save(results, out)
    strategy.teardown()


@pytest.mark.e2e
@pytest.mark.distributed
def test_ddp_and_fsdp_give_the_same_gradients_with_full_checkpointing(tmp_path: Path):
    out = str(tmp_path / "grads.pt")
    start_ranks(_rank, (free_port(), out))
    results = torch.load(out)
    for name in ("ddp", "fsdp"):
        plain, checkpointed = results[name, "none"], results[name, "full"]
        assert list(plain) == list(checkpointed)
        for key in plain:
            torch.testing.assert_close(checkpointed[key], plain[key], rtol=0, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.parametrize("key", ["parallel.activation_checkpointing_modules", "parallel.shard_modules"])
def test_classes_the_model_does_not_use_are_one_line_naming_the_key_and_the_classes_it_does_use(key):
    from framework.parallel.strategy import module_classes, shard_units

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ConfigError) as refused:
        if key == "parallel.shard_modules":
            shard_units(model, module_classes(["torch.nn.TransformerEncoderLayer"], key))
        else:
            activation_checkpointing.apply(model, parallel("selective", ["torch.nn.TransformerEncoderLayer"]))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{key}=['TransformerEncoderLayer']: the model has no module")
    assert "torch.nn.modules.linear.Linear" in line and "torch.nn.modules.activation.ReLU" in line

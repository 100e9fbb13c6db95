"""Weights from elsewhere (`init_from`, export): reading them and checking that they fit a model."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from framework.checkpoint.format import COMPILED_PREFIX, _keys, _kind, plain_keys
from framework.checkpoint.load import open_checkpoint
from framework.core.errors import ConfigError

_CONVERTIBLE = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
}


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Weights for `init_from`: a checkpoint directory, a .safetensors file, or a plain `torch.save`
    state dict (read with weights_only=True: no code runs). A `module.` prefix (DataParallel/DDP) and
    torch.compile's `_orig_mod.` are dropped."""
    if not path.exists():
        raise ConfigError(
            f"init_from={str(path)!r}: no such file or directory; expected a checkpoint directory, "
            "a .safetensors file or a torch.save state dict"
        )
    mode = os.stat(path).st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):  # reading a FIFO would block, a device never end
        raise ConfigError(
            f"init_from={str(path)!r}: {_kind(mode)}; expected a checkpoint directory, a "
            ".safetensors file or a torch.save state dict"
        )
    state: Any  # whatever the file holds, until checked below
    if path.is_dir():
        state = open_checkpoint(path).model_state()
    elif path.suffix == ".safetensors":
        try:
            state = load_file(str(path))
        except SafetensorError as err:
            raise ConfigError(f"init_from={str(path)!r}: not a valid safetensors file ({err})") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ConfigError(
                f"init_from={str(path)!r}: cannot read it as weights ({str(err).splitlines()[0]}); "
                "expected a checkpoint directory, a .safetensors file or a torch.save state dict"
            )
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]  # Lightning-style file
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"init_from={str(path)!r}: expected a state dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return plain_keys(state)


def accept_plain_keys(model: torch.nn.Module) -> None:
    """Let a model holding torch.compile'd submodules (`torch.compile(block)` in its own code: a wrapper whose keys
    have `_orig_mod.`) load the plain keys every checkpoint holds. trainer.compile compiles in place: no such keys."""
    for module in model.modules():
        if isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper
            module.register_load_state_dict_pre_hook(_into_compiled)


def _into_compiled(module: torch.nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + COMPILED_PREFIX)]:
        state[prefix + COMPILED_PREFIX + key[len(prefix) :]] = state.pop(key)


def check_compatible(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, strict: bool) -> None:
    """One clear error listing the first missing, unexpected, shape-mismatched and unconvertible keys
    (load_state_dict converts between plain number dtypes, not from e.g. float4 or complex)."""
    own, state = plain_keys(model.state_dict()), plain_keys(state)  # as a checkpoint names them
    missing = [k for k in own if k not in state]
    unexpected = sorted(k for k in state if k not in own)  # a stable order: safetensors loads keys in none
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    unconvertible = [
        f"{k} {str(state[k].dtype).removeprefix('torch.')} vs {str(own[k].dtype).removeprefix('torch.')}"
        for k in own
        if k in state and state[k].dtype != own[k].dtype and not {state[k].dtype, own[k].dtype} <= _CONVERTIBLE
    ]
    problems = []
    for label, keys, shown in (
        ("missing", missing, strict),
        ("unexpected", unexpected, strict),
        ("shape mismatch", mismatched, True),
        ("dtype mismatch", unconvertible, True),
    ):
        if keys and shown:
            problems.append(f"{label} {_keys(keys)}")
    if problems:
        raise ConfigError(
            f"{source}: its weights do not fit this model ({'; '.join(problems)}); expected a "
            "checkpoint of the same model config"
        )

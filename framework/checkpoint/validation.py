"""Checking a loaded state against the live components before any of it is loaded, so a checkpoint that does
not fit this run (or a damaged one) cannot leave it half-restored."""

from __future__ import annotations

from typing import Any, Optional

import torch

from framework.checkpoint.format import DamagedCheckpoint, _is_int, _is_number, _key, _keys, _shown
from framework.core import reproducibility


def _mismatch(at: str, saved: Any, live: Any) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        f"{at}: the checkpoint holds {_shown(saved)}, expected {_shown(live)} as in this run "
        "(a checkpoint of another model, optimizer or config, or a damaged one)"
    )


def validate_state(saved: Any, live: Any, where: str) -> None:
    """Check that `saved`, a component's state as `Checkpoint.state()` returns it, fits `live`, the same
    component's `state_dict()` in this run, before anything is loaded: a checkpoint that does not fit must end
    the run with one line, not leave it half-restored or fail at its first step. Raises DamagedCheckpoint;
    its message starts with `where` (e.g. f"checkpoint {path}: optimizer") and the path within the state
    ("/state/3/exp_avg"), then says what was saved and what was expected.

    - A tensor must have the live one's dtype and shape; a live tensor with no elements (a buffer that fills
      as the run goes, e.g. a window of losses) takes any length in the same number of dimensions.
    - A dict must have the live one's keys, a list or tuple its length, item by item.
    - A plain value must be of the live one's kind: number (int or float), bool, string; a live None takes
      any plain value.
    The live component has not run yet: an empty live dict or list (no metric yet, no entry in a registry)
    takes saved entries of any key or number. For torch.optim's layout (`state` and `param_groups`) the groups
    must match; per-parameter states are compared where the live optimizer has them, and otherwise (it has
    not stepped) must be dicts belonging to parameters that `param_groups` lists."""
    if isinstance(live, torch.Tensor):
        variable = live.numel() == 0 and isinstance(saved, torch.Tensor) and saved.dim() == live.dim()
        if (
            not isinstance(saved, torch.Tensor)
            or saved.dtype != live.dtype
            or (saved.shape != live.shape and not variable)
        ):
            raise _mismatch(where, saved, live)
    elif isinstance(live, dict):
        if not isinstance(saved, dict):
            raise _mismatch(where, saved, live)
        if set(live) == {"state", "param_groups"}:
            _validate_optimizer(saved, live, where)
        elif live:
            _same_keys(saved, live, where)
            for key, value in live.items():
                validate_state(saved[key], value, f"{where}/{_key(key)}")
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or (live and len(saved) != len(live)):
            raise _mismatch(where, saved, live)
        for i, value in enumerate(live):
            validate_state(saved[i], value, f"{where}/{i}")
    elif isinstance(saved, (dict, list, tuple, torch.Tensor)) or (
        live is not None and _plain_kind(saved) != _plain_kind(live)
    ):
        raise _mismatch(where, saved, live)


def _plain_kind(value: Any) -> str:
    return "bool" if isinstance(value, bool) else "number" if _is_number(value) else type(value).__name__


def _same_keys(saved: dict, live: dict, where: str) -> None:
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        differences = ([f"lacks {_keys(missing)}"] if missing else []) + (
            [f"has {_keys(unexpected)} too"] if unexpected else []
        )
        raise DamagedCheckpoint(
            f"{where}: the checkpoint's state {' and '.join(differences)}; expected the keys "
            f"{_keys(list(live), 6)} as in this run (a checkpoint of another model, optimizer or "
            "config, or a damaged one)"
        )


def _validate_optimizer(saved: dict, live: dict, where: str) -> None:
    """torch.optim's state_dict: `param_groups` (with the ids of their parameters) and per-parameter `state`
    keyed by those ids, which load_state_dict matches to this run's parameters by position."""
    _same_keys(saved, live, where)
    validate_state(saved["param_groups"], live["param_groups"], f"{where}/param_groups")
    saved_ids = [i for group in saved["param_groups"] for i in group.get("params", [])]
    live_ids = [i for group in live["param_groups"] for i in group.get("params", [])]
    if not all(_is_int(i) for i in saved_ids) or len(set(saved_ids)) != len(saved_ids):
        raise DamagedCheckpoint(
            f"{where}/param_groups: the parameter ids {_keys(saved_ids, 6)} are not distinct "
            "whole numbers; expected the ids torch.optim writes"
        )
    position = dict(zip(saved_ids, live_ids))
    if not isinstance(saved["state"], dict):
        raise _mismatch(f"{where}/state", saved["state"], live["state"])
    for key, entry in saved["state"].items():
        at = f"{where}/state/{_key(key)}"
        if key not in position:
            raise DamagedCheckpoint(
                f"{at}: the checkpoint holds the state of parameter {_key(key)}, which no param "
                f"group lists; expected one of {_keys(saved_ids, 6)}"
            )
        if position[key] in live["state"]:
            validate_state(entry, live["state"][position[key]], at)
        elif not isinstance(entry, dict):
            raise _mismatch(at, entry, {})


def validate_rng_state(state: Any, where: str, device: Optional[torch.device] = None) -> None:
    """Check one process's RNG state, as `reproducibility.rng_state()` captures it, before any of it is set
    (`set_rng_state` sets python's, numpy's, torch's, then CUDA's: a bad one would leave the others set).
    Python's and numpy's are checked field by field (numpy does not check its position itself: one out of
    range crashes the process later); torch's and CUDA's are set on private generators, which apply torch's
    own checks and leave the global ones alone; CUDA's on `device`, the one this process restores onto (default
    the current one). Raises DamagedCheckpoint naming `where/python` etc."""
    if not isinstance(state, dict) or any(key not in state for key in ("python", "numpy", "torch")):
        raise DamagedCheckpoint(
            f"{where}: the checkpoint holds {_shown(state)}; expected the python, numpy and torch RNG states"
        )
    python = state["python"]
    internal = python[1] if isinstance(python, (list, tuple)) and len(python) == 3 else None
    if not (
        isinstance(internal, (list, tuple))
        and len(internal) == 625
        and python[0] == 3
        and _is_int(python[0])
        and all(_is_int(word) and 0 <= word < 2**32 for word in internal[:624])
        and _is_int(internal[624])
        and 0 <= internal[624] <= 624
        and (python[2] is None or _is_number(python[2]))
    ):
        raise DamagedCheckpoint(
            f"{where}/python: the checkpoint holds {_shown(python)} that random.setstate "
            "cannot take; expected (3, 624 32-bit words and a position <= 624, None or a number)"
        )
    numpy = state["numpy"]
    key = numpy.get("key") if isinstance(numpy, dict) else None
    if not (
        isinstance(key, torch.Tensor)
        and key.dtype == torch.int64
        and key.shape == (624,)
        and bool(((key >= 0) & (key < 2**32)).all())
        and _is_int(numpy.get("pos"))
        and 0 <= numpy["pos"] <= 624
        and numpy.get("has_gauss") in (0, 1)
        and _is_int(numpy["has_gauss"])
        and _is_number(numpy.get("gauss"))
    ):
        raise DamagedCheckpoint(
            f"{where}/numpy: the checkpoint holds {_shown(numpy)} that is not an MT19937 state; "
            "expected key (624 32-bit words as int64), pos (0 to 624), has_gauss (0 or 1), gauss"
        )
    _check_generator_state(state["torch"], f"{where}/torch", torch.Generator())
    if "cuda" in state:
        _check_cuda_state(state["cuda"], f"{where}/cuda", device)


def _check_cuda_state(cuda: Any, at: str, device: Optional[torch.device]) -> None:
    """This process's CUDA RNG state, or, from an older checkpoint, one per GPU its rank could see: any number
    of them, since only one is restored (`reproducibility.cuda_state_for`), each checked on this rank's device."""
    own = torch.device("cuda", reproducibility.cuda_index(device)) if torch.cuda.is_available() else None
    if isinstance(cuda, torch.Tensor):
        _check_generator_state(cuda, at, torch.Generator(own) if own is not None else None)
        return
    if not isinstance(cuda, (list, tuple)) or not cuda:
        raise DamagedCheckpoint(
            f"{at}: the checkpoint holds {_shown(cuda)}; expected a CUDA RNG state (or a list of them, one per device)"
        )
    for i, value in enumerate(cuda):
        _check_generator_state(value, f"{at}/{i}", torch.Generator(own) if own is not None else None)


def _check_generator_state(value: Any, at: str, generator: Optional[torch.Generator]) -> None:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
        raise DamagedCheckpoint(
            f"{at}: the checkpoint holds {_shown(value)}; expected a torch RNG state (a 1-d uint8 tensor)"
        )
    if generator is None:
        return
    try:
        generator.set_state(value)
    except (RuntimeError, TypeError, ValueError) as err:
        raise DamagedCheckpoint(
            f"{at}: the checkpoint holds no valid torch RNG state ({str(err).splitlines()[0]}); "
            "expected what torch.get_rng_state() returns"
        ) from None

"""Meta-device initialisation under FSDP (`parallel.meta_init`): no rank ever holds the whole model.

The model group is built with every parameter on the meta device; `fully_shard` then shards the empty
parameters, and `materialise` gives each rank its own shards only, with the values a plain build gives.

How the values come out identical to a one-process build, whatever the world size: while the model is built, a
parameter registration hook (torch's public `register_module_parameter_registration_hook`) keeps this rank's part
(dimension 0, as FSDP splits it) of the value each parameter is registered with and swaps the parameter for an
empty meta one; a `TorchFunctionMode` records every in-place op the constructors then run on it (`uniform_`,
`normal_`, `fill_`, `zero_`, ...: what `reset_parameters` and `nn.init` do), with the RNG state before each random
one, and runs that random op on a scratch tensor of the parameter's full shape so the generator advances exactly as
in a plain build (so dropout and the data order draw the same numbers after it). `materialise` replays each
parameter's ops on a full-size scratch tensor from its recorded RNG states and copies this rank's rows into the
shard: the random numbers are those of the whole tensor, as in one process. Memory: the shards, plus one full
parameter at a time. Buffers are built as usual (they are not sharded).

What cannot be replayed (an in-place op on a view of a parameter, such as Embedding's padding row, or one that
reads another tensor, such as `orthogonal_`) is noticed while building: the model is then built whole, as
without meta init, from the same RNG state, and the log says why. `init_from`'s weights go straight into the
shards (this rank's rows of each tensor). A task that builds its model itself (not from the `model` group) builds
it whole.
"""

from __future__ import annotations

import logging
import math
import mmap
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

from framework.checkpoint.format import chunk

log = logging.getLogger(__name__)

# Ops that overwrite every element from the generator, and ops that act element by element with scalar arguments
# (so that they commute with taking this rank's rows).
RANDOM_OPS = {
    "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_",
    "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",  # nn.init's
}  # fmt: skip
ELEMENTWISE_OPS = {
    "fill_", "zero_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "exp_",
    "log_", "sqrt_", "neg_", "abs_", "tanh_", "constant_", "ones_", "zeros_",
}  # fmt: skip
OVERWRITE_OPS = {"fill_", "zero_", "constant_", "ones_", "zeros_"}  # (element-wise too) every element set
IGNORED_OPS = {"requires_grad_", "share_memory_"}


class _Record:
    """One parameter: its full shape and dtype, this rank's rows of its registered value, and its in-place ops."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, initial: Optional[torch.Tensor]) -> None:
        self.shape, self.dtype, self.initial = shape, dtype, initial
        self.ops: list[tuple[Any, tuple, dict, Optional[torch.Tensor], Any]] = []  # fn, args, kwargs, rng, generator


class Recorder(TorchFunctionMode):
    """Records a model's construction (see the module docstring); `unreplayable` says what it could not record."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.records: dict[int, _Record] = {}  # id(meta parameter) -> its record
        self.params: list[torch.Tensor] = []  # the meta parameters and aliases (kept alive: their ids are keys)
        self.unreplayable: Optional[str] = None
        self.by_name: dict[str, _Record] = {}  # after `bind`
        self.empties = 0  # torch.empty calls made meta

    def register(self, module: nn.Module, name: str, param: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
        if param is None or id(param) in self.records:
            return None
        if param.is_meta:  # made by torch.empty (see __torch_function__): no value yet, as in a plain build
            self.records[id(param)] = _Record(param.shape, param.dtype, None)
            self.params.append(param)
            return None
        with torch.no_grad():
            data = param.detach()
            offset, length = chunk(data.shape[0], self.world_size, self.rank) if data.dim() else (0, 0)
            initial = data.narrow(0, offset, length).clone() if data.dim() else data.clone()
        meta = nn.Parameter(torch.empty_like(data, device="meta"), requires_grad=param.requires_grad)
        self.records[id(meta)] = _Record(data.shape, data.dtype, initial)
        self.params.append(meta)
        return meta

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "is_meta":
            # Code that asks skips what it would do to a real tensor (nn.init.trunc_normal_ returns at once, its
            # draws never made): nothing here would record it.
            if args and id(args[0]) in self.records:
                self.unreplayable = (
                    self.unreplayable or "code that skips meta parameters (as nn.init.trunc_normal_ and orthogonal_ do)"
                )
        if func is torch.empty and kwargs.get("device") in (None, "cpu", torch.device("cpu")):
            # Uninitialised memory means nothing until written, and every write to a parameter is recorded (a write
            # to anything else made here is refused, and so is a buffer left on the meta device): no whole parameter
            # is ever allocated, not even for the moment before it is registered.
            self.empties += 1
            return func(*args, **{**kwargs, "device": "meta"})
        if _aliases(func, name) and args and id(args[0]) in self.records:  # `.data`, `.detach()`: the whole tensor
            alias = func(*args, **kwargs)
            self.records[id(alias)] = self.records[id(args[0])]
            self.params.append(alias)  # kept alive: its id is a key
            return alias
        if name == "__setitem__" and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            # A write into part of a meta tensor (a parameter, or one torch.empty made here): nothing would keep it.
            self.unreplayable = self.unreplayable or "an item assignment into a parameter or a torch.empty tensor"
        if name.endswith("_") and not name.startswith("__") and name not in IGNORED_OPS:  # in place (not __get__)
            # nn.init's functions hand themselves over with the tensor as a keyword; a Tensor method has it first.
            rest, options = (
                (args, {k: v for k, v in kwargs.items() if k != "tensor"}) if "tensor" in kwargs else (args[1:], kwargs)
            )
            target = kwargs.get("tensor", args[0] if args else None)
            if isinstance(target, torch.Tensor) and target.is_meta:
                self._record(func, name, target, rest, options)
        return func(*args, **kwargs)

    def _record(self, func: Any, name: str, target: torch.Tensor, args: tuple, kwargs: dict) -> None:
        record = self.records.get(id(target))
        tensors = any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        if record is None:
            self.unreplayable = self.unreplayable or f"an in-place {name} on a view of a parameter"
        elif tensors or name not in RANDOM_OPS | ELEMENTWISE_OPS:
            self.unreplayable = self.unreplayable or f"{name} on a parameter"
        else:
            if name in RANDOM_OPS | OVERWRITE_OPS:  # every element set: what came before no longer matters
                record.initial, record.ops = None, []
            self._record_op(func, name, record, args, kwargs)

    def _record_op(self, func: Any, name: str, record: _Record, args: tuple, kwargs: dict) -> None:
        if name in RANDOM_OPS:
            generator = kwargs.get("generator")
            state = (generator or torch.default_generator).get_state()
            record.ops.append((func, args, kwargs, state, generator))
            func(_scratch(record.shape, record.dtype), *args, **kwargs)  # the generator advances as usual
        else:
            record.ops.append((func, args, kwargs, None, None))

    @contextmanager
    def building(self) -> Iterator[None]:
        # (torch's annotation says the hook returns None; register_parameter uses what it returns, as documented)
        handle = register_module_parameter_registration_hook(self.register)  # type: ignore[arg-type]
        try:
            with self:
                yield
        finally:
            handle.remove()

    def bind(self, model: nn.Module) -> None:
        """Key the records by parameter name in `model` (sharding replaces the parameter objects, not their names)."""
        self.by_name = {name: self.records[id(p)] for name, p in model.named_parameters() if id(p) in self.records}
        self.records.clear()
        self.params.clear()

    def materialise(self, model: nn.Module, device: torch.device, shards_on: Optional[torch.device] = None) -> None:
        """Give the sharded `model` (its parameters DTensors on the meta device) this rank's values: its parameters
        on `shards_on` (the CPU under FSDP's cpu_offload; default `device`), its buffers on `device`."""
        from torch.distributed.tensor import DTensor

        buffers = dict(model.named_buffers(remove_duplicate=False))  # to_empty empties them too
        model.to_empty(device=shards_on or device)
        with torch.no_grad():
            for module_name, module in model.named_modules():
                for name, _ in list(module.named_buffers(recurse=False)):
                    # assigning a tensor to a buffer's name keeps it a buffer, persistent or not (Module.__setattr__)
                    setattr(module, name, buffers[f"{module_name}.{name}" if module_name else name].to(device))
            for name, param in model.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(self._values(self.by_name.get(name), name))
        self.by_name = {}

    def _values(self, record: Optional[_Record], name: str) -> torch.Tensor:
        if record is None:
            raise RuntimeError(f"meta init: no record of parameter {name}")
        rows = chunk(record.shape[0], self.world_size, self.rank) if len(record.shape) else None
        random = bool(record.ops) and record.ops[0][3] is not None
        if record.initial is not None:  # element-wise ops alone: they act on this rank's rows as on the whole
            value = record.initial.clone()
        elif random:  # the whole tensor's draws, then this rank's rows of them
            value = _scratch(record.shape, record.dtype)
        else:  # filled, then element-wise ops
            value = _scratch((rows[1], *record.shape[1:]) if rows else (), record.dtype)
        for fn, args, kwargs, state, generator in record.ops:
            if state is not None:
                with torch.random.fork_rng(devices=[]):
                    (generator or torch.default_generator).set_state(state)
                    fn(value, *args, **kwargs)
            else:
                fn(value, *args, **kwargs)
        return value.narrow(0, *rows) if random and rows else value


def _scratch(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in an anonymous memory map of its own, unmapped when the tensor goes: whole parameters
    made one after the other must not stay in malloc's heap (which keeps freed memory: framework/parallel/allocator.py),
    or a rank's peak would grow towards the whole model's bytes after all."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=torch.uint8)[:size].view(dtype).view(shape)


def _aliases(func: Any, name: str) -> bool:
    """Does `func` return the whole of its tensor under another name (`.data`, `.detach()`)?"""
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    return name == "detach"


class Builder:
    """build.py's handle: builds the model group on the meta device (`build`), then gives the sharded model its
    values (`materialise`): the recorded initialisation, or `init_from`'s weights."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.recorder: Optional[Recorder] = None  # None: not built on the meta device (built whole instead)

    def build(self, make: Callable[[], nn.Module]) -> nn.Module:
        model, self.recorder = build_on_meta(make, self.strategy.rank, self.strategy.world_size)
        return model

    def materialise(self, model: nn.Module, cfg: Any) -> None:
        assert self.recorder is not None
        self.recorder.materialise(model, self.strategy.device, self.strategy.shard_device)
        self.recorder = None
        if cfg.get("init_from"):
            from framework.checkpoint import check_compatible, load_weights

            weights = load_weights(Path(cfg.init_from))
            check_compatible(model, weights, f"init_from={cfg.init_from!r}", cfg.init_strict)
            load_into_shards(model, weights)


def load_into_shards(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Each tensor of `weights` (checked against the model before it was sharded) into this rank's shard of it;
    keys the model lacks are ignored, and the ones `weights` lacks keep their initial values (init_strict=false)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name not in weights:
                continue
            full = weights.pop(name)  # dropped as soon as it is copied
            if isinstance(tensor, DTensor):
                offset, length = chunk(full.shape[0], tensor.device_mesh.size(), tensor.device_mesh.get_local_rank())
                tensor.to_local().copy_(full.narrow(0, offset, length))
            else:
                tensor.copy_(full)


def build_on_meta(build: Callable[[], Any], rank: int, world_size: int) -> tuple[Any, Optional[Recorder]]:
    """`build()` with its parameters on the meta device and recorded; where that cannot be replayed, built again
    as usual from the same RNG state (then the recorder is None)."""
    recorder = Recorder(rank, world_size)
    state = torch.get_rng_state()
    with recorder.building():
        built = build()
    meta_buffers = [name for name, b in built.named_buffers() if b.is_meta]
    if meta_buffers and recorder.unreplayable is None:
        recorder.unreplayable = f"a buffer made with torch.empty ({meta_buffers[0]})"
    if recorder.unreplayable is None:
        recorder.bind(built)
        return built, recorder
    log.warning(
        "parallel.meta_init: the model's initialisation does %s, which cannot be replayed shard by shard; "
        "it is built whole on every rank instead",
        recorder.unreplayable,
    )
    del built
    torch.set_rng_state(state)
    return build(), None

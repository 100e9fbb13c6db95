"""Where a run executes: one device (`single`), nn.DataParallel (`dp`), or one process per device, with the
whole model on each (`ddp`) or each holding a shard of it (`fsdp`).

A strategy only places and wraps: it picks the device, wraps the model for training, unwraps it for
everything saved or logged, reduces tensors across processes and says which rank does I/O. Launching the
processes is not its job (framework/app/main.py spawns them, or torchrun did); it joins the process group that
the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) describes. Under `fsdp` the
model's parameters become DTensors (each rank keeps its shard); `sharded` tells the checkpoint side that every
rank writes its own shards, and `collective_forward` tells the trainer that a forward pass gathers weights
from every rank, so every rank must run the same number of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, ContextManager, Iterator, Optional, Union

import torch
from torch import nn

from framework.config.instantiate import error_line, import_object
from framework.core.errors import ConfigError
from framework.parallel.group import LocalGroup, ProcessGroup, default_backend, under_launcher

log = logging.getLogger(__name__)


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={requested!r}: no CUDA device is visible; expected 'auto' or 'cpu'")
    return device


class Strategy:
    """What every strategy answers, with what one process on one device does. It holds no state of its own: a
    strategy sets `device` and `group` (its processes: framework/parallel/group.py) in its constructor."""

    name = "single"
    mesh: Any = None  # the DeviceMesh a sharded model's DTensors live on (fsdp)
    sharded = False  # every rank holds (and saves) only its shard of the training state
    collective_forward = False  # a forward pass communicates: every rank must run as many as the others
    device: torch.device
    group: Union[LocalGroup, ProcessGroup]

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def is_rank_zero(self) -> bool:
        return self.group.rank == 0

    @property
    def shard_device(self) -> torch.device:
        """Where the model's parameters (a sharded model's shards) live between steps: the device."""
        return self.device

    def place(self, task: nn.Module, model: nn.Module) -> None:
        """The task, its model included, on the device."""
        task.to(self.device)

    def wrap(self, model: nn.Module, param_dtype: Optional[torch.dtype] = None) -> nn.Module:
        """The model as training runs it. `param_dtype`: the autocast dtype of the run (bf16), which a sharded
        model also gathers its weights in."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module, for saving and logging: never a `module.` prefix in anything written."""
        while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel, ReplicaAutocast)):
            model = model.module
        return getattr(model, "_orig_mod", model)  # torch.compile's wrapper

    def for_eval(self, model: nn.Module) -> nn.Module:
        """The module evaluation runs through (DDP's wrapper is for training only)."""
        return model

    def no_sync(self, model: nn.Module) -> Optional[Callable[[], ContextManager[Any]]]:
        """What to enter for a micro-batch whose gradients are only accumulated (not the last before an
        optimizer step), so that it runs no gradient all-reduce; None where nothing is reduced per backward."""
        return None

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_sum(tensor)

    def gather_objects(self, obj: Any) -> list[Any]:
        return self.group.gather_objects(obj)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        return self.group.broadcast_object(obj)

    def background_ranks(self) -> Any:
        """The ranks a sharded checkpoint committed on a writer thread agrees through."""
        return self.group.background_ranks()

    def teardown(self, finished: bool = True) -> None:
        self.group.teardown(finished)


class SingleDevice(Strategy):
    """One process, one device."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.group = device, LocalGroup()


class ReplicaAutocast(nn.Module):
    """Runs `module` under autocast in `dtype`. nn.DataParallel runs each replica in a thread of its own under
    `autocast(device_type, enabled=...)` with no dtype, and the autocast dtype is thread-local: without this,
    a bf16 run's replicas compute in the device's default, fp16 on CUDA, with no loss scaling."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type, self.dtype = device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class DataParallelStrategy(Strategy):
    """nn.DataParallel over every visible GPU (the model and batches live on cuda:0)."""

    name = "dp"

    def __init__(self, device: torch.device) -> None:
        self.device, self.group = device, LocalGroup()

    def wrap(self, model: nn.Module, param_dtype: Optional[torch.dtype] = None) -> nn.Module:
        if param_dtype is not None:  # the run's autocast dtype, entered again in each replica's thread
            model = ReplicaAutocast(model, self.device.type, param_dtype)
        return nn.DataParallel(model)


class DDPStrategy(Strategy):
    """One process per device in a torch.distributed process group: nccl on CUDA, gloo on CPU."""

    name = "ddp"

    def __init__(self, parallel_cfg: Any, device: str) -> None:
        self.group = ProcessGroup()
        self.device = join(self.group, parallel_cfg, device, offload=False)
        self.find_unused_parameters = parallel_cfg.find_unused_parameters
        self.static_graph = parallel_cfg.static_graph

    def wrap(self, model: nn.Module, param_dtype: Optional[torch.dtype] = None) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids=device_ids,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
        )

    def no_sync(self, model: nn.Module) -> Optional[Callable[[], ContextManager[Any]]]:
        # DDP all-reduces in backward; under no_sync it only accumulates, and the next synced backward reduces
        # the sum: one all-reduce per optimizer step instead of one per micro-batch.
        return model.no_sync if isinstance(model, nn.parallel.DistributedDataParallel) else None

    def for_eval(self, model: nn.Module) -> nn.Module:
        # Ranks evaluate uneven shards; the plain module runs no collective that would wait for the others.
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        # DDP broadcasts rank 0's buffers (BatchNorm statistics) at the start of each forward, so after the last
        # one every rank holds its own: evaluate with rank 0's, the ones the checkpoint saves.
        with torch.no_grad():
            for buffer in module.buffers():
                self.group.broadcast_from_rank_zero(buffer)
        return module


def join(group: ProcessGroup, parallel_cfg: Any, requested: str, offload: bool) -> torch.device:
    """This rank's device (the local rank's GPU, or the CPU), set as the current one, its threads (processes sharing
    a CPU must not oversubscribe its cores), and the default process group joined on it. Returns the device."""
    device = pick_device(requested, group.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = _omp_num_threads()
    if threads:  # set here: a forked worker's OpenMP read its server's environment, not the run's
        torch.set_num_threads(threads)
    elif device.type != "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.local_world_size))
    group.join(parallel_cfg.backend or default_backend(device, offload=offload), parallel_cfg.timeout_s)
    return device


def _omp_num_threads() -> int:
    """OMP_NUM_THREADS's threads for this process (its first level: OpenMP takes a list), or 0 where it is unset."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() else 0


class FSDPStrategy(Strategy):
    """DDP's processes and reductions, with the model fully sharded (FSDP2's `fully_shard`): each rank keeps
    1/world_size of every parameter, gradient and optimizer state, gathers a unit's weights for its forward and
    backward, and reduce-scatters its gradients. The optimizer is built on the sharded parameters (DTensors), so it
    steps on the local shard only."""

    name = "fsdp"
    sharded = True
    collective_forward = True

    def __init__(self, parallel_cfg: Any, device: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.group = ProcessGroup()
        self.device = join(self.group, parallel_cfg, device, offload=parallel_cfg.cpu_offload)

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.shard_types = module_classes(parallel_cfg.shard_modules, "parallel.shard_modules")
        self.reshard_after_forward = parallel_cfg.reshard_after_forward
        self.cpu_offload = parallel_cfg.cpu_offload

    @property
    def shard_device(self) -> torch.device:
        """The CPU under cpu_offload (fully_shard's CPUOffloadPolicy refuses shards anywhere else), else the device."""
        return torch.device("cpu") if self.cpu_offload else self.device

    def place(self, task: nn.Module, model: nn.Module) -> None:
        """All of the task but its model, whose shards `wrap` moves: a model larger than one device is never whole
        on one."""
        place_beside(task, model, self.device)

    def wrap(self, model: nn.Module, param_dtype: Optional[torch.dtype] = None) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if param_dtype is torch.float16:  # precision=amp on a GPU without bf16 (config.validate refuses fp16 itself)
            raise ConfigError(
                "precision.mode=amp: this device has no bf16, so amp means fp16 with a GradScaler, "
                "which does not see gradients sharded over ranks; expected precision=fp32 with "
                "parallel=fsdp on this device"
            )
        # bf16: weights gathered and computed in bf16, gradients reduced in fp32 into fp32 master shards.
        precision = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
        )
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        units = shard_units(model, self.shard_types)
        for unit in [
            *units,
            model,
        ]:  # innermost first (a unit's parameters are those no unit inside it took), root last
            fully_shard(
                unit,
                mesh=self.mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=precision,
                offload_policy=offload,
            )
        log.info(
            "parallel=fsdp: %d shard unit%s and the root, over %d processes",
            len(units),
            "" if len(units) == 1 else "s",
            self.world_size,
        )
        return model

    def no_sync(self, model: nn.Module) -> Optional[Callable[[], ContextManager[Any]]]:
        # Gradients of micro-batches before the last are accumulated unsharded; the last one's backward
        # reduce-scatters the sum: one reduction per optimizer step, as DDP's no_sync.
        return functools.partial(_gradient_sync_off, model) if hasattr(model, "set_requires_gradient_sync") else None

    def for_eval(self, model: nn.Module) -> nn.Module:
        # The sharded module itself (its forward gathers the weights); buffers are not sharded and FSDP never
        # syncs them, so every rank evaluates with rank 0's, the ones export uses.
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for buffer in model.buffers():
                if not isinstance(buffer, DTensor):
                    self.group.broadcast_from_rank_zero(buffer)
        return model


def place_beside(task: nn.Module, model: nn.Module, device: torch.device) -> None:
    """Everything of `task` on `device` but `model`: its other children, and the parameters and buffers it
    registers on itself (which moving its children alone would leave behind)."""
    for child in task.children():
        if child is not model:
            child.to(device)
    with torch.no_grad():
        for name, param in list(task.named_parameters(recurse=False)):
            setattr(task, name, nn.Parameter(param.to(device), requires_grad=param.requires_grad))
        for name, buffer in list(task.named_buffers(recurse=False)):
            setattr(task, name, buffer.to(device))  # an existing buffer's name: it stays (non-)persistent


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def shard_units(model: nn.Module, types: Optional[tuple[type, ...]]) -> list[nn.Module]:
    """The modules `fully_shard` makes units of, innermost first. `types` None: the model's blocks, i.e. its
    children with parameters, looking inside containers (a ModuleList has no forward to gather weights in);
    otherwise every module of those classes (an empty tuple: none, the root alone)."""
    if types is None:

        def blocks(module: nn.Module) -> Iterator[nn.Module]:
            for child in module.children():
                if isinstance(child, _CONTAINERS):
                    yield from blocks(child)
                elif any(True for _ in child.parameters()):
                    yield child

        return list(blocks(model))
    if not types:
        return []
    units = [m for m in reversed(list(model.modules())) if m is not model and isinstance(m, types)]
    if not units:
        raise ConfigError(
            f"parallel.shard_modules={[t.__qualname__ for t in types]}: the model has no module of "
            f"these classes; expected some of the classes it uses ({classes_used(model)}), null for its blocks, "
            f"or [] for the root only"
        )
    return units


def classes_used(model: nn.Module) -> str:
    """The first classes of the model's modules, by dotted name: what a setting naming module classes could say."""
    used = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
    return ", ".join(used[:6]) + (", ..." if len(used) > 6 else "")


def module_classes(names: Any, key: str) -> Optional[tuple[type, ...]]:
    """A config list of module classes (`key`: `parallel.shard_modules`, ...) as classes; None stays None."""
    if names is None:
        return None
    found = []
    for i, name in enumerate(names):
        try:
            cls = import_object(str(name))
        except Exception as err:  # ImportError or ValueError from Hydra's locator; the cause says what is missing
            raise ConfigError(
                f"{key}[{i}]={name!r} cannot be imported: "
                f"{error_line(err.__cause__ or err)}; expected the dotted path of an nn.Module class, "
                "e.g. torch.nn.TransformerEncoderLayer"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigError(
                f"{key}[{i}]={name!r}: not an nn.Module class; expected one such as torch.nn.TransformerEncoderLayer"
            )
        found.append(cls)
    return tuple(found)


def build_strategy(parallel_cfg: Any, device: str) -> Strategy:
    if parallel_cfg.strategy in ("ddp", "fsdp"):
        name = getattr(parallel_cfg.strategy, "value", parallel_cfg.strategy)
        if not under_launcher():
            raise RuntimeError(
                f"parallel={name} needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: start it "
                f"with `python run.py parallel={name}` (which spawns the workers) or torchrun"
            )
        return (FSDPStrategy if name == "fsdp" else DDPStrategy)(parallel_cfg, device)
    chosen = pick_device(device)
    if parallel_cfg.strategy == "dp":
        if chosen.type == "cuda" and torch.cuda.device_count() >= 2:
            return DataParallelStrategy(torch.device("cuda", 0))
        log.info("parallel=dp needs at least two GPUs; %d visible, so running as single", torch.cuda.device_count())
    if chosen.type == "cuda":
        # cuda:N the current device too: the DataLoader's pin thread, pinned copies and new tensors without a
        # device otherwise go to (and open a context on) cuda:0.
        chosen = torch.device("cuda", torch.cuda.current_device() if chosen.index is None else chosen.index)
        torch.cuda.set_device(chosen)
    return SingleDevice(chosen)

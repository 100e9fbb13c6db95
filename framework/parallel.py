"""Where a run executes: one device (`single`), nn.DataParallel (`dp`), or one process per device (`ddp`).

A strategy only places and wraps: it picks the device, wraps the model for training, unwraps it for
everything saved or logged, reduces tensors across processes and says which rank does I/O. Launching the
processes is not its job (framework/app.py spawns them, or torchrun did); it joins the process group that
the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) describes.
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from framework.errors import ConfigError

log = logging.getLogger(__name__)

DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={requested!r}: no CUDA device is visible; expected 'auto' or 'cpu'")
    return device


def under_launcher() -> bool:
    """True when a launcher (torchrun, or our own spawn) already set the process-group environment."""
    return all(name in os.environ for name in DISTRIBUTED_ENV)


def default_devices() -> int:
    """Processes for parallel=ddp when parallel.devices is not set: one per GPU, or 2 on CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


class Strategy:
    """One process, one device."""

    name = "single"
    rank = 0
    world_size = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module, for saving and logging: never a `module.` prefix in anything written."""
        while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
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
        return tensor

    def gather_objects(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        return obj

    def teardown(self, finished: bool = True) -> None:
        pass


class DataParallelStrategy(Strategy):
    """nn.DataParallel over every visible GPU (the model and batches live on cuda:0)."""

    name = "dp"

    def wrap(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model)


class DDPStrategy(Strategy):
    """One process per device in a torch.distributed process group: nccl on CUDA, gloo on CPU."""

    name = "ddp"

    def __init__(self, parallel_cfg: Any, device: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        super().__init__(pick_device(device, self.local_rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif "OMP_NUM_THREADS" not in os.environ:  # processes sharing a CPU must not oversubscribe its cores
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        self.find_unused_parameters = parallel_cfg.find_unused_parameters
        self.static_graph = parallel_cfg.static_graph
        if not dist.is_initialized():
            backend = parallel_cfg.backend or ("nccl" if self.device.type == "cuda" else "gloo")
            timeout = datetime.timedelta(seconds=parallel_cfg.timeout_s)
            dist.init_process_group(backend, timeout=timeout, rank=self.rank, world_size=self.world_size,
                                    store=_elastic_attempt_store(timeout, self.world_size))

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                   find_unused_parameters=self.find_unused_parameters,
                                                   static_graph=self.static_graph)

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
                self.dist.broadcast(buffer, 0)
        return module

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(tensor)
        return tensor

    def gather_objects(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        holder = [obj]
        self.dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def teardown(self, finished: bool = True) -> None:
        """`finished`: every rank got here normally, so they first wait for each other (rank 0 may still be
        finishing a checkpoint save); a rank that tears down while another still uses the group can abort in
        gloo. After an error the others may be gone: no barrier, which would hang."""
        if self.dist.is_initialized():
            if finished:
                self.dist.barrier()
            self.dist.destroy_process_group()


def _elastic_attempt_store(timeout: datetime.timedelta, world_size: int) -> Optional[Any]:
    """Under torchrun's restarts, the store for this attempt only; None: init_process_group's own (env://).

    torchrun's agent keeps one TCPStore for the whole job and its workers join it (TORCHELASTIC_USE_AGENT_STORE)
    without a per-attempt prefix. After a restart, a new rank 1 could read the key the killed rank 0 had published
    and connect to a dead address: gloo's full-mesh connect failed or hung (pytorch/pytorch#135712). Keys under
    `attempt-<restart count>` keep the attempts apart. The count is the agent's own, the same for every worker of
    a single-node job; across nodes it is not (each agent counts its own restarts), so there torch's workaround,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt), is what the README recommends."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"framework/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def build_strategy(parallel_cfg: Any, device: str) -> Strategy:
    if parallel_cfg.strategy == "ddp":
        if not under_launcher():
            raise RuntimeError("parallel=ddp needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: start it "
                               "with `python run.py parallel=ddp` (which spawns the workers) or torchrun")
        return DDPStrategy(parallel_cfg, device)
    chosen = pick_device(device)
    if parallel_cfg.strategy == "dp":
        if chosen.type == "cuda" and torch.cuda.device_count() >= 2:
            return DataParallelStrategy(torch.device("cuda", 0))
        log.info("parallel=dp needs at least two GPUs; %d visible, so running as single",
                 torch.cuda.device_count())
    return Strategy(chosen)

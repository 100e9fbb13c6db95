"""The processes of a run: one (`LocalGroup`), or a torch.distributed process group joined from the environment a
launcher set (`ProcessGroup`: torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, or the run's own
spawn's), with the collectives the run needs (a tensor summed, small objects gathered or broadcast) and its
teardown. A strategy (framework/parallel/strategy.py) holds one."""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import torch

DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_launcher() -> bool:
    """True when a launcher (torchrun, or the run's own spawn) already set the process-group environment."""
    return all(name in os.environ for name in DISTRIBUTED_ENV)


def default_devices() -> int:
    """Processes for parallel=ddp/fsdp when parallel.devices is not set: one per GPU, or 2 on CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def default_backend(device: torch.device, offload: bool = False) -> str:
    """The process group's backend when parallel.backend is null: nccl on CUDA, gloo on CPU. `offload`: FSDP keeps
    gradients and optimizer state on the CPU (cpu_offload), where clipping and GradNormMonitor reduce them, and
    nccl reduces no CPU tensor, so those go through gloo."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if offload else "nccl"


class LocalGroup:
    """One process: every collective is the identity."""

    rank, world_size, local_rank = 0, 1, 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_objects(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def broadcast_from_rank_zero(self, tensor: torch.Tensor) -> None:
        pass

    def background_ranks(self) -> LocalGroup:
        """The ranks a sharded checkpoint committed on a writer thread agrees through (one process: itself)."""
        return self

    def teardown(self, finished: bool = True) -> None:
        pass


class ProcessGroup:
    """This process's place in the job, read from the launcher's environment, and the default process group,
    joined with `backend` on `device` (every rank calls it, once)."""

    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def join(self, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            dist.init_process_group(
                backend,
                timeout=timeout,
                rank=self.rank,
                world_size=self.world_size,
                store=_elastic_attempt_store(timeout, self.world_size),
            )

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor)
        return tensor

    def gather_objects(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        import torch.distributed as dist

        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def broadcast_from_rank_zero(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, 0)

    def background_ranks(self) -> GroupRanks:
        """These ranks over a gloo process group of their own (every rank calls it, once, at the same point): for
        the collectives of a sharded checkpoint committed on a writer thread while training runs its own."""
        import torch.distributed as dist

        return GroupRanks(dist.new_group(backend="gloo"), self.rank, self.world_size)

    def teardown(self, finished: bool = True) -> None:
        """`finished`: every rank got here normally, so they first wait for each other (rank 0 may still be
        finishing a checkpoint save); a rank that tears down while another still uses the group can abort in
        gloo. After an error the others may be gone: no barrier, which would hang."""
        import torch.distributed as dist

        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


class GroupRanks:
    """The ranks of one process group, with the object collectives a checkpoint's commit needs."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    def gather_objects(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        import torch.distributed as dist

        holder = [obj]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]


def _elastic_attempt_store(timeout: datetime.timedelta, world_size: int) -> Optional[Any]:
    """Where a store is served for the workers (torchrun's agent, or the run's spawning parent), the store for this
    attempt only; None: init_process_group's own (env://).

    torchrun's agent keeps one TCPStore for the whole job and its workers join it (TORCHELASTIC_USE_AGENT_STORE)
    without a per-attempt prefix. After a restart, a new rank 1 could read the key the killed rank 0 had published
    and connect to a dead address: gloo's full-mesh connect failed or hung (pytorch/pytorch#135712). Keys under
    `attempt-<restart count>` keep the attempts apart. The count is the agent's own, the same for every worker of
    a single-node job; across nodes it is not (each agent counts its own restarts), so there torch's workaround,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt), is what the docs recommend."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"framework/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)

"""A cluster job's tasks as the ranks of one run: torch's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR
and MASTER_PORT, derived from the environment the cluster gave each task, for a job of more than one task started
without torchrun (which sets them itself):

- under submitit (`SUBMITIT_EXECUTOR`: Hydra's submitit launcher, local or SLURM), from submitit's own
  `submitit.helpers.TorchDistributedEnvironment` (master: the job's first host, port drawn from the job id);
- under a plain `srun` (SLURM_NTASKS, SLURM_PROCID; not an interactive allocation's shell), as Lightning's
  SLURMEnvironment derives them: master the first host of SLURM_NODELIST, port 15000 + the job id's last 4 digits.

An existing MASTER_PORT wins in both. No torch here: the command line calls it before Hydra starts."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

# SLURM job names of an interactive allocation (salloc, srun --pty bash): runs started there by hand are no job's,
# and their SLURM_* variables describe the allocation, not the tasks of a run.
INTERACTIVE_JOB_NAMES = ("bash", "sh", "zsh", "interactive")
RANKS_FROM_ENV = "HTF_RANKS_FROM"  # set beside torch's variables: which launcher's tasks the ranks are
TORCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ClusterRanks:
    """This task's place in its job, and which launcher said so (`submitit-local`, `submitit-slurm`, `slurm`)."""

    source: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    def torch_env(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, by Lightning's rule: `host[5-9]` -> host5, `a[01-02],b` -> a01."""
    nodes = re.sub(r"\[(.*?)[,-].*\]", "\\1", nodelist)  # the first node of every range
    nodes = re.sub(r"\[(.*?)\]", "\\1", nodes)  # a range of one number
    return nodes.split(" ")[0].split(",")[0]


def slurm_port(job_id: str) -> int:
    """Lightning's MASTER_PORT for a SLURM job: 15000 + the job id's last 4 digits, the same on every task."""
    return 15000 + int(job_id[-4:])


def _slurm_ranks(env: Mapping[str, str]) -> Optional[ClusterRanks]:
    if "SLURM_NTASKS" not in env or "SLURM_PROCID" not in env:
        return None
    if env.get("SLURM_JOB_NAME", "") in INTERACTIVE_JOB_NAMES:
        return None
    world = int(env["SLURM_NTASKS"])
    # SLURM_NTASKS_PER_NODE is `4` or, for uneven nodes, `4(x2),3`: this node's count is SLURM_TASKS_PER_NODE's
    # entry for it; with neither, the tasks over the nodes.
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    local_world = int(per_node) if per_node and per_node.isdigit() else max(1, world // nodes)
    job_id = env.get("SLURM_JOB_ID", "")
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else slurm_port(job_id) if job_id.isdigit() else 12910
    nodelist = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    return ClusterRanks(
        "slurm",
        int(env["SLURM_PROCID"]),
        int(env.get("SLURM_LOCALID", env["SLURM_PROCID"])),
        world,
        local_world,
        first_host(nodelist),
        port,
    )


def _submitit_ranks(executor: str) -> ClusterRanks:
    """submitit's own account of this task (its public helper), which reads MASTER_PORT where it is set."""
    from submitit.helpers import TorchDistributedEnvironment  # the [sweeps] extra, present wherever it launched us

    job = TorchDistributedEnvironment()
    return ClusterRanks(
        f"submitit-{executor}",
        job.rank,
        job.local_rank,
        job.world_size,
        job.local_world_size,
        job.master_addr,
        job.master_port,
    )


def cluster_environment(env: Mapping[str, str] = os.environ) -> Optional[ClusterRanks]:
    """This task's ranks where a cluster job of more than one task started it without torchrun; None otherwise (a
    job of one task, torchrun's workers, a process of its own)."""
    if "RANK" in env:  # torchrun, or the run's own spawn: the ranks are set
        return None
    executor = env.get("SUBMITIT_EXECUTOR")
    ranks = _submitit_ranks(executor) if executor else _slurm_ranks(env)
    return ranks if ranks is not None and ranks.world_size > 1 else None


def export_cluster_environment() -> Optional[ClusterRanks]:
    """Set torch's variables in this process from `cluster_environment` (and RANKS_FROM_ENV to its source), so that
    the run joins its job's process group as under torchrun; the ranks, or None where nothing was set."""
    ranks = cluster_environment()
    if ranks is not None:
        os.environ.update(ranks.torch_env())
        os.environ[RANKS_FROM_ENV] = ranks.source
    return ranks


def tasks_as_ranks() -> Optional[tuple[str, int]]:
    """(the launcher, the number of tasks) where this process's ranks are its cluster job's tasks; else None."""
    source = os.environ.get(RANKS_FROM_ENV)
    return (source, int(os.environ["WORLD_SIZE"])) if source and "WORLD_SIZE" in os.environ else None

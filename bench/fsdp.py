"""parallel=fsdp against parallel=ddp on 2 CPU processes (gloo): memory per rank, time per step, and the loss curve.

    python bench/fsdp.py                     # every part
    python bench/fsdp.py --part memory       # per-rank bytes of parameters, gradients, Adam state; step time
    python bench/fsdp.py --part curve        # train/loss of fsdp, ddp and one process on the same global batch
    python bench/fsdp.py --part init         # peak host RSS per rank of building a 202 M model, meta init or not
    python bench/fsdp.py --part save         # how long a sharded checkpoint save blocks training, inline or not

init: TransformerLM at width 1024, 16 layers (202 M parameters, 771 MiB in fp32) built, sharded with
`FSDPStrategy.wrap` and initialised in 2 spawned processes, whole on each rank (parallel.meta_init=false) or on the
meta device with each rank materialising its own shards (framework/parallel/meta_init.py); then one step (batch of 1
window, AdamW). Each rank's peak resident memory (VmHWM, reset through /proc/self/clear_refs just before the build)
above its resident memory then, up to the first step and through it, after the same run on a tiny model (so that
the library code it runs is already resident); the shards' sums show the weights equal.

save: the memory part's 57.1 M model and its AdamW state after a step, saved by `CheckpointManager` (every rank its
own shards, rank 0 meta.json last) after each of `--saves` steps, inline (checkpoint.async_save=false) and in the
background, alternating in two rounds: the time `save` blocks the caller on each rank, and in the background the
time until the checkpoint is committed (waited for outside the timed part, so a save never waits for the last).

memory (and time): experiments/lm.py's TransformerLM at width 768, 8 layers (57.1 M parameters), wrapped by the
framework's own strategies (`DDPStrategy.wrap`, `FSDPStrategy.wrap` with each TransformerEncoderLayer a shard
unit) in 2 spawned processes, AdamW. After the warm-up steps, each rank counts the bytes of what it holds:
its parameters (FSDP: its shards, `DTensor.to_local()`), their gradients (after backward, before zero_grad) and
the optimizer's state, and reports its resident memory at the end (RSS: before and after glibc's malloc_trim,
which returns to the system what the allocator kept of freed memory: FSDP allocates and frees a unit's gathered
weights and gradients many times per step) and at its peak (ru_maxrss), each with the process's libraries
(~0.5 GiB), the peak also with the whole model built once before it is sharded.
Time: median wall time of the timed steps on rank 0 (forward, backward, clip, step, zero_grad; batch of 4
windows of 64 bytes per rank), 1 thread per process.

curve: `experiment=lm` through the real Trainer for `--curve-steps` steps: one process with batch 32 against ddp
and fsdp with 16 per process (the same 32 windows per step: the sampler gives rank r every other one of them);
val/loss over the whole validation split (reduced over the ranks) every 20 steps, and train/loss every 10 (under
ddp and fsdp that is rank 0's own half of the batch, so it differs from the single process's by sampling noise),
read from TensorBoard. The largest val/loss difference from the single process is reported against a stated
tolerance. Nothing here is asserted by the test suite.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/fsdp.py` from anywhere
    sys.path.insert(0, str(ROOT))

WORLD_SIZE = 2
BIG = {"block_size": 64, "d_model": 768, "num_layers": 8, "num_heads": 12, "ff_mult": 4}
TOLERANCE = 1e-4  # largest |val/loss difference| from the single process accepted, over the whole curve


def _environ(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _memory_worker(rank: int, strategy_name: str, port: int, warmup: int, steps: int, batch: int, out: str) -> None:
    _environ(rank, port)
    from omegaconf import OmegaConf

    from experiments.lm import TransformerLM
    from framework.parallel.strategy import DDPStrategy, FSDPStrategy

    cfg = OmegaConf.create({"find_unused_parameters": False, "static_graph": False, "backend": None, "timeout_s": 600,
                            "shard_modules": ["torch.nn.TransformerEncoderLayer"], "reshard_after_forward": True,
                            "cpu_offload": False})
    strategy = (FSDPStrategy if strategy_name == "fsdp" else DDPStrategy)(cfg, "cpu")
    torch.manual_seed(0)
    model = strategy.wrap(TransformerLM(**BIG))
    module = strategy.unwrap(model)
    params = [p for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    windows = torch.randint(0, 256, (batch, BIG["block_size"] + 1), generator=generator)
    seconds, grad_bytes = [], 0
    for step in range(warmup + steps):
        start = time.perf_counter()
        logits = model(windows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        grad_bytes = _local_bytes(p.grad for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
    state = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    report = {"rank": rank, "parameters": sum(p.numel() for p in params), "param_bytes": _local_bytes(params),
              "grad_bytes": grad_bytes, "optimizer_bytes": _local_bytes(state), "step_s": seconds,
              "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_mb": _rss_mb()}
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    report["trimmed_rss_mb"] = _rss_mb()
    reports = strategy.gather_objects(report)
    if rank == 0:
        Path(out).write_text(json.dumps(reports))
    strategy.teardown()


INIT = {"block_size": 64, "d_model": 1024, "num_layers": 16, "num_heads": 16, "ff_mult": 4}  # 202 M parameters


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _init_worker(rank: int, meta: bool, port: int, out: str) -> None:
    """Peak host RSS of building, sharding and initialising the model, then through its first step."""
    _environ(rank, port)
    from omegaconf import OmegaConf

    from framework.parallel.strategy import FSDPStrategy

    cfg = OmegaConf.create({"find_unused_parameters": False, "static_graph": False, "backend": None, "timeout_s": 600,
                            "shard_modules": ["torch.nn.TransformerEncoderLayer"], "reshard_after_forward": True,
                            "cpu_offload": False})
    strategy = FSDPStrategy(cfg, "cpu")
    # The same, on a tiny model first: the code it runs is paged in (libtorch's pages count in RSS) before the count.
    _build_and_step(strategy, {**INIT, "d_model": 32, "num_layers": 1, "num_heads": 1}, meta, rank)
    strategy.gather_objects(None)  # both ranks start from here
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    report = _build_and_step(strategy, INIT, meta, rank, _status_kb("VmRSS"))
    reports = strategy.gather_objects(report)
    if rank == 0:
        Path(out).write_text(json.dumps(reports))
    strategy.teardown()


def _build_and_step(strategy: Any, size: dict[str, int], meta: bool, rank: int, base_kb: int = 0) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from experiments.lm import TransformerLM
    from framework.parallel import meta_init

    start = time.perf_counter()
    torch.manual_seed(0)
    builder = meta_init.Builder(strategy) if meta else None
    model = builder.build(lambda: TransformerLM(**size)) if builder else TransformerLM(**size)
    parameters = sum(p.numel() for p in model.parameters())
    model = strategy.wrap(model)
    if builder:
        builder.materialise(model, OmegaConf.create({"init_from": None}))
    built_s = time.perf_counter() - start
    built_kb = _status_kb("VmHWM") - base_kb
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    windows = torch.randint(0, 256, (1, size["block_size"] + 1), generator=torch.Generator().manual_seed(rank))
    logits = model(windows[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).backward()
    optimizer.step()
    step_kb = _status_kb("VmHWM") - base_kb
    checksum = float(sum(p.detach().to_local().double().sum() for p in model.parameters()))
    return {"rank": rank, "parameters": parameters, "built_mb": built_kb / 1024, "step_mb": step_kb / 1024,
            "built_s": built_s, "checksum": checksum}


class _Snapshot:
    """What the trainer's TrainingState.collect gives a checkpoint: the model's and the optimizer's state."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer, self.step = model, optimizer, 0

    def collect(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        return self.model.state_dict(), {"optimizer": self.optimizer.state_dict()}, {"step": self.step}


def _save_worker(rank: int, port: int, saves: int, folder: str, out: str) -> None:
    """How long a sharded save blocks training, inline and in the background (then, apart, how long it takes)."""
    _environ(rank, port)
    from omegaconf import OmegaConf

    from experiments.lm import TransformerLM
    from framework.checkpoint import CheckpointManager
    from framework.parallel.strategy import FSDPStrategy

    cfg = OmegaConf.create({"find_unused_parameters": False, "static_graph": False, "backend": None, "timeout_s": 600,
                            "shard_modules": ["torch.nn.TransformerEncoderLayer"], "reshard_after_forward": True,
                            "cpu_offload": False})
    strategy = FSDPStrategy(cfg, "cpu")
    torch.manual_seed(0)
    model = strategy.wrap(TransformerLM(**BIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    windows = torch.randint(0, 256, (2, BIG["block_size"] + 1), generator=torch.Generator().manual_seed(rank))
    snapshot = _Snapshot(model, optimizer)
    report: dict[str, Any] = {"rank": rank}
    for async_save in (False, True, False, True):  # alternating: load on the machine falls on both alike
        manager = CheckpointManager(Path(folder) / f"r{async_save}", every_n_steps=1, keep_last=1,
                                    enabled=rank == 0, async_save=async_save, shards=strategy)
        for _ in range(saves):
            logits = model(windows[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            snapshot.step += 1
            start = time.perf_counter()
            manager.save(snapshot, snapshot.step, periodic=True)
            blocked = time.perf_counter() - start
            manager.writer.wait()  # (not timed: the next save must not wait for this one)
            report.setdefault(f"blocked_{async_save}", []).append(blocked)
            report.setdefault(f"done_{async_save}", []).append(time.perf_counter() - start)
        manager.writer.close()
    report["state_mb"] = _local_bytes([*model.parameters(), *[v for e in optimizer.state.values()
                                                              for v in e.values() if v.dim()]]) / 2**20
    reports = strategy.gather_objects(report)
    if rank == 0:
        Path(out).write_text(json.dumps(reports))
    strategy.teardown()


def measure_save(saves: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from framework.app.launch import free_port

    with tempfile.TemporaryDirectory(prefix="bench-fsdp-save-") as folder, \
            tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.start_processes(_save_worker, args=(free_port(), saves, folder, out.name), nprocs=WORLD_SIZE,
                           start_method="spawn")
        return json.loads(Path(out.name).read_text())


def report_save(reports: list[dict[str, Any]]) -> None:
    print(f"\nsharded checkpoint saves, TransformerLM {BIG} + AdamW state ({reports[0]['state_mb']:.0f} MiB per rank), "
          "2 processes, fsync on; medians over the saves, in ms:")
    print(f"{'rank':>4} {'inline: blocked':>16} {'background: blocked':>20} {'background: until on disk':>26} "
          f"{'blocked / inline':>17}")
    worst = 0.0
    for r in reports:
        inline, blocked = statistics.median(r["blocked_False"]), statistics.median(r["blocked_True"])
        worst = max(worst, blocked / inline)
        print(f"{r['rank']:>4} {1000 * inline:>16.0f} {1000 * blocked:>20.0f} "
              f"{1000 * statistics.median(r['done_True']):>26.0f} {blocked / inline:>17.2f}")
    print(f"the loop is blocked for {worst:.2f}x an inline sharded save (target <= 0.3: "
          f"{'met' if worst <= 0.3 else 'NOT met'})")


def measure_init() -> dict[str, list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    from framework.app.launch import free_port

    results = {}
    for name, meta in (("whole", False), ("meta", True)):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            mp.start_processes(_init_worker, args=(meta, free_port(), out.name), nprocs=WORLD_SIZE,
                               start_method="spawn")
            results[name] = json.loads(Path(out.name).read_text())
    return results


def report_init(results: dict[str, list[dict[str, Any]]]) -> None:
    parameters = results["whole"][0]["parameters"]
    model_mb = parameters * 4 / 2**20
    print(f"\ninitialisation under fsdp, TransformerLM {INIT} ({parameters / 1e6:.1f} M parameters, "
          f"{model_mb:.0f} MiB in fp32), 2 processes; peak host RSS per rank above the process's before the build:")
    print(f"{'parallel.meta_init':<19} {'rank':>4} {'to the 1st step MiB':>20} {'x model':>8} "
          f"{'through it (AdamW) MiB':>23} {'build s':>8}")
    for name, reports in results.items():
        for r in reports:
            print(f"{'true' if name == 'meta' else 'false':<19} {r['rank']:>4} {r['built_mb']:>20.0f} "
                  f"{r['built_mb'] / model_mb:>8.2f} {r['step_mb']:>23.0f} {r['built_s']:>8.1f}")
    worst = max(r["built_mb"] for r in results["meta"]) / model_mb
    print(f"meta init: peak per rank up to the first step {worst:.2f}x the whole model's bytes (target <= 0.6: "
          f"{'met' if worst <= 0.6 else 'NOT met'})")
    same = [a["checksum"] == b["checksum"] for a, b in zip(results["whole"], results["meta"])]
    print(f"the same weights after the first step with and without it (each rank's shard sums): {all(same)}")


def measure_memory(warmup: int, steps: int, batch: int) -> dict[str, list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    from framework.app.launch import free_port

    results = {}
    for name in ("ddp", "fsdp"):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            mp.start_processes(_memory_worker, args=(name, free_port(), warmup, steps, batch, out.name),
                               nprocs=WORLD_SIZE, start_method="spawn")
            results[name] = json.loads(Path(out.name).read_text())
    return results


def report_memory(results: dict[str, list[dict[str, Any]]]) -> None:
    mib = 2**20
    print(f"\nmemory per rank, TransformerLM {BIG} ({results['ddp'][0]['parameters'] / 1e6:.1f} M parameters), "
          "AdamW, 2 processes:")
    print(f"{'':8} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'Adam MiB':>9} {'total MiB':>10} "
          f"{'RSS MiB':>8} {'trimmed':>8} {'peak RSS MiB':>13} {'step ms (median)':>17}")
    totals = {}
    for name, reports in results.items():
        for r in reports:
            total = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
            totals.setdefault(name, []).append(total)
            step = f"{1000 * statistics.median(r['step_s']):.0f}" if r["rank"] == 0 else ""
            print(f"{name:8} {r['rank']:>4} {r['param_bytes'] / mib:>11.1f} {r['grad_bytes'] / mib:>10.1f} "
                  f"{r['optimizer_bytes'] / mib:>9.1f} {total / mib:>10.1f} {r['rss_mb']:>8.0f} "
                  f"{r['trimmed_rss_mb']:>8.0f} {r['max_rss_mb']:>13.0f} {step:>17}")
    ratio = max(totals["fsdp"]) / max(totals["ddp"])
    print(f"fsdp / ddp, parameters + gradients + Adam state per rank: {ratio:.3f} (target <= 0.55: "
          f"{'met' if ratio <= 0.55 else 'NOT met'})")
    times = {name: statistics.median(reports[0]["step_s"]) for name, reports in results.items()}
    samples = {name: [round(1000 * s) for s in reports[0]["step_s"]] for name, reports in results.items()}
    print(f"step time fsdp / ddp: {times['fsdp'] / times['ddp']:.2f} ({1000 * times['fsdp']:.0f} vs "
          f"{1000 * times['ddp']:.0f} ms; rank 0's steps in ms: fsdp {samples['fsdp']}, ddp {samples['ddp']})")


def compose_lm(*overrides: str) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    import framework.app.main
    import framework.config.schema

    framework.config.schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=lm", "logger.progress_bar=false",
                                                         "checkpoint=none", *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    framework.app.main.resolve_all(cfg)
    framework.config.validate.validate(cfg)
    OmegaConf.resolve(cfg)
    return cfg


def _curve_worker(rank: int, cfg: Any, port: int, run_dir: str) -> None:
    _environ(rank, port)
    from framework.loop.trainer import Trainer

    Trainer(cfg, Path(run_dir)).fit()


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in ("train/loss", "val/loss")}


def measure_curves(steps: int) -> dict[str, dict[str, list[tuple[int, float]]]]:
    import torch.multiprocessing as mp

    from framework.app.launch import free_port
    from framework.loop.trainer import Trainer

    common = (f"trainer.max_steps={steps}", "trainer.log_every_n_steps=10", "trainer.val_every_n_steps=20",
              "trainer.limit_val_batches=1.0", "trainer.device=cpu")
    curves = {}
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        torch.set_num_threads(1)
        single = Path(tmp) / "single"
        Trainer(compose_lm("data.batch_size=32", *common), single).fit()
        curves["single"] = scalars(single)
        for name in ("ddp", "fsdp"):
            run_dir = Path(tmp) / name
            cfg = compose_lm(f"parallel={name}", "data.batch_size=16", *common)
            mp.start_processes(_curve_worker, args=(cfg, free_port(), str(run_dir)), nprocs=WORLD_SIZE,
                               start_method="spawn")
            curves[name] = scalars(run_dir)
    return curves


def report_curves(curves: dict[str, dict[str, list[tuple[int, float]]]]) -> None:
    for tag, what in (("val/loss", "over the whole validation split, every rank's"),
                      ("train/loss", "mean of the 10 steps before; rank 0's half-batch under ddp and fsdp")):
        print(f"\n{tag} ({what}), experiment=lm, global batch 32:")
        print(f"{'step':>5} " + " ".join(f"{name:>10}" for name in curves))
        for i, (step, _) in enumerate(curves["single"][tag]):
            print(f"{step:>5} " + " ".join(f"{curves[name][tag][i][1]:>10.5f}" for name in curves))
    for name in ("ddp", "fsdp"):
        worst = max(abs(a - b) for (_, a), (_, b) in zip(curves[name]["val/loss"], curves["single"]["val/loss"]))
        print(f"val/loss, {name} vs single: max |difference| {worst:.2e} (tolerance {TOLERANCE:g}: "
              f"{'within' if worst <= TOLERANCE else 'OUTSIDE'})")
    for tag in ("val/loss", "train/loss"):
        worst = max(abs(a - b) for (_, a), (_, b) in zip(curves["fsdp"][tag], curves["ddp"][tag]))
        print(f"{tag}, fsdp vs ddp: max |difference| {worst:.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("memory", "curve", "init", "save", "all"), default="all")
    parser.add_argument("--saves", type=int, default=3, help="saves of each kind per round (2 rounds) in `save`")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of the memory part")
    parser.add_argument("--batch", type=int, default=4, help="windows per rank in the memory part")
    parser.add_argument("--curve-steps", type=int, default=100)
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    if args.part in ("memory", "all"):
        report_memory(measure_memory(args.warmup, args.steps, args.batch))
    if args.part in ("curve", "all"):
        report_curves(measure_curves(args.curve_steps))
    if args.part in ("init", "all"):
        report_init(measure_init())
    if args.part in ("save", "all"):
        report_save(measure_save(args.saves))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

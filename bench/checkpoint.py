"""Checkpoint save and load through the framework against plain safetensors, on a ResNet-50-sized state.

    python bench/checkpoint.py                # 5 alternating repetitions in a temporary folder
    python bench/checkpoint.py --dir /scratch --reps 9

The state is torchvision's ResNet-50 (25.6 M parameters, random weights) and its SGD momentum buffers after
one step: about 205 MB of tensors. Contenders, alternating within each repetition:
- framework: `framework.checkpoint.write_checkpoint` (model.safetensors + state.safetensors + meta.json in
  NAME.tmp/, XXH3 checksums of both files, fsync unless --no-fsync, atomic rename) and
  `open_checkpoint(...).model_state()/.state()` (the checksums verified, the optimizer state rebuilt);
- plain:     `safetensors.torch.save_file(model)` + `save_file(momentum)` and `load_file` of both, which
  neither checks, nor flushes to disk, nor survives a crash half-way.
Loads read files the save just wrote, so both usually come from the page cache; both map the files
(safetensors' load_file), so a plain load reads only what is later touched, while the framework's reads
every byte once to verify the checksums. `restore` is what a resume does with a load: the weights and the
momentum put into another ResNet-50 and its SGD (`load_state_dict`). The weights are copied either way; the
framework also copies the momentum out of its file (so no file stays mapped for the run), while the plain
restore leaves it mapped and reads it only when training touches it. The target (the
performance issue) is framework / plain <= 1.2 for save and for load.
"""
from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from framework.checkpoint import open_checkpoint, write_checkpoint  # noqa: E402

TARGET = 1.2


def resnet50() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """ResNet-50 and SGD with a momentum buffer per parameter (after one step)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def momentum_tensors(optimizer_state: dict) -> dict[str, torch.Tensor]:
    return {f"state/{i}/momentum_buffer": s["momentum_buffer"] for i, s in optimizer_state["state"].items()}


def clock(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


OPS = ("save", "load", "restore")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--no-fsync", action="store_true",
                        help="as checkpoint.fsync=false: no flush to disk (the plain contender never flushes)")
    args = parser.parse_args(argv)

    model, optimizer = resnet50()
    model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    momentum = momentum_tensors(optimizer_state)
    size_mb = sum(t.numel() * t.element_size() for t in [*model_state.values(), *momentum.values()]) / 2**20
    params = sum(t.numel() for t in model_state.values() if t.is_floating_point())
    base = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    print(f"ResNet-50 state: {params / 1e6:.1f} M model values + momentum, {size_mb:.0f} MB; writing under {base}; "
          f"framework {'without' if args.no_fsync else 'with'} fsync")

    def framework_save() -> None:
        write_checkpoint(base / "framework", model_state, {"optimizer": optimizer_state}, {"step": 1, "config": {}},
                         durable=not args.no_fsync)

    def framework_load() -> tuple[dict, dict]:
        checkpoint = open_checkpoint(base / "framework")
        return checkpoint.model_state(), checkpoint.state()["optimizer"]

    def plain_save() -> None:
        (base / "plain").mkdir(exist_ok=True)
        for name in ("model.safetensors", "state.safetensors"):  # a new file, never one a restore still maps
            (base / "plain" / name).unlink(missing_ok=True)
        save_file(model_state, str(base / "plain" / "model.safetensors"))
        save_file(momentum, str(base / "plain" / "state.safetensors"))

    def plain_load() -> tuple[dict, dict]:
        weights = load_file(str(base / "plain" / "model.safetensors"))
        buffers = load_file(str(base / "plain" / "state.safetensors"))
        state = {i: {"momentum_buffer": buffers[f"state/{i}/momentum_buffer"]} for i in optimizer_state["state"]}
        return weights, {"state": state, "param_groups": optimizer_state["param_groups"]}

    target_model, target_optimizer = resnet50()  # restored into: the saved state itself is never changed

    def restore(load):
        def run() -> None:
            weights, opt_state = load()
            target_model.load_state_dict(weights)
            target_optimizer.load_state_dict(opt_state)
        return run

    contenders = {"framework": {"save": framework_save, "load": framework_load, "restore": restore(framework_load)},
                  "plain": {"save": plain_save, "load": plain_load, "restore": restore(plain_load)}}
    times: dict[str, dict[str, list[float]]] = {name: {op: [] for op in OPS} for name in contenders}
    try:
        for ops in contenders.values():  # warm-up: first-touch allocations, page cache
            for op in OPS:
                ops[op]()
        for rep in range(args.reps):
            order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
            for name in order:
                for op in OPS:
                    times[name][op].append(clock(contenders[name][op]))
            print(f"  rep {rep + 1}/{args.reps}: " + "; ".join(
                f"{name} " + ", ".join(f"{op} {times[name][op][-1]:.3f} s" for op in OPS) for name in order))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    ratios = {}
    print(f"\n{'median of ' + str(args.reps):16s} {'framework':>10s} {'plain':>10s} {'ratio':>7s}  target")
    for op in OPS:
        per_rep = [f / p for f, p in zip(times["framework"][op], times["plain"][op])]
        ratios[op] = statistics.median(per_rep)
        verdict = f"<= {TARGET}: {'PASS' if ratios[op] <= TARGET else 'FAIL'}" if op != "restore" else "(no target)"
        print(f"{op:16s} {statistics.median(times['framework'][op]):9.3f}s {statistics.median(times['plain'][op]):9.3f}s "
              f"{ratios[op]:7.3f}  {verdict}")
    return ratios


if __name__ == "__main__":
    main()

"""Start-up of `python run.py`: the time from the end of `import torch` to the first optimizer step; and, with
`--whole`, a whole process as a user waits for it.

    python bench/startup.py                 # 5 fresh processes of each kind, default run
    python bench/startup.py --reps 9 model=cnn
    python bench/startup.py --whole         # command to exit: experiment=bench, 300 steps, vs the hand-written loop

Each repetition starts three fresh Python processes, in a rotating order:
- `run`:         `run.py` with the given overrides (default: none, i.e. the default experiment); a global
                 optimizer step pre-hook (torch's own `register_optimizer_step_pre_hook`) notes the time of the
                 first step and ends the process there;
- `handwritten`: what a careful user writes for the default experiment: scikit-learn's digits file read as
                 tensors (as the framework reads it, without importing sklearn), a
                 DataLoader, the same MLP, SGD, a TensorBoard SummaryWriter, then the first batch's forward,
                 backward and step (timed the same way);
- `torch`:       the floor any PyTorch program pays after `import torch` before it can step: constructing its
                 first `torch.optim` optimizer, which imports `torch._dynamo` (torch.optim decorates
                 `add_param_group` with `torch._disable_dynamo`, whose first call imports it).
Every process times its own import of `torch._dynamo` (a meta-path hook around that module's execution,
wherever it happens): both programs pay it alike, in their first optimizer, and it is most of what any of them
spends after `import torch`. The target (issue 28) is the last line: run.py's time from `import torch` to its
first step, minus the hand-written loop's, at most 0.8 s, with the framework's dependencies as they ship (no
patch). Medians over repetitions (of per-repetition differences, the pair having run side by side) are printed.

The project's modules are byte-compiled first (`python -m compileall framework experiments`, what `make run`
does and what pip does for an installed package): measured is a start as users have it, not Python compiling
the framework's source, which only a first start pays, or every start where PYTHONDONTWRITEBYTECODE is set
and nothing compiled them (~0.07 s here; `--source` measures that).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import importlib.util
DYNAMO = [0.0]

class TimeDynamoImport:  # this process's own import of torch._dynamo, wherever it happens (the first optimizer)
    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            start = time.perf_counter()
            try:
                execute(module)
            finally:
                DYNAMO[0] += time.perf_counter() - start
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, TimeDynamoImport())

def report():
    print("STARTUP " + json.dumps({"import_torch": t1 - t0, "startup": time.perf_counter() - t1,
                                   "dynamo": DYNAMO[0]}), flush=True)
"""

RUN = PRELUDE + r"""
import runpy
from torch.optim.optimizer import register_optimizer_step_pre_hook

def first_step(optimizer, args, kwargs):
    report()
    os._exit(0)

register_optimizer_step_pre_hook(first_step)
sys.argv = ["run.py", *sys.argv[1:]]
sys.path.insert(0, os.getcwd())
runpy.run_path("run.py", run_name="__main__")
"""

HANDWRITTEN = PRELUDE + r"""
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter
import importlib.util, pathlib
import numpy as np

def first_step(optimizer, args, kwargs):
    report()
    os._exit(0)

register_optimizer_step_pre_hook(first_step)
torch.manual_seed(42)
# The file sklearn's load_digits reads, read directly as the framework does (importing sklearn costs ~1 s).
csv = pathlib.Path(importlib.util.find_spec("sklearn").origin).parent / "datasets" / "data" / "digits.csv.gz"
table = np.loadtxt(csv, delimiter=",", dtype=np.float32)
images = torch.from_numpy(table[:, :-1]).reshape(-1, 1, 8, 8) / 16.0
loader = DataLoader(TensorDataset(images, torch.from_numpy(table[:, -1].astype(np.int64))), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
writer = SummaryWriter(sys.argv[1])
for xb, yb in loader:
    loss = nn.functional.cross_entropy(model(xb), yb)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

TORCH = PRELUDE + r"""
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
report()
"""


# --whole: the hand-written loop of bench/handwritten.py (a DataLoader over the experiment=bench data, the same MLP and
# SGD, TensorBoard's train/loss every 50 steps) for as many steps as run.py trains, as a program a user runs.
HANDWRITTEN_WHOLE = r"""
import sys
sys.path.insert(0, "bench")
import handwritten
handwritten.dataloader_loop(int(sys.argv[1]), sys.argv[2])
"""


def whole(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds from the command to its exit (what a user waits for): `python run.py experiment=bench
    trainer.max_steps=N` against the hand-written loop doing the same N steps, alternated, each a fresh process."""
    times: dict[str, list[float]] = {"run": [], "handwritten": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for rep in range(args.reps):
            commands = {
                "run": [sys.executable, "run.py", "experiment=bench", f"trainer.max_steps={args.steps}",
                        f"hydra.run.dir={Path(tmp) / f'run{rep}'}", *args.overrides],
                "handwritten": [sys.executable, "-c", HANDWRITTEN_WHOLE, str(args.steps), str(Path(tmp) / f"hw{rep}")],
            }
            for kind in (("run", "handwritten") if rep % 2 == 0 else ("handwritten", "run")):
                start = time.perf_counter()
                done = subprocess.run(commands[kind], cwd=ROOT, capture_output=True, text=True, timeout=600)
                times[kind].append(time.perf_counter() - start)
                if done.returncode != 0:
                    sys.exit(f"{kind} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            print(f"  rep {rep + 1}/{args.reps}: run.py {times['run'][-1]:.2f} s, hand-written "
                  f"{times['handwritten'][-1]:.2f} s")
    gap = statistics.median(r - h for r, h in zip(times["run"], times["handwritten"]))
    print(f"\nmedian of {args.reps}, command to exit, {args.steps} steps of experiment=bench:")
    print(f"  python run.py     {statistics.median(times['run']):6.2f} s")
    print(f"  hand-written loop {statistics.median(times['handwritten']):6.2f} s")
    print(f"  run.py minus hand-written (per repetition, then the median) {gap:6.2f} s   (target: <= 0.80)")
    return times


def measure(code: str, args: list[str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("STARTUP ")]
    if not lines:
        sys.exit(f"the measured process ended without reaching a first step (exit {proc.returncode}):\n"
                 f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("STARTUP "):])


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="fresh processes of each kind (default 5)")
    parser.add_argument("--source", action="store_true",
                        help="do not byte-compile the project first (with PYTHONDONTWRITEBYTECODE set, every "
                             "start then compiles its modules)")
    parser.add_argument("--whole", action="store_true",
                        help="time the whole process, command to exit, of experiment=bench against the hand-written "
                             "loop doing the same steps (--steps)")
    parser.add_argument("--steps", type=int, default=300, help="with --whole: the steps each trains (default 300)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for run.py (default: none)")
    args = parser.parse_args(argv)
    if not args.source:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "framework", "experiments"], cwd=ROOT, check=True)
    if args.whole:
        return {kind: [{"seconds": t} for t in times] for kind, times in whole(args).items()}
    results: dict[str, list[dict[str, float]]] = {"run": [], "handwritten": [], "torch": []}
    kinds = list(results)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for rep in range(args.reps):
            run_args = [*args.overrides, f"hydra.run.dir={Path(tmp) / str(rep)}"]
            for kind in kinds[rep % 3:] + kinds[:rep % 3]:  # the order rotates: no kind always goes first
                code, code_args = {"run": (RUN, run_args), "handwritten": (HANDWRITTEN, [str(Path(tmp) / f"hw{rep}")]),
                                   "torch": (TORCH, [])}[kind]
                results[kind].append(measure(code, code_args))
            print(f"  rep {rep + 1}/{args.reps}: run.py {results['run'][-1]['startup']:.2f} s, hand-written "
                  f"{results['handwritten'][-1]['startup']:.2f} s, first torch optimizer "
                  f"{results['torch'][-1]['startup']:.2f} s after import torch")

    def median(kind: str, key: str = "startup") -> float:
        return statistics.median(r[key] for r in results[kind])

    def median_gap(a: str, b: str) -> float:  # per repetition (the pair ran side by side), then the median
        return statistics.median(x["startup"] - y["startup"] for x, y in zip(results[a], results[b]))

    print(f"\nmedian of {args.reps}, seconds   (python run.py {' '.join(args.overrides)})".rstrip())
    print(f"  import torch                                      {median('run', 'import_torch'):6.2f}")
    print(f"  import torch -> first step      run.py            {median('run'):6.2f}")
    print(f"                                  hand-written      {median('handwritten'):6.2f}   (digits, DataLoader, "
          "MLP, SGD, SummaryWriter)")
    print(f"                                  bare torch        {median('torch'):6.2f}   (its first optimizer only)")
    print(f"    of which its torch._dynamo import   run.py      {median('run', 'dynamo'):6.2f}   (the first "
          "torch.optim optimizer imports it)")
    print(f"                                        hand-written{median('handwritten', 'dynamo'):6.2f}")
    print(f"                                        bare torch  {median('torch', 'dynamo'):6.2f}")
    print(f"  run.py minus hand-written                         {median_gap('run', 'handwritten'):6.2f}   "
          "(target: <= 0.80)")
    return results


if __name__ == "__main__":
    main()

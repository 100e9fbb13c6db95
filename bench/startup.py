"""Start-up of `python run.py`: the time from the end of `import torch` to the first optimizer step.

    python bench/startup.py                 # 5 fresh processes of each kind, default run
    python bench/startup.py --reps 9 model=cnn

Each repetition starts two fresh Python processes, alternating:
- `run`:   `run.py` with the given overrides (default: none, i.e. the default experiment); a global
           optimizer step pre-hook (torch's own `register_optimizer_step_pre_hook`) notes the time of the
           first step and ends the process there;
- `torch`: the floor any PyTorch program pays after `import torch` before it can step: constructing its
           first `torch.optim` optimizer, which imports `torch._dynamo` (torch.optim decorates
           `add_param_group` with `torch._disable_dynamo`, whose first call imports it).
The framework's own start-up is the difference: Hydra composing the config, building the data, model,
optimizer and TensorBoard writer, printing the set-up, and the first batch's forward and backward (which the
`torch` floor does not run). Medians over repetitions are printed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN = r"""
import json, os, runpy, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from torch.optim.optimizer import register_optimizer_step_pre_hook

def first_step(optimizer, args, kwargs):
    print("STARTUP " + json.dumps({"import_torch": t1 - t0, "startup": time.perf_counter() - t1}), flush=True)
    os._exit(0)

register_optimizer_step_pre_hook(first_step)
sys.argv = ["run.py", *sys.argv[1:]]
sys.path.insert(0, os.getcwd())
runpy.run_path("run.py", run_name="__main__")
"""

TORCH = r"""
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
print("STARTUP " + json.dumps({"import_torch": t1 - t0, "startup": time.perf_counter() - t1}), flush=True)
"""


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
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for run.py (default: none)")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"run": [], "torch": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for rep in range(args.reps):
            run_args = [*args.overrides, f"hydra.run.dir={Path(tmp) / str(rep)}"]
            for kind in (("run", "torch") if rep % 2 == 0 else ("torch", "run")):
                results[kind].append(measure(RUN, run_args) if kind == "run" else measure(TORCH, []))
            print(f"  rep {rep + 1}/{args.reps}: run.py {results['run'][-1]['startup']:.2f} s, "
                  f"first torch optimizer {results['torch'][-1]['startup']:.2f} s after import torch")

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    run, floor = median("run", "startup"), median("torch", "startup")
    print(f"\nmedian of {args.reps}, seconds   (python run.py {' '.join(args.overrides)})".rstrip())
    print(f"  import torch                               {median('run', 'import_torch'):6.2f}")
    print(f"  import torch -> first step of run.py       {run:6.2f}")
    print(f"    of which torch's own first optimizer     {floor:6.2f}   (torch._dynamo import; any torch.optim user)")
    print(f"    of which the framework (Hydra included)  {run - floor:6.2f}")
    return results


if __name__ == "__main__":
    main()

"""`make gpu-check`: everything that needs CUDA, in one command, for the first machine that has it.

    python bench/gpu_check.py            # the CUDA tests, then the benchmarks
    python bench/gpu_check.py --tests    # the CUDA tests only

Without a CUDA device it says so in one line and exits 0. With one it runs, in order, stopping at nothing:
1. tests/test_cuda_paths.py and the CUDA tests of tests/test_precision.py: every precision (fp32, bf16, fp16 with
   its GradScaler) under single, dp, ddp and fsdp over the visible GPUs (dp runs as single, ddp and fsdp as one
   process, where there is one GPU), fsdp with cpu_offload, compile, a resume on fewer visible GPUs
   (CUDA_VISIBLE_DEVICES=0), an export run on CUDA, pinned memory with non-blocking copies and a CNN in
   channels_last;
2. bench/overhead.py --device cuda: the framework's time per step against the hand-written loops (and Lightning,
   when installed);
3. bench/realistic.py: ResNet-18 on PNGs against the hand-written loop and Lightning.
Exit status: 1 when the tests failed or a benchmark ended in error, else 0. The figures go in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

TESTS = [
    "tests/test_cuda_paths.py",
    "tests/test_precision.py",
    "tests/test_cuda_state.py",
]
BENCHMARKS = [
    ["bench/overhead.py", "--device", "cuda", "--reps", "3"],
    ["bench/realistic.py", "--reps", "1"],
]


def step(title: str, command: list[str]) -> bool:
    print(f"\n=== {title}: {' '.join(command)}", flush=True)
    return subprocess.run(command, cwd=ROOT).returncode == 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", action="store_true", help="the CUDA tests only, no benchmark")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); nothing to check")
        return 0
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, {len(gpus)} GPU(s): {', '.join(gpus)}")
    # -rs: every skip with its reason (a pair this machine cannot run says why); no -n: the GPUs are shared by
    # the runs, which start their own processes.
    ok = {"tests": step("CUDA tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TESTS])}
    if not args.tests:
        for command in BENCHMARKS:
            ok[command[0]] = step(command[0], [sys.executable, *command])
    failed = [name for name, passed in ok.items() if not passed]
    print(f"\ngpu-check: {'failed: ' + ', '.join(failed) if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Screenshots of TensorBoard's CUSTOM SCALARS, TIME SERIES and HPARAMS pages for a small sweep (for the docs).

    python tools/tensorboard_screenshot.py                         # runs a 3-job lr sweep in a temporary folder
    python tools/tensorboard_screenshot.py --logdir multirun/...   # existing runs instead; no sweep
    python tools/tensorboard_screenshot.py --out docs --budget-ms 20000

It starts the real `tensorboard` server on a free local port, waits until it has loaded the runs, takes a
headless Chromium screenshot of each page, stops the server and prints the PNG paths. Runs whose event files
hold no custom-scalars layout (written before the trainer wrote one) get framework.tensorboard_layout's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from framework.tensorboard_layout import layout  # noqa: E402

SWEEP = ("optimizer.lr=0.01,0.05,0.1", "trainer.max_epochs=3")
# name: (URL fragment, window size). HParams' table is wide: its metric columns come after every hparam.
PAGES = {"custom_scalars": ("#custom_scalars", "1400,1000"), "timeseries": ("#timeseries", "1400,1000"),
         "hparams": ("#hparams", "2000,700")}
LAYOUT_TAG = "custom_scalars__config__"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", type=Path, help="existing runs to show (default: run a small sweep)")
    parser.add_argument("--sweep-dir", type=Path, help="where the sweep writes its runs (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for the PNGs (default: docs/)")
    parser.add_argument("--monitor", action="append", default=None,
                        help="monitored metric for a layout this script writes (repeatable; default: val/acc)")
    parser.add_argument("--budget-ms", type=int, default=15000,
                        help="Chromium's virtual-time budget: how long each page may load before the shot")
    args = parser.parse_args()

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not found: apt-get install chromium", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="tb-screenshot-") as tmp:
        logdir = args.logdir or run_sweep(args.sweep_dir or Path(tmp) / "sweep")
        runs = add_missing_layouts(logdir, args.monitor or ["val/acc"])
        args.out.mkdir(parents=True, exist_ok=True)
        port, server_log = free_port(), Path(tmp) / "tensorboard.log"
        with open(server_log, "w") as log:  # a file, not a pipe: a full pipe would block the server
            server = subprocess.Popen([tensorboard_bin(), "--logdir", str(logdir), "--host", "127.0.0.1",
                                       "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_loaded(f"http://127.0.0.1:{port}", runs, server, server_log)
            paths = [screenshot(chromium, f"http://127.0.0.1:{port}/{fragment}", window,
                                args.out / f"tensorboard_{name}.png", args.budget_ms, Path(tmp))
                     for name, (fragment, window) in PAGES.items()]
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
    for path in paths:
        print(path)
    return 0


def run_sweep(sweep_dir: Path) -> Path:
    cmd = [sys.executable, "run.py", "-m", *SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    print("running:", " ".join(cmd), file=sys.stderr)
    # One intra-op thread: on a small CPU, torch's default thread count makes these tiny runs several times slower.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=ROOT, timeout=600, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the sweep failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return sweep_dir


def add_missing_layouts(logdir: Path, monitors: list[str]) -> int:
    """Give each run without a custom-scalars layout one, in an event file of its own in the run's folder.
    Returns how many runs there are."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    run_dirs = sorted({p.parent for p in logdir.rglob("events.out.tfevents.*")})
    for run_dir in run_dirs:
        accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 1})
        accumulator.Reload()
        if LAYOUT_TAG not in accumulator.Tags()["tensors"]:
            with SummaryWriter(log_dir=str(run_dir)) as writer:
                writer.add_custom_scalars(layout(monitors))
    return len(run_dirs)


def tensorboard_bin() -> str:
    beside_python = Path(sys.executable).parent / "tensorboard"
    return str(beside_python) if beside_python.exists() else "tensorboard"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_loaded(url: str, runs: int, server: subprocess.Popen, server_log: Path, timeout: float = 60) -> None:
    """Until the server has every run's scalars and a layout: it lists runs before it has read their event files."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"tensorboard exited with {server.returncode}: {server_log.read_text()[-2000:]}")
        try:
            tags = _get_json(f"{url}/data/plugin/scalars/tags")
            loaded = sum(1 for run_tags in tags.values() if run_tags) >= runs
            if loaded and _get_json(f"{url}/data/plugin/custom_scalars/layout"):
                return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet
        time.sleep(0.3)
    raise TimeoutError(f"tensorboard at {url} had not loaded {runs} runs within {timeout:.0f} s")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def screenshot(chromium: str, url: str, window: str, path: Path, budget_ms: int, tmp: Path) -> Path:
    # A fresh profile per shot: TensorBoard keeps UI settings in local storage, and a shared one is locked.
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp)
    subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                    f"--user-data-dir={profile}", f"--screenshot={path}", f"--window-size={window}",
                    f"--virtual-time-budget={budget_ms}", url],
                   check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


if __name__ == "__main__":
    sys.exit(main())

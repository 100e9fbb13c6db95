"""The console, as a person sees it: a terminal (driven through tmux) and a pipe or log file."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
from conftest import ROOT, output, run_cli

pytestmark = pytest.mark.e2e

EPOCH_LINE = re.compile(r"^epoch (\d)/2  step (\d+)  train/loss [\d.]+  val/loss [\d.]+  val/acc [\d.]+  "
                        r"[\d,]+ samples/s  ETA \d:\d\d:\d\d$")


def test_piped_output_is_one_informative_line_per_epoch_and_the_summary(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(run, "trainer.max_epochs=3", fast=False)
    assert proc.returncode == 0, output(proc)
    text = output(proc)
    assert "\r" not in text  # no carriage-return spam in a log file
    # The epoch lines are log records (stderr), the summary is the result (stdout): `2>&1` keeps their order.
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    # First the model summary (tests/test_model_summary.py reads its table), ending with the size
    assert lines[0] == "Model summary:", lines
    lines = lines[1 + next(i for i, line in enumerate(lines) if line.endswith("model params size (MB)")):]
    assert len(lines) == 4 and all(EPOCH_LINE.match(line) for line in lines[:3]), lines
    assert [EPOCH_LINE.match(line).groups() for line in lines[:3]] == [("0", "20"), ("1", "40"), ("2", "60")]
    # then which weights the test takes (the default policy keeps a best by val/acc), as the README shows it
    best = re.escape(str(run / "checkpoints" / "best"))
    assert re.fullmatch(rf"Testing the best checkpoint's weights \(step (20|40|60), {best}\)", lines[3]), lines
    summary = proc.stdout.splitlines()
    assert len(summary) == 4 and summary[0].startswith("Done in ") and summary[2] == f"Run directory: {run}", summary
    log = (run / "run.log").read_text()
    for line in lines[:3]:  # run.log holds what the console showed, and the setup details besides
        assert line in log
    assert "Parameter groups:" in log and "Parameter groups:" not in text


def test_a_long_epoch_also_gets_a_line_every_progress_every_s_seconds(tmp_path):
    proc = run_cli(tmp_path / "run", "trainer.max_epochs=1", "logger.progress_every_s=0.001", fast=False)
    assert proc.returncode == 0, output(proc)
    within = [line for line in output(proc).splitlines() if re.match(r"^epoch 0/0  batch \d+/20", line)]
    assert len(within) >= 5, output(proc)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
def test_a_terminal_keeps_one_bar_per_epoch_with_the_validation_metrics(tmp_path):
    session = f"progress-{time.monotonic_ns()}"
    done = tmp_path / "done"
    command = " ".join(shlex.quote(part) for part in (
        sys.executable, str(ROOT / "run.py"), f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=3"))
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40",
                    f"cd {shlex.quote(str(ROOT))} && OMP_NUM_THREADS=1 {command}; touch {shlex.quote(str(done))}; "
                    "sleep 60"], check=True)
    try:
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                                check=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert done.exists(), screen
    bars = [line for line in screen.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in bars] == ["epoch 0/2", "epoch 1/2", "epoch 2/2"], screen
    for line in bars:  # each finished bar stays, full, with the loss, the validation metrics and the speed
        assert "100%" in line and "20/20" in line and "loss=" in line and "val/acc=" in line and "samples/s=" in line, line
    assert "Done in " in screen

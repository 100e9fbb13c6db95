"""The suite's warm process (tests/warmstart.py) stands in for `python SCRIPT`: a run forked from it ends with the
status, output and signal a fresh interpreter's would, and so do the processes it spawns (DDP's workers), which are
forked from it too."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import output, run_process

pytestmark = pytest.mark.e2e

ENDINGS = {
    "exit code": "sys.exit(3)",
    "exit message": "sys.exit('bad value for x')",
    "exception": "raise ValueError('x')",
    "output without a newline": "print('hi', end='')",
    "atexit hook": "import atexit; atexit.register(lambda: print('at exit'))",
    "signal": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "ctrl-c": "raise KeyboardInterrupt",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_forked_run_ends_as_a_fresh_interpreter_would(tmp_path, ending):
    script = tmp_path / "script.py"
    script.write_text(f"import sys\nprint('started')\n{ENDINGS[ending]}\n")
    warm = run_process([sys.executable, str(script)])
    cold = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (warm.returncode, warm.stdout, warm.stderr.splitlines()[-1:]) == (
        cold.returncode, cold.stdout, cold.stderr.splitlines()[-1:]), (output(warm), output(cold))


SPAWNING = """
import multiprocessing, os, signal, sys, time

def child(case, folder):
    if case == "terminate":  # before the parent may send it: it sends once the file below exists
        signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join(folder, "got"), "w").close(), sys.exit(0)))
    with open(os.path.join(folder, "child.tmp"), "w") as f:
        f.write(f"{os.getpid()} {multiprocessing.parent_process().pid} {int('torch' in sys.modules)}")
    os.rename(os.path.join(folder, "child.tmp"), os.path.join(folder, "child"))  # whole when it appears
    if case == "exit":
        sys.exit(7)
    if case == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(60)

if __name__ == "__main__":
    case, folder = sys.argv[1], sys.argv[2]
    process = multiprocessing.get_context("spawn").Process(target=child, args=(case, folder))
    process.start()
    while not os.path.exists(os.path.join(folder, "child")):
        time.sleep(0.01)
    if case == "terminate":
        process.terminate()
    if case == "kill":
        process.kill()
    process.join()
    print(os.getpid(), process.pid, process.exitcode)
"""


@pytest.mark.parametrize("case, exitcode", [("exit", 7), ("signal", -10), ("terminate", 0), ("kill", -9)])
def test_a_spawned_process_is_forked_warm_gets_its_signals_and_ends_as_it_would_fresh(tmp_path, case, exitcode):
    script = tmp_path / "spawning.py"
    script.write_text(textwrap.dedent(SPAWNING))
    proc = run_process([sys.executable, str(script), case, str(tmp_path)], timeout=60)
    assert proc.returncode == 0, output(proc)
    parent, stand_in, code = map(int, proc.stdout.split())
    child, its_parent, warm = map(int, (tmp_path / "child").read_text().split())
    assert code == exitcode and its_parent == parent and warm == 1  # torch was there before it imported anything
    assert child != stand_in
    deadline = time.monotonic() + 30  # a SIGKILLed stand-in's worker is killed by the warm process's helper
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()
    if case == "terminate":
        assert (tmp_path / "got").exists()  # the stand-in forwarded SIGTERM to the process it stands for

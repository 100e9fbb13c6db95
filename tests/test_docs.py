"""Every command the docs show runs: each line of a ```bash (or sh, shell; in a console block, each `$ ` line) block
in README.md and docs/*.md, with `\\` continuations joined and `# ...` comments dropped, is one test named
`page:line`, so a renamed key or a removed option in the code fails the page and line that still show it.

How each is run, cheaply (a few seconds at most; the file takes 80-100 s on two cores):
- `python run.py ARGS`, `htf ARGS`, `python -m framework ARGS`: through conftest.run_cli (in this process through
  framework.app.api; `--help`, `--cfg` in a process of their own), with SHORT appended: a two-step run on at most
  two batches of each split (a key SHORT sets replaces the command's own value of it, `trainer.max_epochs=300`
  say), its run directory under tmp_path. `python -m framework export ...` and `python -m MODULE ...` run the
  module in this process (runpy), as `python -m` would.
- `-m` sweeps are composed, not run: one composition per value of the longest swept list, job i taking value
  i (mod its length) of every swept key, so every value is composed once (tests/test_sweep.py runs sweeps).
- Commands run in a scratch folder (tmp_path), so what a command writes to a relative path (`deploy/`) lands there,
  and `$HOME` is tmp_path. `data/shards` is one folder for the module, the digits' shards written in it once.
- A placeholder for a finished run (RUN_DIR, RUN_A, outputs/RUN, outputs/NAME/2026-11-23_03-40-42) is a copy of
  one short run made once for this module (`trained`): a resume or export changes the copy, never the original.

A page marks a command it does not want run with an HTML comment on the line(s) just before its code block:

    <!-- not run: REASON -->                 every command of the block is skipped, REASON shown by pytest -rs
    <!-- compose only: REASON -->            its config is composed (keys, options, values' types), not run
    <!-- not run `TEXT`: REASON -->          only the block's commands holding TEXT (likewise compose only)

A mark naming TEXT no command of its block holds fails (test_every_mark_names_a_command), and so does a command that
is neither the framework's nor marked (`make`, `pip`, `tensorboard`, `torchrun`, ...): it must say why it is not run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest
from conftest import ROOT, output, run_cli

pytestmark = [pytest.mark.e2e,
              # runpy runs `python -m framework.zoo.shards` though the shards fixture imported it: as python -m would
              pytest.mark.filterwarnings("ignore:'framework.zoo.shards' found in sys.modules:RuntimeWarning")]

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "console", "sh", "shell"}
FENCE = re.compile(r"^(\s*)```(\S*)")
MARK = re.compile(r"^\s*<!--\s*(not run|compose only)(?:\s+`([^`]+)`)?\s*:\s*(.+?)\s*-->\s*$")

# A short run: two optimizer steps on at most two train batches, one of val and test; lr_find's test, 3 steps (too
# few for a suggestion, which it says in a line).
SHORT = ("logger.progress_bar=false", "trainer.max_epochs=1", "trainer.max_steps=2", "trainer.limit_train_batches=2",
         "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "lr_find.num_steps=3")
SHORT_KEYS = {override.split("=", 1)[0] for override in SHORT}
# Hydra's options that take a value (the next word, unless it is an option itself).
OPTIONS_WITH_VALUES = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
                       "-cd", "--info", "--experimental-rerun"}
PLACEHOLDER = re.compile(r"outputs/[\w.-]+/\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}|outputs/RUN\b|\bRUN_DIR\b|\bRUN_[A-Z]\b")


@dataclasses.dataclass(frozen=True)
class Mark:
    kind: str  # "not run" or "compose only"
    text: Optional[str]  # the commands it applies to hold this; None: every command of the block
    reason: str
    line: int


@dataclasses.dataclass(frozen=True)
class Command:
    page: str  # relative to the repository
    line: int  # of the command's first line
    text: str
    mark: Optional[Mark]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def shell_blocks(page: Path) -> Iterator[tuple[list[Mark], list[tuple[int, str]]]]:
    """Each shell code block of the page: the marks on the lines just before it, and its (line number, text)."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, language, body = i, fence.group(2), []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        if language in SHELLS:
            marks, above = [], start - 1
            while above >= 0 and (mark := MARK.match(lines[above])):
                marks.append(Mark(mark.group(1), mark.group(2), mark.group(3), above + 1))
                above -= 1
            if language == "console":  # commands after a `$ ` prompt, the rest their output
                body = list(_prompted(body))
            yield marks, body


def _prompted(body: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """A console block's commands: each line after a `$ ` prompt (the prompt dropped) and its continuation lines."""
    continued = False
    for number, line in body:
        if not continued and not line.startswith("$ "):
            continue  # what the command printed
        yield number, line if continued else line[2:]
        continued = line.rstrip().endswith("\\")


def joined(body: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """The block's commands: continuation lines (a trailing backslash) joined, comments and blank lines dropped."""
    first, text = None, ""
    for number, line in body:
        first = first or number
        if line.rstrip().endswith("\\"):
            text += line.rstrip()[:-1] + " "
            continue
        text += line
        words = shlex.split(text, comments=True)
        if words:
            yield first, text.strip()
        first, text = None, ""


def mark_for(command: str, marks: list[Mark]) -> Optional[Mark]:
    named = [m for m in marks if m.text is not None and m.text in command]
    whole = [m for m in marks if m.text is None]
    return (named or whole or [None])[0]


def collect() -> tuple[list[Command], list[str]]:
    """Every command of every page, and the marks that name no command of their block."""
    commands, stale = [], []
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for marks, body in shell_blocks(page):
            texts = list(joined(body))
            for number, text in texts:
                commands.append(Command(name, number, text, mark_for(text, marks)))
            stale += [f"{name}:{m.line}: `{m.text}`" for m in marks
                      if m.text is not None and not any(m.text in text for _, text in texts)]
    return commands, stale


COMMANDS, STALE_MARKS = collect()


def test_every_mark_names_a_command() -> None:
    assert not STALE_MARKS, f"marks naming no command of their block: {STALE_MARKS}"


def test_the_pages_show_commands() -> None:
    """The parser finds what the pages hold (a change of fence or mark syntax would otherwise test nothing)."""
    assert len(COMMANDS) > 50
    assert sum(c.mark is None for c in COMMANDS) > 30


# ---------------------------------------------------------------------------------------------- running them
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One short finished run of the default experiment (checkpoints last and best): what a page's RUN_DIR is."""
    run_dir = tmp_path_factory.mktemp("docs") / "trained"
    proc = run_cli(run_dir, *SHORT, fast=False)
    assert proc.returncode == 0, output(proc)
    return run_dir


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder a page's `data/shards` is: the shards `python -m framework.zoo.shards data/shards` writes, written
    once here, so that a command reading them runs whether or not the one writing them ran before it."""
    from framework.zoo.shards import write_digits

    folder = tmp_path_factory.mktemp("data") / "shards"
    write_digits(folder)
    return folder


def argv_of(command: Command, tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """The command's words, its placeholders replaced: a finished run (copied), the scratch folder's paths."""
    text = command.text
    if PLACEHOLDER.search(text):
        run_copy = tmp_path / "RUN"
        shutil.copytree(request.getfixturevalue("trained"), run_copy)
        text = PLACEHOLDER.sub(str(run_copy), text)
    if "data/shards" in text:
        text = text.replace("data/shards", str(request.getfixturevalue("shards")))
    text = re.sub(r"\$HOME\b|\$\{HOME\}", str(tmp_path), text)
    return shlex.split(text, comments=True)


def framework_args(argv: list[str]) -> Optional[list[str]]:
    """The arguments of the framework's command line (run.py, htf, python -m framework, under torchrun), or None."""
    if argv[:2] == ["python", "run.py"] or argv[:3] == ["python", "-m", "framework"]:
        return argv[2 if argv[1] == "run.py" else 3:]
    if argv[:1] == ["htf"]:
        return argv[1:]
    if argv[:1] == ["torchrun"] and "run.py" in argv:
        return argv[argv.index("run.py") + 1:]
    return None


def short(args: list[str]) -> list[str]:
    """The command's overrides with SHORT after them, in place of the command's own values of SHORT's keys, then
    its options (`--cfg job`: Hydra's parser takes no override after an option's value)."""
    overrides, options, i = [], [], 0
    while i < len(args):
        if args[i].startswith("-"):
            takes = args[i] in OPTIONS_WITH_VALUES and i + 1 < len(args) and not args[i + 1].startswith("-")
            options += args[i:i + 1 + takes]
            i += 1 + takes
            continue
        if args[i].split("=", 1)[0] not in SHORT_KEYS:
            overrides.append(args[i])
        i += 1
    return overrides + list(SHORT) + options


def compositions(args: list[str]) -> list[list[str]]:
    """The overrides of each job composed for a (possible) sweep: every swept value once."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from framework.app.cli import with_stage

    overrides = with_stage(["run.py", *(a for a in args if a not in ("-m", "--multirun"))])[1:]  # test: stage=test
    assert not any(a.startswith("-") for a in overrides), f"compose only takes overrides: {args}"
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = {i: list(o.sweep_string_iterator()) for i, o in enumerate(parsed) if o.is_sweep_override()}
    jobs = max((len(v) for v in values.values()), default=1)
    return [[f"{parsed[i].get_key_element()}={values[i][job % len(values[i])]}" if i in values else text
             for i, text in enumerate(overrides)] for job in range(jobs)]


def compose(args: list[str]) -> None:
    from framework.app import api

    for overrides in compositions(args):
        api.compose(short(overrides))


def run_module(argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in this process: its exit code and what it printed."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = sys.argv
    sys.argv = [argv[2], *argv[3:]]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = saved
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_command(command: Command, tmp_path: Path, request: pytest.FixtureRequest,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    if command.mark is not None and command.mark.kind == "not run":
        pytest.skip(f"not run: {command.mark.reason}")
    monkeypatch.chdir(tmp_path)  # a relative path a command writes (deploy/, outputs/) lands in the scratch folder
    monkeypatch.syspath_prepend(str(ROOT))  # experiments.* stays importable from there
    argv = argv_of(command, tmp_path, request)
    args = framework_args(argv)
    if command.mark is not None:  # compose only
        assert args is not None, f"{command.id}: compose only, but not the framework's command line: {command.text}"
        compose(args)
        return
    if args is not None and args[:1] == ["export"]:
        proc = run_module(["python", "-m", "framework", *args])
    elif args is not None and argv[0] != "torchrun" and not {"-m", "--multirun"} & set(args):
        resumes = any(a.startswith("resume=") for a in args)  # a resume continues in its own run directory
        proc = run_cli(None if resumes else tmp_path / "run", *short(args), fast=False)
    elif args is not None and argv[0] != "torchrun":
        compose(args)  # a sweep: its jobs composed
        return
    elif argv[:2] == ["python", "-m"]:
        proc = run_module(argv)
    else:
        pytest.fail(f"{command.id}: `{command.text}` is not the framework's command; mark the block "
                    "<!-- not run: REASON --> (or <!-- not run `TEXT`: REASON --> for this line alone)")
    assert proc.returncode == 0, f"{command.id}: {command.text}\n{output(proc)}"
    assert "Traceback" not in output(proc), output(proc)

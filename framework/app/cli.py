"""The command line's edge: the entry point, and a mistake Hydra finds while composing the config in one line.

`main` is `htf`, `python -m framework` and this repository's run.py alike. Hydra's main config path is the user's
config tree, `--config-dir DIR` (or `--config-path DIR`, from the current directory); the framework's own tree (the
conf/ shipped with the framework package this process imported) comes after it, so a primary config or option of the
user's wins over the framework's of the same name, and without one the framework's conf/config.yaml runs. A user's
primary config starts from the framework's defaults with `defaults: [htf, _self_, ...]`. `--version` prints the
version. Before Hydra starts: the current directory's packages become importable (the user's models and data sets,
as under `python -m`), and torchrun's non-zero ranks and `resume=` add their overrides to the command line.

Hydra reports a bad override, an unknown option, a YAML syntax error or a run directory it cannot make in
several lines of its own (or as a traceback) and exits. `run(main)` asks Hydra to raise them instead
(HYDRA_FULL_ERROR=1, marked as forced so `framework.app.main` still reports our own `UserError`s in one line)
and prints each as one `Error: ...` line, exit code 1. So does a sweep whose launcher raised once its jobs had
started, after writing the summary of those that ran (`sweep.ended_by`). Anything else raised by our own code is a
bug and keeps its traceback. A user's own HYDRA_FULL_ERROR=1 leaves Hydra's reports and tracebacks untouched.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
import typing
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Iterator, Optional, Sequence

import hydra
import yaml
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.plugins import Plugins
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from framework import __version__
from framework.app import download, launch, resume, sweep
from framework.app import main as app
from framework.config.hints import CLOSED_GROUPS, key_hint
from framework.config.schema import register
from framework.config.trees import framework_conf_dir, source_dir
from framework.config.validate import STAGES
from framework.core import signals, startup
from framework.core.errors import FORCED_FULL_ERROR, UserError, full_error
from framework.parallel.cluster import export_cluster_environment

_FRAMEWORK_DIR = str(Path(__file__).resolve().parents[1]) + os.sep  # the framework package
# Their frames in a traceback are Hydra's composing (FrameworkConfigs, the API's compose), not our code's.
_HYDRAS_SIDE = {__file__, str(Path(__file__).with_name("api.py"))}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_CONFIG_DIR, _CONFIG_PATH, _CONFIG_NAME = ("--config-dir", "-cd"), ("--config-path", "-cp"), ("--config-name", "-cn")


def main() -> None:
    """`htf [--config-dir DIR] [--config-name NAME] [overrides]`, `python -m framework ...`, `python run.py ...`;
    `htf export RUN_DIR [options]` exports a run (framework/stages/export.py, its own options)."""
    if sys.argv[1:2] == ["export"]:
        from framework.stages.export import main as export

        sys.exit(export(sys.argv[2:]))
    resume.new_invocation()  # a command decides its `.hydra/` subdirs afresh (one process may run several)
    if not any(arg in ("-m", "--multirun") for arg in sys.argv[1:]):  # a sweep's parent trains nothing itself
        signals.LATCH.install()  # a cluster's signal while the run starts is held for its training loop
    startup.pause_collector()  # until the run is built (framework/core/startup.py)
    try:
        _main()
    except BrokenPipeError:  # stdout's reader went away (`htf --help | head`): not an error, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, when stdout is flushed
        sys.exit(1)
    finally:
        startup.resume_collector()  # a command that built no run (--cfg, --help, an error line)
        signals.LATCH.release()  # held by a run that never trained (--cfg, a dry run): its default action now


def _main() -> None:
    if "--version" in sys.argv[1:]:  # Hydra's parser has no such flag
        print(f"hydra-torch-framework {__version__}")
        return
    if os.getcwd() not in sys.path and "" not in sys.path:  # `htf`'s has its script's folder instead, as run.py's
        sys.path.insert(0, os.getcwd())
    register()  # the structured-config schemas the framework's tree is composed against
    Plugins.instance().register(FrameworkConfigs)
    sys.argv = with_stage(sys.argv)
    sys.argv, trees = _user_tree(sys.argv)
    export_cluster_environment()  # an srun of several tasks: each a rank, as under torchrun
    sys.argv += launch.rank_zero_only_overrides()  # under torchrun: one run directory, from rank 0
    name = _option(sys.argv[1:], _CONFIG_NAME) or "config"
    try:
        sys.argv = download.argv_with_local_copies(sys.argv)  # resume=URL, ckpt=URL, init_from=URL
    except UserError as err:
        if full_error():
            raise
        sys.stderr.write(f"Error: {err}\n")
        sys.exit(1)
    sys.argv = resume.argv_with_saved_choices(sys.argv, [*trees, framework_conf_dir()], name)  # resume=...
    run(hydra.main(version_base="1.3", config_path=str(framework_conf_dir()), config_name="config")(_job))


def _job(cfg: DictConfig) -> Any:
    return app.main(cfg)


class FrameworkConfigs(SearchPathPlugin):
    """The framework's config tree, after the main config path (the user's) in Hydra's search path. Registered by
    `main` in its own process: other Hydra applications in the same environment never see it."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        tree = str(framework_conf_dir())
        if source_dir(tree) not in {source_dir(e.path) for e in search_path.get_path() if e.path}:
            search_path.append("framework", tree)


def with_stage(argv: list[str]) -> list[str]:
    """LightningCLI's subcommand (`python run.py test ckpt=RUN_DIR`, also after Hydra's options: `-m test`): the
    override `stage=test`. A bare word is never an override, so only an option's value (`-cn test`) is not one.
    Without one the stage is the config's (`fit`)."""
    takes_value = {*_CONFIG_DIR, *_CONFIG_PATH, *_CONFIG_NAME, "--info", "-p", "--package"}
    for i, arg in enumerate(argv[1:], start=1):
        if arg in STAGES and argv[i - 1] not in takes_value:
            return [*argv[:i], *argv[i + 1 :], f"stage={arg}"]
    return argv


def _option(args: Sequence[str], names: tuple[str, str]) -> Optional[str]:
    """The value of a Hydra option (`--config-dir DIR`, `--config-dir=DIR`, `-cd DIR`), or None."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _user_tree(argv: list[str]) -> tuple[list[str], list[Path]]:
    """The command line with the user's config tree as Hydra's main config path, `--config-path` (absolute), and
    the user's trees. Hydra would put a --config-dir after the framework's tree (the main one), where the
    framework's config.yaml would shadow the user's; and would read a relative --config-path from the
    framework's package."""
    args = list(argv[1:])
    config_dir, config_path = _option(args, _CONFIG_DIR), _option(args, _CONFIG_PATH)
    if config_path is not None and not config_path.startswith("pkg://"):
        args = [f"--config-path={Path(config_path).absolute()}", *_without(args, _CONFIG_PATH)]
    elif config_path is None and config_dir is not None:
        args = [f"--config-path={Path(config_dir).absolute()}", *_without(args, _CONFIG_DIR)]
    trees = [Path(p).absolute() for p in (config_path, config_dir) if p is not None and not p.startswith("pkg://")]
    return [argv[0], *args], trees


def _without(args: list[str], names: tuple[str, str]) -> list[str]:
    """`args` less the option `names` and its value."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif arg.partition("=")[0] not in names:
            out.append(arg)
    return out


def run(main: Callable[[], Any]) -> None:
    """Call the `@hydra.main` function; a compose-time mistake ends the process with one line and exit 1."""
    if full_error():  # the user asked for Hydra's full report
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its own report
    os.environ[FORCED_FULL_ERROR] = "1"
    try:
        main()
    except Exception as err:  # noqa: BLE001  (re-raised unless it is a user's mistake Hydra found, or ends a sweep)
        message = describe(err, sys.argv[1:], inspect.unwrap(main)) or sweep.ended_by(err)
        if message is None:
            raise
        sweep.discard_unused()
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: rank 0 says it once
            # Written directly: Hydra may have configured logging (its own format, on stdout) or not at all.
            sys.stderr.write(f"Error: {message}\n")
        sys.exit(1)
    except KeyboardInterrupt:  # a sweep's parent waiting on joblib's or submitit's workers (each job saves on it)
        sys.stderr.write("Interrupted.\n")
        sys.exit(130)


def describe(err: Exception, args: Sequence[str], task: Optional[Callable[..., Any]] = None) -> Optional[str]:
    """One line for a mistake Hydra, OmegaConf or YAML found before our code ran; None for anything else
    (`args`: the command line's arguments, to quote an override as it was typed; `task`: the job function)."""
    if _raised_by_us(err, task):
        return None
    if isinstance(err, ValueError) and str(err).startswith("Only one of --run, --multirun, --cfg, --info"):
        return (
            f"{_one_line(str(err))}; expected --cfg job (or hydra, all), --info and -m each on a command line "
            "of its own: `python run.py optimizer.lr=0.1 --cfg job` prints one job's config"
        )
    if isinstance(err, OverrideParseException):
        return (
            f"{err.override}: malformed override ({err.message.splitlines()[0]}); expected key=value, "
            "with lists as [a,b] and quotes around text with special characters: key='a,b'"
        )
    if isinstance(err, MissingConfigException) and err.options is not None:
        return _unknown_option(err, args)
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        return _yaml_error(err)
    cause = err.__cause__ or err.__context__
    if isinstance(err, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        source = re.match(r"In '([^']+)'", str(err))
        return _omegaconf_error(cause, args, source.group(1) if source else None)
    if isinstance(err, OmegaConfBaseException):
        return _omegaconf_error(err, args, None)
    if isinstance(err, (HydraException, yaml.YAMLError)):
        return _one_line(str(err))
    os_error = next((e for e in _chain(err) if isinstance(e, OSError)), None)
    if os_error is not None and not isinstance(os_error, BrokenPipeError):  # main() ends that one quietly
        return _run_dir_error(os_error, args)
    return None


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _raised_by_us(err: BaseException, task: Optional[Callable[..., Any]]) -> bool:
    """Did our code (the job, a resolver, a callback) raise it, or a cause of it? Then it is a bug, not
    Hydra's report of a user's mistake (the job's own user errors were already reported by framework.app.main)."""
    task_code = getattr(task, "__code__", None)
    for e in _chain(err):
        tb: Optional[TracebackType] = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code is task_code or (
                code.co_filename.startswith(_FRAMEWORK_DIR) and code.co_filename not in _HYDRAS_SIDE
            ):
                return True
            tb = tb.tb_next
    return False


def _typed(args: Sequence[str], key: str) -> Optional[str]:
    """The override setting `key` (or a key under it), as it was typed."""
    for arg in args:
        name = arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if "=" in arg and (name == key or name.startswith(f"{key}.")):
            return arg
    return None


def _one_line(text: str) -> str:
    """Hydra's multi-line message, joined; the config search path it lists is noise to a user."""
    lines = []
    for line in text.splitlines():
        if line.strip().startswith(("Config search path", "Search path")):
            break
        if line.strip():
            lines.append(line.strip().rstrip("."))
    return "; ".join(lines)


def _closest(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


def _unknown_option(err: MissingConfigException, args: Sequence[str]) -> str:
    group, _, option = str(err.missing_cfg_file).rpartition("/")
    options = sorted(err.options or [])
    source = re.match(r"In '([^']+)'", str(err))
    typed = _typed(args, group) or f"{group}={option}" + (f" (in '{source.group(1)}')" if source else "")
    return (
        f"{typed}: no such option in group '{group}'; {_closest(option, options)}expected one of: {', '.join(options)}"
    )


def _yaml_error(err: yaml.MarkedYAMLError) -> str:
    mark = err.problem_mark
    path = Path(mark.name)
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    context = ""
    if err.context and err.context_mark is not None:
        context = f"; {err.context} at line {err.context_mark.line + 1}"
    return f"{path} line {mark.line + 1}: invalid YAML ({err.problem}{context})"


def _omegaconf_error(err: OmegaConfBaseException, args: Sequence[str], source: Optional[str]) -> str:
    full_key = str(err.full_key or err.key or "")
    typed = _typed(args, full_key) if full_key else None
    where = f" (in '{source}')" if source else ""
    if type(err) in (ConfigAttributeError, ConfigKeyError) and full_key:
        return _unknown_key(err, full_key, typed, typed or f"{full_key}{where}")
    if isinstance(err, ValidationError) and full_key:
        return f"{full_key}={err.value!r}{where}: {_expected(err)}"
    first = str(err.msg or err).splitlines()[0]
    return f"{typed or full_key}{where}: {first}" if full_key else first


def _unknown_key(err: OmegaConfBaseException, full_key: str, typed: Optional[str], shown: str) -> str:
    group, _, name = full_key.rpartition(".")
    parent = err.parent_node
    keys = sorted(str(k) for k in parent.keys() if k != "hydra") if isinstance(parent, DictConfig) else []
    top = group.split(".")[0]
    closed = top in ("", "hydra", *CLOSED_GROUPS)  # keys the framework (or Hydra) defines: `+` cannot add one
    if closed and top != "hydra":  # knows Lightning's names: check_val_every_n_epoch -> val_every_n_epochs
        did_you_mean = key_hint(full_key, typed.partition("=")[2] if typed else None)
    else:
        close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
        hint = (f"{group}.{close[0]}" if group else close[0]) if close else None
        did_you_mean = f"did you mean '{hint}'? " if hint else ""
    owner = f"{group} has no key '{name}'" if group else f"no config group or key '{name}'"
    add = f" (or add it as a new key: +{typed})" if typed and not closed else ""
    return f"{shown}: {owner}; {did_you_mean}expected one of: {', '.join(keys)}{add}"


def _expected(err: ValidationError) -> str:
    """What the schema's field takes, in words (`an integer`, `one of: fp32, amp`), after the closest choice."""
    try:
        kind = typing.get_type_hints(err.object_type)[str(err.key)]
    except Exception:  # noqa: BLE001  (not a dataclass field: OmegaConf's own words)
        return str(err.msg or err).splitlines()[0]
    if isinstance(kind, type) and issubclass(kind, Enum):
        return f"{_closest(str(err.value), [m.name for m in kind])}expected {_type_words(kind)}"
    return f"expected {_type_words(kind)}"


def _type_words(kind: Any) -> str:
    if kind in _TYPE_WORDS:
        return _TYPE_WORDS[kind]
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "one of: " + ", ".join(m.name for m in kind)
    if typing.get_origin(kind) is typing.Union:
        return " or ".join("null" if a is type(None) else _type_words(a) for a in typing.get_args(kind))
    return f"a value of type {getattr(kind, '__name__', kind)}"


def _run_dir_error(err: OSError, args: Sequence[str]) -> str:
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(args) else "hydra.run.dir"
    typed = _typed(args, key) or key
    return (
        f"{typed}: cannot create or write the run directory: {err.strerror or err} ('{err.filename}'); "
        f"expected a directory you can write to: set {key}=PATH"
    )

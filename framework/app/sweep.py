"""Sweeps that compare themselves: each job's HParams for TensorBoard, and the sweep summary at the end.

`SweepSummary` is a Hydra callback (conf/config.yaml, `hydra.callbacks`). When a multirun ends it reads
every job's `summary.json`, writes `summary.csv` in the sweep directory (one row per job: directory, every swept
key, every metric any job recorded, status, seconds), prints the table best job first (and mean ± std over
seeds when the sweep varies `seed` beside other keys), and exits non-zero if any job failed. A sweep over
`data.fold` (k-fold cross-validation) adds, for each group of jobs that differ only in it, a row of every metric's
mean ± std over the folds (`fold_rows`). Jobs never stop a sweep: the app records a failed job's error in its
`summary.json` and returns (see app.py); a job whose process dies is marked `killed` there by the launcher, which
is the framework's subclass of the joblib or submitit plugin's (hydra_plugins/htf_launchers, framework/
sweep_launchers.py); a job directory without a record is `unfinished`. A launcher that raises all the same still
gets the summary, and one error line (`ended_by`, called by cli.run).

`${sweep_subdir:}` (conf/config.yaml, `hydra.sweep.subdir`) names a job's directory after the keys the sweep
varies only: `-m optimizer.lr=0.01,0.1 trainer.max_epochs=3` gives `0_optimizer.lr=0.01`, not every override.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Collection, Iterable, Optional, cast

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from framework.config.hints import check_closed_keys
from framework.core import files, signals
from framework.core.errors import ConfigError
from framework.observe import trackers
from framework.observe.summary import is_metric

log = logging.getLogger(__name__)

# The choices every job records as HParams, beside its own overrides: name -> how to read it.
KEY_CHOICES = {
    "model": "choice",
    "data": "choice",
    "optimizer": "choice",
    "optimizer.lr": "value",
    "data.batch_size": "value",
    "precision": "choice",
    "parallel": "choice",
    "seed": "value",
}
# The order of the metric columns after the objective: by the part of the name before its first "/", then the rest.
METRIC_GROUPS = ("val", "best", "test", "train")
TABLE_GROUPS = ("val", "best", "test")  # the console table's; summary.csv has every metric
DRY_RUN = "dry run"  # a job's status with trainer.dry_run=true: built and checked, nothing trained
# A job refused at start in a directory whose run has a summary.json (the sweep directory run again) records the
# refusal here, and leaves the summary as it was; the newer of the two is the job's status.
REFUSED = "refused.json"
UNFINISHED = "unfinished"  # the status of a job directory without either record


def _plain(value: Any) -> Any:
    """A value TensorBoard's HParams accept (bool, number or string)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value, default=str)


def hparams(cfg: DictConfig, choices: dict[str, Optional[str]], overrides: list[str]) -> dict[str, Any]:
    """The key choices of a run plus every override of its command line, as HParams."""
    params: dict[str, Any] = {}
    for key, kind in KEY_CHOICES.items():
        value = choices.get(key) if kind == "choice" else OmegaConf.select(cfg, key)
        if value is not None:
            params[key] = _plain(value)
    for override in overrides:
        key, _, raw = str(override).partition("=")
        key = key.lstrip("+~")
        if key in choices:  # a group: its chosen option
            params[key] = choices[key] or "null"
        else:
            value = OmegaConf.select(cfg, key, default=None)
            params[key] = _plain(value if value is not None else raw)
    return params


# ------------------------------------------------------------------------------------- job directories
def register_resolvers() -> None:
    OmegaConf.register_new_resolver("sweep_subdir", sweep_subdir, replace=True)


def _varies(override: Override) -> bool:
    if not override.is_sweep_override():
        return False
    if override.value_type in (ValueType.INTERVAL_SWEEP, ValueType.GLOB_CHOICE_SWEEP):  # a search space, a glob
        return True
    return len(list(override.sweep_string_iterator())) > 1


def _search_space(hydra_cfg: DictConfig) -> list[str]:
    """`hydra.sweeper.params` (Optuna's search space, or the basic sweeper's) as override text."""
    params = OmegaConf.select(hydra_cfg, "sweeper.params", default=None)
    return [f"{key}={value}" for key, value in params.items()] if params else []


def _swept_by(arguments: list[str]) -> Optional[set[str]]:
    """The keys these sweep overrides give more than one value, as Hydra's parser reads them; None for a sweeper's
    own syntax, which Hydra's parser does not know."""
    try:
        return {o.key_or_group for o in OverridesParser.create().parse_overrides(arguments) if _varies(o)}
    except HydraException:
        return None


def swept_keys(hydra_cfg: DictConfig) -> Optional[set[str]]:
    """In a job: the keys the sweep gives more than one value, from the sweep's command line (Hydra's basic sweeper
    saves it in SWEEP_DIR/multirun.yaml before the first job) and `hydra.sweeper.params` (Optuna's search space);
    None when neither is known, or in a sweeper's own syntax (name every override, as Hydra would)."""
    arguments: list[str] = []
    recorded = Path(str(hydra_cfg.sweep.dir)) / "multirun.yaml"
    if recorded.is_file():
        saved = yaml.safe_load(recorded.read_text()) or {}
        arguments += [str(a) for a in ((saved.get("hydra") or {}).get("overrides") or {}).get("task") or []]
    arguments += _search_space(hydra_cfg)
    return _swept_by(arguments) if arguments or recorded.is_file() else None


def sweep_keys(config: DictConfig) -> set[str]:
    """In the multirun's own process: the keys its command line and its search space give more than one value.
    Optuna draws from `data.batch_size=32,64` and writes no multirun.yaml; its trials may all draw 64."""
    hydra_cfg = config.hydra
    typed = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)  # as typed: `${hydra:job.num}` kept
    return _swept_by([str(o) for o in cast(list, typed)] + _search_space(hydra_cfg)) or set()


def sweep_subdir(*, _root_: DictConfig) -> str:
    """`hydra.sweep.subdir`: `<job number>_<key=value,...>` for the keys the sweep varies, formatted as Hydra's
    `hydra.job.override_dirname` (its `exclude_keys` and separators); every override when the sweep is unknown."""
    hydra_cfg = _root_.hydra
    swept = swept_keys(hydra_cfg)
    if swept is None:
        name = str(hydra_cfg.job.override_dirname)
    else:
        style = hydra_cfg.job.config.override_dirname
        overrides = OverridesParser.create().parse_overrides([str(o) for o in hydra_cfg.overrides.task])
        lines = sorted(
            str(o.input_line) for o in overrides if o.key_or_group in swept and o.key_or_group not in style.exclude_keys
        )
        name = str(style.item_sep).join(lines).replace("=", str(style.kv_sep))
    name = name.replace("/", "%2F")  # a swept path (ckpt=RUN/checkpoints/best) names one directory, not a tree
    return f"{hydra_cfg.job.num}_{name}" if name else str(hydra_cfg.job.num)


# ---------------------------------------------------------------------------------------------- summary
def _job_overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    try:
        items = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else []
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # damaged: the row just lacks the swept values
        items = []
    if not isinstance(items, list):
        items = []
    return dict(str(item).lstrip("+~").split("=", 1) for item in items if "=" in str(item))


def _read_summary(path: Path) -> dict[str, Any]:
    """A job's record; a damaged or foreign one (cut short, not a JSON object) is a failed row naming the file,
    never the end of the summary (Hydra would turn that into a warning, and the sweep would exit 0)."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return {"status": "failed", "error": f"{path}: unreadable ({type(err).__name__}: {err})"}
    if not isinstance(summary, dict):
        return {"status": "failed", "error": f"{path}: expected a JSON object, found {type(summary).__name__}"}
    return summary


def record_path(job_dir: Path) -> Optional[Path]:
    """The file that says how a job ended: its summary.json, or refused.json where that is newer; None if neither."""
    summary, refused = job_dir / "summary.json", job_dir / REFUSED
    if refused.is_file() and (not summary.is_file() or refused.stat().st_mtime_ns >= summary.stat().st_mtime_ns):
        return refused
    return summary if summary.is_file() else None


def job_record(job_dir: Path) -> dict[str, Any]:
    """How a job ended. A job without a record is `unfinished`: its process was killed with no launcher left to say
    so (the sweep's own process, say), or it is still running."""
    path = record_path(job_dir)
    if path is None:
        return {"status": UNFINISHED, "error": "no summary.json: the job was killed before it ended, or still runs"}
    return _read_summary(path)


def _read_jobs(sweep_dir: Path) -> list[tuple[Path, dict[str, str], dict[str, Any]]]:
    """Each job directory of the sweep in job order, with its overrides and its record."""
    return [
        (job_dir, _job_overrides(job_dir), job_record(job_dir))
        for job_dir in sorted(
            (p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir()),
            key=lambda p: int(p.name.split("_", 1)[0]) if p.name.split("_", 1)[0].isdigit() else 0,
        )
    ]


def _swept_columns(overrides: list[dict[str, str]], declared: Collection[str]) -> list[str]:
    """The keys the sweep declared swept (whatever values its jobs drew) and those whose values differ between
    jobs (a sweep directory run again with others), in the order of the jobs' overrides; every key when none is."""
    keys: list[str] = []
    for job in overrides:
        keys += [k for k in job if k not in keys]
    return [k for k in keys if k in declared or len({job.get(k) for job in overrides}) > 1] or keys


def metric_columns(summaries: list[dict[str, Any]], objective: str) -> list[str]:
    """Every metric any job recorded: the objective first (a column even when no job has it), then by group
    (val/*, best/*, test/*, train/*, any other) and by name within one."""
    names = {k for s in summaries for k, v in s.items() if is_metric(k, v)}

    def order(name: str) -> tuple[int, str]:
        group = name.split("/", 1)[0] if "/" in name else ""
        return (METRIC_GROUPS.index(group) if group in METRIC_GROUPS else len(METRIC_GROUPS), name)

    return [objective, *sorted(names - {objective}, key=order)]


def collect(
    sweep_dir: Path, objective: str, declared: Collection[str] = ()
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """One row per job directory of the sweep, the swept keys and the metrics: each a column of every row, empty
    where a job lacks it. `declared`: the keys the sweep's command line and search space sweep."""
    jobs = _read_jobs(sweep_dir)
    swept = _swept_columns([overrides for _, overrides, _ in jobs], declared)
    metrics = metric_columns([summary for _, _, summary in jobs], objective)
    rows = []
    for job_dir, overrides, summary in jobs:
        row: dict[str, Any] = {"job": job_dir.name}
        row.update({k: overrides.get(k, "") for k in swept})
        row.update({name: summary.get(name, "") for name in metrics})
        row["status"] = summary.get("status", "ok")
        row["seconds"] = summary.get("seconds", "")
        row["error"] = summary.get("error", "")
        rows.append(row)
    return rows, swept, metrics


def rank(rows: list[dict[str, Any]], metric: str, mode: str) -> list[dict[str, Any]]:
    """Best job first; failed jobs and jobs without the metric last."""

    def key(row: dict[str, Any]) -> tuple[int, float]:
        value = row.get(metric)
        if row["status"] != "ok" or not isinstance(value, (int, float)) or math.isnan(value):
            return (1, 0.0)
        return (0, -value if mode == "max" else value)

    return sorted(rows, key=key)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Every row has every column (collect)."""
    with files.replacing(path, text=True) as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _fmt(value: Any) -> str:
    """A cell as summary.csv has it: a number to 4 decimals, no value (a null in summary.json) empty."""
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value)


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    table = [columns] + [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table)


def seed_stats(rows: list[dict[str, Any]], swept: list[str], metric: str) -> Optional[str]:
    """Mean ± std of `metric` over seeds for each setting of the other swept keys."""
    others = [k for k in swept if k != "seed"]
    if "seed" not in swept or not others:
        return None
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        if row["status"] == "ok" and isinstance(row.get(metric), (int, float)):
            groups.setdefault(tuple(row[k] for k in others), []).append(float(row[metric]))
    lines = [f"{metric} over seeds:"]
    for setting, values in groups.items():
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        label = ", ".join(f"{k}={v}" for k, v in zip(others, setting))
        lines.append(f"  {label}: {statistics.mean(values):.4f} ± {std:.4f} (n={len(values)})")
    return "\n".join(lines)


FOLD_KEY = "data.fold"  # a sweep over it (k-fold cross-validation, framework/data/folds.py) gets mean ± std rows
FOLDS_ROW = "mean ± std over folds"  # the `job` cell of such a row


def fold_rows(
    rows: list[dict[str, Any]], swept: list[str], metrics: list[str], mode: str, folds: Optional[int] = None
) -> list[dict[str, Any]]:
    """For each group of jobs that differ only in data.fold: one row of each metric's mean ± std over its folds
    that ended ok, best objective first (the objective is `metrics[0]`). `folds`: data.folds, the folds each group
    should have (else as many as it has jobs). Empty when the sweep does not sweep data.fold."""
    if FOLD_KEY not in swept:
        return []
    others = [k for k in swept if k != FOLD_KEY]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for job_row in rows:
        if job_row.get(FOLD_KEY, "") != "":
            groups.setdefault(tuple(job_row[k] for k in others), []).append(job_row)
    out = []
    for setting, jobs in groups.items():
        named = dict(zip(others, setting))
        swept_folds = str(named.get("data.folds", ""))  # a sweep over data.folds too: each group its own
        out.append(_fold_row(named, jobs, metrics, int(swept_folds) if swept_folds.isdigit() else folds))
    means = []
    for jobs in groups.values():
        first = [
            float(j[metrics[0]]) for j in jobs if j["status"] == "ok" and isinstance(j.get(metrics[0]), (int, float))
        ]
        means.append(statistics.mean(first) if first else math.nan)

    def key(i: int) -> tuple[bool, float]:  # as `rank`: best first, groups without the objective last
        return (math.isnan(means[i]), -means[i] if mode == "max" else means[i])

    return [out[i] for i in sorted(range(len(out)), key=key)]


def _fold_row(setting: dict[str, Any], jobs: list[dict[str, Any]], metrics: list[str], folds: Optional[int]) -> dict:
    """One group's row: `data.fold` counts the folds that ended ok; status ok when every fold asked for did (the
    error names the others: failed, interrupted, or missing: a sweep stopped before their jobs started)."""
    ok = [job for job in jobs if job["status"] == "ok"]
    row: dict[str, Any] = {"job": FOLDS_ROW, **setting, FOLD_KEY: f"{len(ok)} of {folds or len(jobs)} folds"}
    for name in metrics:
        values = [float(j[name]) for j in ok if isinstance(j.get(name), (int, float)) and not math.isnan(j[name])]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        row[name] = f"{statistics.mean(values):.4f} ± {std:.4f}" if values else ""
    problems = {str(j[FOLD_KEY]): str(j["status"]) for j in jobs if j["status"] != "ok"}
    ran = {str(j[FOLD_KEY]) for j in jobs}
    problems.update({str(i): "missing" for i in range(folds or 0) if str(i) not in ran})
    row["status"] = "incomplete" if problems else "ok"
    row["seconds"] = round(sum(float(j["seconds"]) for j in jobs if isinstance(j.get("seconds"), (int, float))), 3)
    row["error"] = ", ".join(f"fold {fold} {problems[fold]}" for fold in sorted(problems, key=_as_number))
    return row


def _as_number(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (0, text)


def folds_asked(sweep_dir: Path, rows: list[dict[str, Any]]) -> Optional[int]:
    """data.folds as the sweep's jobs were given it (the same for every job of a cross-validation), or None."""
    for row in rows:
        value = _job_overrides(sweep_dir / str(row["job"])).get("data.folds", "")
        if value.isdigit():
            return int(value)
    return None


def objective(config: DictConfig) -> tuple[str, str]:
    """The metric each job returns to the sweeper (app._run) and whether larger ("max") or smaller is better."""
    monitor = config.checkpoint.get("monitor")
    mode = getattr(config.checkpoint.mode, "value", config.checkpoint.mode) if monitor else "max"
    return monitor or "val/acc", mode


def check_direction(config: DictConfig) -> None:
    """A sweeper that optimizes (Optuna: `hydra.sweeper.direction`, minimize unless set) must seek what the jobs'
    metric calls better: left at minimize while the jobs return val/acc, it searched for the worst run and named it
    the best."""
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
    direction = getattr(direction, "name", direction)
    if direction not in ("minimize", "maximize"):  # no such sweeper, or several objectives: not ours to judge
        return
    metric, mode = objective(config)
    wanted = "maximize" if mode == "max" else "minimize"
    if direction != wanted:
        raise ConfigError(
            f"hydra.sweeper.direction={direction}: each job returns {metric} (checkpoint.monitor), "
            f"better when {'larger' if mode == 'max' else 'smaller'} (checkpoint.mode={mode}); "
            f"expected hydra.sweeper.direction={wanted}"
        )


# What differs from one job of a sweep to the next, as a config value may name it.
_PER_JOB = ("hydra:job.num", "hydra:job.id", "hydra:job.override_dirname", "hydra:runtime.output_dir")


def check_remote_per_job(config: DictConfig) -> None:
    """A sweep's jobs that train must each keep checkpoint.remote at a prefix of their own: one prefix for all had
    each new job refused there (it holds the first job's checkpoints), or, where jobs start at once (joblib,
    SLURM), had them publish over each other's. Its own where the key is swept, or its value names the job
    (`${hydra:job.num}`, ...) or a key the sweep varies; anything else may be the same for every job, so it is
    refused before any job starts."""
    remote = cast(dict, OmegaConf.to_container(config.checkpoint, resolve=False)).get("remote")  # as typed
    swept = sweep_keys(config)
    saves = config.get("stage", "fit") == "fit" and not config.trainer.fast_dev_run  # as main's check of the store
    if not remote or not saves or not swept or "checkpoint.remote" in swept:
        return
    if any(name in str(remote) for name in _PER_JOB) or any(f"${{{key}}}" in str(remote) for key in swept):
        return
    raise ConfigError(
        f"checkpoint.remote={remote!r}: every job of this sweep would keep its checkpoints at this one prefix, where "
        f"each would replace the one's before; expected a prefix per job, such as "
        f"checkpoint.remote='{str(remote).rstrip('/')}/${{hydra:job.num}}'"
    )


def _as_override(key: str, value: str) -> Optional[str]:
    """`key=value` as override text that Hydra's parser reads back as exactly `value`; None if no quoting does."""
    if "${" in value:  # would be composed as an interpolation
        return None
    parser = OverridesParser.create()
    for text in (value, f"'{value}'", f'"{value}"', "'" + value.replace("'", "\\'") + "'"):
        try:
            if parser.parse_override(f"{key}={text}").value() == value:
                return f"{key}={text}"
        except HydraException:
            continue
    return None


_SWEEP: dict[str, Any] = {}  # the multirun's own process and directory, set as it starts


def stop_in_sweep_process(config: DictConfig, signum: int) -> None:
    """A job stopped by Ctrl-C or SIGTERM (`scancel`) in the sweep's own process (Hydra's basic launcher runs the
    jobs one after another there): the sweep stops too, with its summary so far, exit 128 + the signal number.
    (A joblib or submitit job runs in a worker process, which the same signal reaches with the whole sweep.)"""
    if _SWEEP.get("pid") != os.getpid():
        return
    report(config, _SWEEP["dir"], _SWEEP.get("swept", ()))
    print(
        f"Sweep stopped by {signal.Signals(signum).name}: the same command with hydra.sweep.dir={_SWEEP['dir']} "
        "continues it (each job from its checkpoints/last)"
    )
    sys.exit(128 + signum)


def ended_by(err: Exception) -> Optional[str]:
    """In the multirun's own process, between the start of its jobs and its summary: a launcher or sweeper that raised
    (Hydra's joblib plugin when a worker dies, a job submitit could not start) ends the sweep with the summary of the
    jobs that ran, and the one line to print; None anywhere else (the error is then not the sweep's to report)."""
    config = _SWEEP.pop("config", None)
    if config is None or _SWEEP.get("pid") != os.getpid():
        return None
    trackers.close_sweep(_SWEEP["dir"])
    report(config, _SWEEP["dir"], _SWEEP.get("swept", ()))
    summary = _SWEEP["dir"] / "summary.csv"
    kept = f"the jobs it ran are in {summary}" if summary.is_file() else "no job had started"
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"the sweep stopped early ({type(err).__name__}: {first}); {kept}; HYDRA_FULL_ERROR=1 shows the traceback"


def discard_unused() -> None:
    """A sweep refused before its first job ran (a mistake in a sweep override: Hydra finds it as it composes
    the job, after its sweeper saved multirun.yaml) leaves nothing: a sweep directory it made that holds only that
    file is removed, as a refused run's directory is."""
    folder = _SWEEP.get("dir")
    if folder is None or _SWEEP.get("existed") or _SWEEP.get("pid") != os.getpid() or not folder.is_dir():
        return
    if {p.name for p in folder.iterdir()} <= {"multirun.yaml", trackers.RECORD}:  # (its MLflow parent's ID)
        shutil.rmtree(folder, ignore_errors=True)


def report(config: DictConfig, sweep_dir: Optional[Path], declared: Collection[str] = ()) -> bool:
    """Write summary.csv and print the table, best job first; True when a job did not end ok. `declared`: the
    keys the sweep sweeps (sweep_keys), each a column whatever values its jobs drew."""
    if sweep_dir is None or not sweep_dir.is_dir():
        return False
    metric, mode = objective(config)
    rows, swept, metrics = collect(sweep_dir, metric, declared)
    if not rows:
        return False
    folds = folds_asked(sweep_dir, rows) if FOLD_KEY in swept else None
    rows = rank(rows, metric, mode) + fold_rows(rows, swept, metrics, mode, folds)
    write_csv(sweep_dir / "summary.csv", rows)
    # Readable at a terminal: the objective and the val/best/test metrics; train/* and the rest are in the csv.
    shown = [m for m in metrics if m == metric or ("/" in m and m.split("/", 1)[0] in TABLE_GROUPS)]
    columns = ["job", *swept, *shown, "status", "seconds"]
    jobs = sum(row["job"] != FOLDS_ROW for row in rows)
    print(f"\nSweep summary ({jobs} jobs, best {metric} first): {sweep_dir / 'summary.csv'}")
    print(format_table(rows, columns))
    stats = seed_stats(rows, swept, metric)
    if stats:
        print(stats)
    print(f"Compare them with:  tensorboard --logdir {sweep_dir}")
    failed = [row for row in rows if row["status"] not in ("ok", DRY_RUN) and row["job"] != FOLDS_ROW]
    for row in failed:
        log.error("Job %s %s: %s", row["job"], row["status"], row["error"])
    return bool(failed)


def _launch_outliving_jobs(config: DictConfig) -> None:
    """Hydra's joblib and submitit plugins end a sweep when a job's process dies: the sweep launches through the
    framework's subclass of the plugin's launcher its config chose, which outlives its jobs (hydra_plugins/
    htf_launchers). Set before the sweeper is built, which builds the launcher; the sweep's multirun.yaml records it."""
    from hydra_plugins.htf_launchers import OUTLIVING

    launcher = config.hydra.launcher
    ours = OUTLIVING.get(str(launcher.get("_target_")))
    if ours is not None:
        with read_write(launcher):
            launcher._target_ = ours


class SweepSummary(Callback):
    """At the end of a multirun: summary.csv, the table best job first, and a non-zero exit on failures."""

    def __init__(self) -> None:
        self.sweep_dir: Optional[Path] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        signals.LATCH.release()  # the sweep's own process trains nothing: a signal takes its handler's action now
        try:
            check_direction(config)
            check_remote_per_job(config)
            # A key the framework's groups do not have, given to every job (`+trainer.max_epoch=1`), fails every
            # job alike: say so once, before any starts (or, on SLURM, is submitted).
            check_closed_keys(
                OmegaConf.masked_copy(config, [key for key in cast(Iterable[str], config) if key != "hydra"])
            )
        except ConfigError as err:  # before any job (Hydra would turn a callback's exception into a warning)
            sys.stderr.write(f"Error: {err}\n")
            sys.exit(1)
        # Resolve the sweep directory now, as the sweeper will: `${now:...}` is cached on this config
        # object, so both see the same time; `${hydra:...}` needs HydraConfig set, to this sweep's config (Hydra's
        # multirun sets none; a config composed earlier in this process and set as HydraConfig would name it).
        HydraConfig.instance().set_config(config)
        self.sweep_dir = Path(config.hydra.sweep.dir)
        _SWEEP.update(pid=os.getpid(), dir=self.sweep_dir, existed=self.sweep_dir.exists(), swept=sweep_keys(config))
        trackers.open_sweep(config, self.sweep_dir)  # MLflow's parent run of the jobs' runs
        # Every job composes its own config, where `hydra.sweep.dir` would follow the job's `name` (its model and
        # data): `-m model=mlp,cnn` put its jobs in two sweep directories. The value resolved here goes to every
        # job as one of the sweep's hydra overrides, which Hydra applies to each job's composition.
        hydra_overrides = config.hydra.overrides.hydra
        fixed = _as_override("hydra.sweep.dir", str(self.sweep_dir))
        if fixed and not any(str(o).lstrip("+~").startswith("hydra.sweep.dir=") for o in hydra_overrides):
            with read_write(hydra_overrides):
                hydra_overrides.append(fixed)
        _launch_outliving_jobs(config)
        _SWEEP["config"] = config  # from here until on_multirun_end, a launcher that raises gets a summary (ended_by)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        _SWEEP.pop("config", None)
        if self.sweep_dir is not None:
            trackers.close_sweep(self.sweep_dir)
        if report(config, self.sweep_dir, _SWEEP.get("swept", ())):
            sys.exit(1)

"""Entry point behind run.py: validate the composed config, then hand it to the Trainer.

User mistakes (`UserError`) end the run with one line on stderr and exit code 1, no traceback;
`HYDRA_FULL_ERROR=1` re-raises them so the traceback is there when you want it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional, cast

from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework import __version__
from framework.app import resume, rundir, sweep
from framework.app.launch import WorkerFailed, check_tasks_as_ranks, spawn
from framework.app.sweep import DRY_RUN
from framework.config.hints import check_closed_keys
from framework.config.interpolation import nodes, resolve_calls
from framework.config.saved import SavedRun, resumed_config
from framework.config.trees import source_dir
from framework.config.trust import check_saved_targets, conf_targets, targets
from framework.config.validate import check_stage, validate
from framework.core.errors import (
    ConfigError,
    HookError,
    Interrupted,
    TrainingFailed,
    UserError,
    error_line,
    full_error,
    os_error_line,
)
from framework.core.files import write_json
from framework.core.signals import STOP_ONLY
from framework.observe import provenance, trackers
from framework.observe.progress import file_only

log = logging.getLogger(__name__)

# The resolvers conf/config.yaml's hydra.run.dir and hydra.sweep.subdir use are needed wherever Hydra resolves them,
# a launcher's worker process included (it imports this module to unpickle the job): registered on import. The
# schemas are only needed where conf/ is composed: run.py registers them, explicitly.
resume.register_resolvers()
sweep.register_resolvers()


def resolve_all(cfg: DictConfig) -> None:
    """Report every `???` left unset, then the first interpolation that does not resolve, by their keys,
    before anything runs (a missing value would otherwise surface as the key of whatever interpolates it)."""
    found = list(nodes(cfg))
    missing = [key for key, parent, name in found if OmegaConf.is_missing(parent, name)]
    if missing:
        unset = ", ".join(f"{key}=???" for key in missing)
        example = " ".join(f"{key}=VALUE" for key in missing)
        raise ConfigError(
            f"{unset}: no value given (??? marks a value you must set); "
            f"expected a value on the command line, e.g. {example}"
        )
    for key, parent, name in found:
        if OmegaConf.is_interpolation(parent, name):
            try:
                parent[name]  # reading a node resolves it
            except OmegaConfBaseException as err:
                written = cast(Any, OmegaConf.to_container(parent, resolve=False))[name]  # a dict or a list
                raise ConfigError(
                    f"{key}={written!r} cannot be resolved: {str(err).splitlines()[0]}; "
                    "expected ${other.key} naming a key that exists, or a registered resolver "
                    "such as ${oc.env:NAME}"
                ) from None


def check_paths(cfg: DictConfig) -> None:
    """A missing data folder is the most common first-run mistake; say which key to set before loading. Only where
    a split reads `data.root`: a stream given its shards (data=webdataset's `*_shards`) reads those instead."""
    root = cfg.data.get("root")
    splits = [cfg.data.get(split) for split in ("train", "val", "test")]
    if root is not None and not Path(root).is_dir() and _reads_root(splits):
        raise ConfigError(
            f"data.root={root!r}: no such directory (relative paths start at {os.getcwd()}); "
            "expected the folder holding the data set's files: set data.root=/path/to/data"
        )


def _reads_root(node: Any) -> bool:
    """Whether a split's node (a split off is None) or one inside it (a held-out part's dataset) names a `root`,
    unless it is given `shards` to read."""
    if isinstance(node, (ListConfig, list)):
        return any(_reads_root(item) for item in node)
    if not isinstance(node, DictConfig) or node.get("shards") is not None:
        return False
    return "root" in node or any(_reads_root(node.get(key)) for key in node)


def main(cfg: DictConfig) -> Any:
    """The command line's job (Hydra's task function): run it and return its objective (for sweepers such as
    Optuna), the monitored metric.

    A `UserError` becomes one `Error: ...` line and exit code 1 (HYDRA_FULL_ERROR=1 re-raises); a run refused
    before it started leaves no trace in `outputs/`. In a multirun no job may end the sweep: any failure is
    recorded in the job's summary.json and the sweep goes on (framework/app/sweep.py reports it and exits
    non-zero at the end)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN and not full_error():
        return _sweep_job(cfg)
    try:
        return objective(cfg, run_job(cfg))
    except Interrupted as err:  # stopped on a signal after saving: not an error, but not finished either
        log.warning("%s", err)
        _requeue(cfg, err)
        sys.exit(128 + err.signum)
    except UserError as err:
        if full_error():
            raise
        log.error("Error: %s", err)
        sys.exit(1)
    except WorkerFailed as err:  # a bug in a spawned worker: its traceback is the useful part
        log.error("Error: a worker process failed:\n%s", err)
        sys.exit(1)
    except OSError as err:  # a full disk, a folder it cannot write: the path, in one line; the traceback in run.log
        if full_error():
            raise
        log.error("Error: %s", os_error_line(err))
        sys.exit(1)
    except KeyboardInterrupt:
        log.error("Interrupted.")
        sys.exit(130)


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """One job in this process, on the config Hydra composed for it (HydraConfig set): validate, settle the config,
    run the stage; its summary (summary.json's contents; {} for a dry run). A user's mistake is a UserError, an
    unwritable file an OSError (its traceback in run.log); either way, an attempt refused before it started leaves
    nothing behind. A run that failed once started (a HookError: an exception in a hook of the user's code, whose
    message then says what to do; or a crash) keeps its directory, with the traceback in run.log and summary.json's
    `status: failed`, so that the same command goes on (`_take_over`). The command line (`main`) and the Python API
    (framework/app/api.py) share it."""
    started: list[bool] = []
    start = time.perf_counter()
    try:
        return _run(cfg, started)
    except Interrupted:
        raise
    except HookError as err:  # the user's code raised in a hook: the run failed, its record is kept
        _record_failure(err, start)
        raise HookError(f"{err}; {_after_failure()}") from err.__cause__
    except TrainingFailed as err:  # a mistake found once it had trained: the run failed, its record is kept
        _record_failure(err, start)
        raise TrainingFailed(f"{err}; {_continue_after_fix()}") from err.__cause__
    except (UserError, OSError) as err:
        if isinstance(err, OSError):
            file_only("".join(traceback.format_exception(err)).rstrip())
        _discard_attempt(started=bool(started))
        raise
    except Exception as err:  # a crash (its traceback on the console): recorded as failed, for the same command
        if started:
            _record_failure(err, start)
        raise


def _record_failure(err: BaseException, start: float) -> None:
    """A run that failed once started: its traceback in run.log (a spawned worker wrote its own there), summary.json
    with `status: failed` and the error, as a sweep's failed job has (rank 0)."""
    if not isinstance(err, TrainingFailed) and (err.__cause__ is not None or not isinstance(err, HookError)):
        file_only("".join(traceback.format_exception(err)).rstrip())
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if os.environ.get("RANK", "0") != "0" or not run_dir.is_dir():
        return
    message, seconds = str(err) if isinstance(err, UserError) else error_line(err), time.perf_counter() - start
    try:
        _write_summary(run_dir, {"status": "failed", "error": message, "seconds": round(seconds, 3)})
    except OSError as write_err:  # the error that ended the run is the one to report
        log.warning("%s: not written (%s)", run_dir / "summary.json", os_error_line(write_err))


def _after_failure() -> str:
    """What to do after a hook failed: where its traceback is, and the command that goes on once it is fixed."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    return f"its traceback is in {run_dir / 'run.log'}; {_continue_after_fix()}"


def _continue_after_fix() -> str:
    """The command that goes on with a run that failed once it had started, when what failed is fixed."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if not resume.never_saved(run_dir):
        return f"once it is fixed, resume={run_dir} continues the run from its newest checkpoint"
    return "once it is fixed, the same command starts the run again"


def objective(cfg: DictConfig, summary: dict[str, Any]) -> Optional[float]:
    """What a sweeper optimizes: the monitored metric (val/acc without a monitor); None where the run has none."""
    value = summary.get(OmegaConf.select(cfg, "checkpoint.monitor") or "val/acc")
    return value if isinstance(value, (int, float)) else None


def _requeue(cfg: DictConfig, err: Interrupted) -> None:
    """After a stop on a signal (`last` saved): ask SLURM or submitit to requeue the job, per checkpoint.requeue.
    Only rank 0 (or the parent of spawned workers) asks, once."""
    from framework.core import signals

    if os.environ.get("RANK", "0") == "0" and cfg.checkpoint.on_signal:
        signals.requeue(err.signum, err.previous_handler, cfg.checkpoint.requeue)


def _discard_attempt(started: bool) -> None:
    hydra_cfg = HydraConfig.get()
    if os.environ.get("RANK", "0") == "0":  # torchrun's other ranks point at rank 0's directory
        rundir.discard_attempt(
            Path(hydra_cfg.runtime.output_dir), hydra_cfg.output_subdir, started=started, also=provenance.FILES
        )  # a new directory's provenance goes with it


def _run(cfg: DictConfig, started: Optional[list[bool]] = None) -> dict[str, Any]:
    """Validate, settle the config (a resumed run's is its checkpoint's), lock the run directory, train; after a
    fast_dev_run, remove what it wrote. `started` gets an item once training is handed over (a later failure is
    no longer "refused at start")."""
    if cfg.get("stage", "fit") not in ("fit", "lr_find"):  # lr_find starts a run of its own, as fit does
        return _evaluate(cfg)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    asked = cfg.resume  # the command line's own, before a requeued job's `auto`
    in_place = not cfg.resume and resume.continues_in_place(multirun, run_dir)
    if in_place:
        cfg.resume = resume.AUTO  # a requeued job continues from its own last checkpoint
    if not cfg.resume:  # a resumed run's values come from its checkpoint: checked once merged, below
        resolve_all(cfg)
        validate(cfg)
    rank_zero = os.environ.get("RANK", "0") == "0"
    held = rank_zero and str(hydra_cfg.output_subdir or "").startswith(".hydra/")  # a run was there before
    # A run that failed before its first checkpoint has nothing to continue: a fresh start takes its place.
    fresh_start = not cfg.resume or cfg.resume == resume.AUTO
    take_over = held and fresh_start and not multirun and resume.failed_unsaved(run_dir)
    if held and not cfg.resume and not take_over:
        raise ConfigError(_new_run_refused(run_dir))
    before, own = (rundir.entries(run_dir) if rank_zero else frozenset()), [".hydra", "run.log"]
    with rundir.RunDirLock(run_dir) if rank_zero else contextlib.nullcontext():
        if take_over:
            before, own = _take_over(run_dir, str(hydra_cfg.output_subdir)), [".hydra"]  # run.log: the attempt's
        held = held and not take_over
        cfg, summary = _train(cfg, run_dir, hydra_cfg, started, in_place=in_place, asked=asked, held=held)
    if rank_zero and cfg.trainer.fast_dev_run and not multirun:  # a check of the code, not a run: keep nothing
        rundir.discard_dev_run(run_dir, before, own)
    return summary


def _take_over(run_dir: Path, hydra_subdir: str) -> frozenset[str]:
    """Set aside the failed attempt in `run_dir` (locked), checked again now that no other process can change it;
    the directory's entries afterwards."""
    error = resume.failure(run_dir)
    if error is None or not resume.never_saved(run_dir):
        raise ConfigError(_new_run_refused(run_dir))
    aside = rundir.set_aside(run_dir, hydra_subdir)
    log.info(
        "%s: the run there failed before its first checkpoint (%s); its files are kept in %s, and this run "
        "starts in its place (run.log goes on)",
        run_dir,
        error,
        aside,
    )
    return rundir.entries(run_dir)


def _evaluate(fresh: DictConfig) -> dict[str, Any]:
    """validate/test ckpt=: the saved run's config (trusted as resume= trusts it) with this command line on top, in a
    run directory of its own; the saved run is only read."""
    from framework.stages.evaluate import evaluation_only, find_checkpoint  # torch: once the config is known good

    hydra_cfg = HydraConfig.get()
    run_dir, rank_zero = Path(hydra_cfg.runtime.output_dir), os.environ.get("RANK", "0") == "0"
    check_closed_keys(fresh)  # `+ckpt_path=` is a mistake to name before anything else
    check_stage(fresh)  # the rest is checked once merged with the saved run's config, below
    checkpoint = find_checkpoint(str(fresh.ckpt))
    saved = resume.saved_run(str(checkpoint.path), checkpoint)
    if saved is not None:
        saved.evaluated = True
    overrides = _task_overrides(hydra_cfg)
    cfg, choices = _settled(fresh, dict(hydra_cfg.runtime.choices), saved, overrides, hydra_cfg)
    evaluation_only(cfg)
    resolve_all(cfg)
    validate(cfg)
    if cfg.stage == "predict" and cfg.parallel.strategy == "fsdp":  # a sharded forward needs every rank in step
        raise ConfigError(
            "parallel=fsdp: predict runs each process's own samples through the whole model, which a sharded one "
            "is not; expected parallel=ddp (or single), which loads the weights whole on each process"
        )
    held = rank_zero and str(hydra_cfg.output_subdir or "").startswith(".hydra/")
    held = held and not _unfinished_predict(cfg, run_dir)
    take_over = held and resume.failed_unsaved(run_dir)  # an evaluation that failed: run again in its place
    if held and not take_over:
        raise ConfigError(f"hydra.run.dir={str(run_dir)!r} already holds a run; expected another directory")
    with rundir.RunDirLock(run_dir) if rank_zero else contextlib.nullcontext():
        if take_over:
            _take_over(run_dir, str(hydra_cfg.output_subdir))
        recording = (
            provenance.BackgroundWrite(run_dir, Path(hydra_cfg.runtime.cwd), overrides, spawned(cfg))
            if rank_zero
            else None
        )
        try:  # (not `started`: a stage that fails leaves nothing behind, as a run refused at start)
            summary = launch(cfg, run_dir, checkpoint, None, choices)
            if rank_zero and (run_dir / "summary.json").is_file():
                summary = _write_summary(run_dir, summary)
        finally:
            if recording is not None:
                recording.join()
    return summary


def _task_overrides(hydra_cfg: HydraConf) -> list[str]:
    """This command line's overrides as typed: an override holding `${...}` (`+data.predict={..., transform:
    ${data.train.transform}}`) stays text, not what it resolves to."""
    return [str(o) for o in cast(list, OmegaConf.to_container(cast(Any, hydra_cfg).overrides.task, resolve=False))]


def _unfinished_predict(cfg: DictConfig, run_dir: Path) -> bool:
    """A predict run in `run_dir` that did not finish (or failed), which the same command continues (its parts are
    kept)."""
    if cfg.stage != "predict" or ((run_dir / "summary.json").exists() and resume.failure(run_dir) is None):
        return False
    try:
        return OmegaConf.select(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), "stage") == "predict"
    except Exception:  # noqa: BLE001  (no readable record: not a predict run to continue)
        return False


def _new_run_refused(run_dir: Path) -> str:
    """The refusal of a new run into `run_dir`, with the way forward that works for what is there."""
    refused = f"hydra.run.dir={str(run_dir)!r} already holds a run, and a new run never replaces one"
    error = resume.failure(run_dir)
    if error is not None:  # and it saved a checkpoint (one that saved none is taken over)
        return (
            f"hydra.run.dir={str(run_dir)!r} holds a run that failed ({error}) after saving a checkpoint, and a new "
            f"run never replaces one; expected resume={run_dir} to continue it, or another directory"
        )
    if resume.finished_unsaved(run_dir):
        return f"{refused}; expected another directory (that run finished without a checkpoint to continue from)"
    return f"{refused}; expected resume={run_dir} to continue it, or another directory"


def _train(
    fresh: DictConfig,
    run_dir: Path,
    hydra_cfg: HydraConf,
    started: Optional[list[bool]],
    *,
    in_place: bool,
    asked: Optional[str],
    held: bool,
) -> tuple[DictConfig, dict[str, Any]]:
    """Settle the config on the checkpoint it starts from (an older one where a newer does not restore), then
    train, in this locked run directory; the config it ran with, and its summary. `asked`: the command line's
    resume=; `held`: the directory held a run before this invocation."""
    from framework.checkpoint import DamagedCheckpoint  # torch: imported once the config is known good

    rank_zero = os.environ.get("RANK", "0") == "0"
    overrides, fresh_choices = _task_overrides(hydra_cfg), dict(hydra_cfg.runtime.choices)
    checkpoint = resume.find_checkpoint(fresh.resume, run_dir)
    recording: Optional[provenance.BackgroundWrite] = None
    try:
        while True:
            try:
                cfg, choices = _settled(
                    fresh, fresh_choices, resume.saved_run(fresh.resume, checkpoint), overrides, hydra_cfg
                )
            except ConfigError as err:
                if not in_place or checkpoint is None:
                    raise
                raise ConfigError(
                    f"{run_dir} already holds a run, which this job would continue (a sweep "
                    f"directory used again, or a requeued job): {err}; for a new run, expected "
                    "another hydra.sweep.dir"
                ) from None
            _check_dev_run(cfg, asked, held, run_dir, hydra_cfg.mode == RunMode.MULTIRUN)
            params = sweep.hparams(cfg, choices, overrides)
            if rank_zero and recording is None:  # once the run is known to start: a refused one leaves nothing
                recording = provenance.BackgroundWrite(run_dir, Path(hydra_cfg.runtime.cwd), overrides, spawned(cfg))
            if started is not None:
                started.append(True)
            try:
                summary = launch(cfg, run_dir, checkpoint, params, choices)
                if rank_zero and summary and (run_dir / "summary.json").is_file():  # not after a dry run
                    summary = _write_summary(run_dir, summary)
                    _upload_records(cfg, run_dir)
                return cfg, summary
            except DamagedCheckpoint as err:  # its state does not fit the live components: try an older one
                if checkpoint is None and cfg.init_from:  # its files, verified as they were loaded
                    raise ConfigError(f"init_from={cfg.init_from!r}: {err}") from None
                if checkpoint is None:
                    raise
                checkpoint = resume.fall_back(fresh.resume, checkpoint, err)
    finally:
        if recording is not None:
            recording.join()


def _upload_records(cfg: DictConfig, run_dir: Path) -> None:
    """checkpoint.remote: the run's records as it ended (its summary is written after its last checkpoint's upload)."""
    if not cfg.checkpoint.get("remote") or cfg.trainer.fast_dev_run:
        return
    from framework.checkpoint.upload import upload_records
    from framework.core.stores import cause, is_store_error, open_store

    options = OmegaConf.to_container(cfg.checkpoint.remote_options, resolve=True)
    try:
        upload_records(open_store("checkpoint.remote", str(cfg.checkpoint.remote), cast(dict, options)), run_dir, {})
    except Exception as err:
        if not is_store_error(err):
            raise
        log.warning("checkpoint.remote=%r: the run's records were not uploaded: %s", cfg.checkpoint.remote, cause(err))


def _check_dev_run(cfg: DictConfig, asked: Optional[str], held: bool, run_dir: Path, multirun: bool) -> None:
    """A fast_dev_run keeps nothing (its new run directory is removed at its end): it never runs where a run is."""
    if not cfg.trainer.fast_dev_run:
        return
    if asked:
        raise ConfigError(
            f"trainer.fast_dev_run=true: a dev run trains one batch and keeps nothing, so it cannot "
            f"continue a run (resume={asked}); expected trainer.fast_dev_run=false to continue it, or "
            "no resume= for a dev run of its own"
        )
    if held:
        raise ConfigError(
            f"trainer.fast_dev_run=true: {run_dir} already holds a run, whose files a dev run would "
            f"overwrite; expected another {'hydra.sweep.dir' if multirun else 'hydra.run.dir'}"
        )


def _settled(
    cfg: DictConfig,
    choices: dict[str, Any],
    saved: Optional[SavedRun],
    overrides: list[str],
    hydra_cfg: HydraConf,
) -> tuple[DictConfig, dict[str, Any]]:
    """The config the run uses: for a resume, the saved run's own (its checkpoint's, or for a run that saved
    none, Hydra's record of it), with this command line on top, built only from targets the user's own code
    names; validated, with its data folder and init_from checked."""
    if saved is not None:
        trusted = conf_targets(_conf_dirs(hydra_cfg)) | {
            t for _, t in targets(OmegaConf.to_container(cfg, resolve=False))
        }
        cfg, choices = resumed_config(cfg, saved, choices, overrides)
        if not cfg.trust_saved_config:
            check_saved_targets(cfg, trusted, Path(hydra_cfg.runtime.cwd), f"the config saved in {saved.source}")
    if cfg.resume:
        resolve_all(cfg)
        validate(cfg)
    check_paths(cfg)
    check_tasks_as_ranks(cfg.parallel)
    if cfg.get("stage", "fit") == "fit" and cfg.checkpoint.get("remote") and not cfg.trainer.fast_dev_run:
        from framework.checkpoint.remote import checked_store, refuse_another_run  # torch: config known good now

        options = OmegaConf.to_container(cfg.checkpoint.remote_options, resolve=True)
        store = checked_store("checkpoint.remote", str(cfg.checkpoint.remote), cast(dict, options))  # a probe write
        if saved is None:  # a new run: the remote is its own
            refuse_another_run("checkpoint.remote", store)
    if cfg.get("init_from"):
        cfg.init_from = resume.find_weights(str(cfg.init_from))
    return cfg, choices


def _conf_dirs(hydra_cfg: HydraConf) -> list[Path]:
    """The config trees this run was composed from: the user's (conf/, --config-dir) and the framework's, not
    Hydra's own."""
    found = (
        source_dir(source.path, source.schema)
        for source in hydra_cfg.runtime.config_sources
        if source.provider != "hydra" and source.path
    )
    return [folder for folder in found if folder is not None]


@contextlib.contextmanager
def _platform_start_method() -> Iterator[None]:
    """A job of joblib's launcher runs in a loky worker, whose multiprocessing default is loky's own context: the
    DataLoader workers made from it died ("'Process' object has no attribute 'env'"), and so did the spawned DDP
    workers (a fresh interpreter cannot find a 'loky' context). The job gets the platform's default start method,
    as a process of its own has; the launcher's worker gets its own back afterwards."""
    previous = multiprocessing.get_start_method(allow_none=True)
    if previous is None or previous in multiprocessing.get_all_start_methods():
        yield
        return
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)


def _sweep_job(cfg: DictConfig) -> float:
    """One job of a multirun: never raises (but for submitit's requeue), so a failing job cannot stop the others."""
    if os.environ.get("RANK", "0") != "0":
        return _sweep_job_rank(cfg)
    start = time.perf_counter()
    started: list[bool] = []
    try:
        with _platform_start_method():
            found = objective(cfg, _run(cfg, started))
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if cfg.trainer.dry_run and not (run_dir / "summary.json").is_file():  # built, checked, not trained
            _write_summary(run_dir, {"status": DRY_RUN, "seconds": round(time.perf_counter() - start, 3)})
        return float("nan") if found is None else found
    except Interrupted as err:  # saved on a signal: requeued (submitit exits here), or reported as interrupted
        return _interrupted_job(cfg, err, start)
    except SystemExit as err:
        if _submitit_requeue(err):  # its time-limit handler requeued the job and exits: not a failure
            raise
        return _failed_job(err, start, bool(started))
    except KeyboardInterrupt as err:  # Ctrl-C unwatched (checkpoint.on_signal=false), or a second stop signal
        _failed_job(err, start, bool(started), status="killed")
        sweep.stop_in_sweep_process(cfg, signal.SIGINT)  # the basic launcher's sweep stops, as on a first Ctrl-C
        return float("nan")
    except Exception as err:  # noqa: BLE001  (recorded, reported at the end of the sweep)
        return _failed_job(err, start, bool(started))


def _sweep_job_rank(cfg: DictConfig) -> float:
    """A non-zero rank's part of a multirun job (a task of a submitit job of several tasks): the job's record is rank
    0's, so this rank writes none. Its failure is one line here, then raised: the framework's submitit launcher
    (hydra_plugins/htf_launchers) hands it to submitit as the task's, and the job is failed, whatever rank 0 wrote
    (framework/app/sweep_launchers.py)."""
    rank = os.environ["RANK"]
    try:
        with _platform_start_method():
            found = objective(cfg, _run(cfg))
        return float("nan") if found is None else found
    except Interrupted as err:  # rank 0 saved, recorded and asked for the requeue
        log.warning("%s", err)
        return float("nan")
    except UserError as err:
        log.error("Error: %s", err)
        raise RankFailed(f"rank {rank}: {err}") from None
    except Exception as err:
        log.error("Rank %s failed:\n%s", rank, "".join(traceback.format_exception(err)).rstrip())
        raise RankFailed(f"rank {rank}: {error_line(err)}") from err


class RankFailed(RuntimeError):
    """A non-zero rank of a multirun job failed: its task failed, so the job did (framework/app/sweep_launchers.py)."""


def _interrupted_job(cfg: DictConfig, err: Interrupted, start: float) -> float:
    """A job that stopped on a signal and saved: requeued (submitit's handler exits the process), or recorded as
    interrupted. Submitit's handler raises instead when it will not requeue (the job timed out too often): the job is
    recorded as interrupted with that reason, and the sweep goes on."""
    log.warning("%s", err)
    error = str(err)
    try:
        _requeue(cfg, err)
    except Exception as refused:  # noqa: BLE001  (recorded with the job)
        error = f"{err}; not requeued: {type(refused).__name__}: {refused}"
        log.error("Not requeued: %s: %s", type(refused).__name__, refused)
    _write_summary(
        Path(HydraConfig.get().runtime.output_dir),
        {"status": "interrupted", "error": error, "seconds": round(time.perf_counter() - start, 3)},
    )
    if err.signum in STOP_ONLY:  # Ctrl-C or scancel: the jobs after it do not start either
        sweep.stop_in_sweep_process(cfg, err.signum)
    return float("nan")


def _submitit_requeue(err: SystemExit) -> bool:
    """A SystemExit raised inside submitit's own signal handler: it has requeued the job (a signal that came
    after the run's watch was gone, e.g. between the end of training and the end of the job)."""
    return any(
        frame.f_globals.get("__name__", "").startswith("submitit.") for frame, _ in traceback.walk_tb(err.__traceback__)
    )


def _failed_job(err: BaseException, start: float, started: bool, status: str = "failed") -> float:
    """Record a job that failed, or was `killed` by a signal it survived (summary.json, the log), and give the sweep
    its NaN objective. A job refused before it started, in a directory whose run has a summary already (the same
    sweep directory run again), leaves that summary as it is and records the refusal beside it (sweep.REFUSED),
    newer, so the sweep reports it."""
    if isinstance(err, KeyboardInterrupt):  # no message of its own: say what raises it
        message = "KeyboardInterrupt: ended at once by SIGINT (Ctrl-C) or a second stop signal, without saving"
    else:
        message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
    if isinstance(err, HookError):  # one line, its traceback in run.log alone
        file_only("".join(traceback.format_exception(err)).rstrip())
    if isinstance(err, (UserError, KeyboardInterrupt)):
        log.error("Error: %s", message)
    else:
        log.error("Job failed:\n%s", "".join(traceback.format_exception(err)).rstrip())
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    record = {"status": status, "error": message, "seconds": round(time.perf_counter() - start, 3)}
    if not started and (run_dir / "summary.json").is_file():
        write_json(run_dir / sweep.REFUSED, {**record, "framework_version": __version__})
    else:
        _write_summary(run_dir, record)
    return float("nan")


def _write_summary(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json, naming the framework version that wrote it (over the trainer's, after a run), and the trackers
    that failed; the trackers get the summary (framework/observe/trackers.py)."""
    summary = trackers.finish(run_dir, {**summary, "framework_version": __version__})
    write_json(run_dir / "summary.json", summary)
    return summary


def spawned(cfg: DictConfig) -> int:
    """The processes `launch` spawns for `cfg`: one per device for parallel=ddp or fsdp without a launcher, else 0."""
    from framework.parallel.group import default_devices, under_launcher

    if cfg.parallel.strategy in ("ddp", "fsdp") and not under_launcher():
        return int(cfg.parallel.devices or default_devices())
    return 0


def launch(
    cfg: DictConfig,
    run_dir: Path,
    checkpoint: Any = None,
    hparams: Optional[dict[str, Any]] = None,
    choices: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """In this process, or, for parallel=ddp or fsdp without a launcher, in one spawned process per device."""
    processes = spawned(cfg)  # (imports torch: after validation, so that a bad config fails fast)
    if processes:
        resolve_calls(cfg)  # spawned workers have no HydraConfig to resolve `${hydra:...}` with
        spawn(
            cfg,
            run_dir,
            processes,
            checkpoint.path if checkpoint is not None else None,
            hparams,
            choices,
        )
        summary = run_dir / "summary.json"  # a dry run writes none
        return json.loads(summary.read_text()) if summary.is_file() else {}
    from framework.app.stage import run_stage  # torch: imported once the config is known good

    return run_stage(cfg, run_dir, checkpoint, hparams, choices)

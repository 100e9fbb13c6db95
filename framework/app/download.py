"""`resume=URL`, `ckpt=URL` and `init_from=URL`: a run's remote copy (checkpoint.remote) read back before Hydra
composes the command line. What each needs is downloaded, and the command line names the local copy instead, so
that everything after is the local path's:

- `resume=URL`: the newest intact published checkpoint (`best` too, where it is another one) and the run's records,
  into a new local run directory (`hydra.run.dir` when the command line sets one, else `outputs/<name>/<time>`),
  which the run then continues in place as `resume=RUN_DIR` does: the same TensorBoard run, its saved config, and so
  its `checkpoint.remote`, the same remote. A `hydra.run.dir` that holds a run already is continued as it is (its
  checkpoints are never older than what it uploaded).
- `ckpt=URL` (validate, test, predict) and `init_from=URL`: one checkpoint (ckpt=: the best, else the newest;
  init_from=: the newest; `URL/checkpoints/NAME`: that one) into a cache folder
  (`$XDG_CACHE_HOME/hydra-torch-framework/remote`, else `~/.cache/...`), where the next command finds it.

A URL holding credentials is refused here, for any key, before anything is written. The reads take the endpoint
from AWS_ENDPOINT_URL, or from `checkpoint.remote_options.endpoint_url=` on the same command line.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from framework.core.errors import ConfigError
from framework.core.stores import is_url

log = logging.getLogger(__name__)

KEYS = ("resume", "ckpt", "init_from")
ENDPOINT_OPTION = "checkpoint.remote_options.endpoint_url"
NONE_INTACT = "no intact checkpoint there (each is named above, with what is wrong with it)"


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def _unquoted(value: str) -> str:
    """A value as Hydra reads it where the command line quotes it whole (`'s3://b/train-{0..3}.tar'`)."""
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value


def argv_with_local_copies(argv: list[str]) -> list[str]:
    """`argv` with each `resume=`, `ckpt=` and `init_from=` URL replaced by its local copy, downloaded now (see the
    module's docstring); ConfigError naming the key, the URL and the cause where that cannot be done."""
    from framework.core.stores import check_url

    args = argv[1:]
    overrides = {_key(a): _unquoted(a.split("=", 1)[1]) for a in args if "=" in a and not a.startswith("-")}
    for key, value in overrides.items():
        if is_url(value) and "@" in value.partition("://")[2].partition("/")[0]:
            check_url(key, value)  # refuses it, naming the key, the credentials left out
    wanted = [key for key in KEYS if is_url(overrides.get(key))]
    if not wanted:
        return argv
    if "resume" in wanted and ("-m" in args or "--multirun" in args):
        raise ConfigError(f"resume={overrides['resume']!r}: a multirun continues one run per job; expected one run")
    options = {"endpoint_url": overrides[ENDPOINT_OPTION]} if overrides.get(ENDPOINT_OPTION) else {}
    local = {key: _local_copy(key, overrides[key], overrides.get("hydra.run.dir"), options) for key in wanted}
    out = [argv[0]]
    for arg in args:
        given = _key(arg) if "=" in arg and not arg.startswith("-") else ""
        out.append(f"{arg.split('=', 1)[0]}={local[given]}" if given in local else arg)
    return out


def _local_copy(key: str, url: str, run_dir: Optional[str], options: dict[str, Any]) -> str:
    from framework.checkpoint.download import fetch_cached, fetch_run
    from framework.checkpoint.upload import CHECKPOINTS, manifests
    from framework.core.stores import cause, is_store_error, open_store

    root, _, name = url.rstrip("/").rpartition(f"/{CHECKPOINTS}/")
    root, name = (root, name) if root and name and "/" not in name and key != "resume" else (url, "")
    store = open_store(key, root, options)
    try:
        published = manifests(store)
        if key == "resume" and run_dir and _holds_run(Path(run_dir)):
            _check_local_copy(url, Path(run_dir), published)
            log.info("resume=%s: %s holds the run already, as new as the remote; continuing it there", url, run_dir)
            return run_dir
        if name:
            published = {name: published[name]} if name in published else {}
        if not published:
            raise ConfigError(f"{key}={url!r}: {_nothing_there(store, name)}")
        if key == "resume":
            local = Path(run_dir) if run_dir else _new_run_dir(store, published)
            if fetch_run(store, published, local) is None:
                raise ConfigError(
                    f"{key}={url!r}: no intact checkpoint there (each is named above, with what is wrong)"
                )
            return str(local)
        found = fetch_cached(store, published, cache_dir() / store.url.partition("://")[0] / store.root, key == "ckpt")
        if found is None:
            raise ConfigError(f"{key}={url!r}: {NONE_INTACT}")
        return str(found)
    except Exception as err:
        if not is_store_error(err):
            raise
        raise ConfigError(
            f"{key}={url!r}: cannot read it: {cause(err)}; expected the checkpoint.remote of a run, "
            "readable with the credentials in the environment"
        ) from None


def _nothing_there(store: Any, name: str) -> str:
    from framework.checkpoint.upload import CHECKPOINTS

    if name:
        return f"no published checkpoint {name} under {store.url}; expected the name of one (last, best, step-N)"
    bucket = store.root.partition("/")[0]
    if bucket and not store.fs.exists(bucket):
        return f"no such bucket {bucket!r}; expected the checkpoint.remote of a run"
    return (
        f"no published checkpoint under {store.url}/{CHECKPOINTS}; "
        "expected the checkpoint.remote of a run that saved one"
    )


def _check_local_copy(url: str, run_dir: Path, published: dict[str, dict[str, Any]]) -> None:
    """`run_dir`, which holds a run, may be continued for resume=`url` only where it is that run (its saved
    checkpoint.remote is `url`) and at least as far on as the remote: a stale or another run's directory would
    train from the wrong checkpoint, and its uploads withdraw the remote's newer ones."""
    from omegaconf import OmegaConf

    saved = run_dir / ".hydra" / "config.yaml"
    remote = OmegaConf.select(OmegaConf.load(saved), "checkpoint.remote") if saved.is_file() else None
    if str(remote or "").rstrip("/") != url.rstrip("/"):
        raise ConfigError(
            f"resume={url!r}: hydra.run.dir={str(run_dir)!r} holds another run (its checkpoint.remote is "
            f"{remote!r}); expected a new hydra.run.dir for the copy, or resume={run_dir} for that run"
        )
    steps = []
    for meta in (run_dir / "checkpoints").glob("*/meta.json"):
        with contextlib.suppress(OSError, ValueError):
            steps.append(int(json.loads(meta.read_text()).get("step", -1)))
    local, newest = max(steps, default=-1), max((int(m.get("step", -1)) for m in published.values()), default=-1)
    if local < newest:
        raise ConfigError(
            f"resume={url!r}: hydra.run.dir={str(run_dir)!r} holds this run at step {local}, the remote at step "
            f"{newest}; expected a new hydra.run.dir for the remote's copy, or resume={run_dir} to go on from step "
            f"{local}"
        )


def _holds_run(path: Path) -> bool:
    return (path / "checkpoints").is_dir() and any(p.is_dir() for p in (path / "checkpoints").iterdir())


def _new_run_dir(store: Any, published: dict[str, dict[str, Any]]) -> Path:
    """outputs/<the run's name>/<now>, as a new run's default hydra.run.dir (conf/htf.yaml), for its copy."""
    from framework.checkpoint.download import candidates
    from framework.checkpoint.upload import CHECKPOINTS, DATA

    newest = candidates(published)[0]
    meta = json.loads(store.fs.cat_file(store.path(CHECKPOINTS, DATA, newest["data"], "meta.json")))
    name = str((meta.get("config") or {}).get("name") or "remote")
    return Path("outputs") / Path(name).name / f"{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"


def cache_dir() -> Path:
    """Where ckpt=URL and init_from=URL keep what they downloaded."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hydra-torch-framework" / "remote"
